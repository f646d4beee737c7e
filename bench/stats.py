"""The benches' statistics, in one place, so "median" or "p99" means the same in every table.

Boundary: arithmetic over lists of numbers; no I/O and no formatting (bench/tables.py formats).
"""

from __future__ import annotations

import statistics
from typing import Any, Iterable, Sequence

PERCENTILES = (50, 90, 99)


def median(values: Iterable[float | None]) -> float | None:
    """The median of the values that are not None; None when none are."""
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def first_difference(ours: Sequence[Any], theirs: Sequence[Any]) -> int | None:
    """The first index where two sequences differ; None when one is a prefix of the other."""
    return next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)


def upper_median(values: Sequence[float]) -> float:
    """The middle of the sorted values (the upper one of an even count): the one-by-one call timers'."""
    return sorted(values)[len(values) // 2]


def min_median_max_ms(values_ms: Sequence[float]) -> dict[str, float]:
    """What a paired side reports: median, min and max milliseconds over its rounds."""
    return {"median_ms": statistics.median(values_ms), "min_ms": min(values_ms), "max_ms": max(values_ms)}


def spread(values: Sequence[float]) -> dict[str, Any] | None:
    """min / median / max over rounds, with their count and the values; None without values."""
    if not values:
        return None
    return {"min": min(values), "median": statistics.median(values), "max": max(values), "rounds": len(values),
            "values": list(values)}


def percentiles(values: Sequence[float], ps: Sequence[int] = PERCENTILES) -> dict[str, float | None]:
    """p50 / p90 / p99 by linear interpolation (numpy's default); None without values."""
    import numpy as np

    if not values:
        return {f"p{p}": None for p in ps}
    return {f"p{p}": float(np.percentile(values, p)) for p in ps}


def distribution(values: Sequence[float]) -> dict[str, float | None]:
    """mean, median, p90, p99 (linear interpolation), min, max and the count."""
    p = percentiles(values)
    return {"mean": statistics.fmean(values) if values else None, "median": p["p50"], "p90": p["p90"],
            "p99": p["p99"], "min": min(values, default=None), "max": max(values, default=None), "count": len(values)}


def nearest_rank_ms(values_s: Sequence[float]) -> dict[str, float]:
    """p50 / p90 / p99 / max of seconds, in milliseconds to 0.1 ms, by nearest rank; and the count."""
    if not values_s:
        return {"n": 0}
    ordered = sorted(values_s)

    def rank(q: float) -> float:
        return round(ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] * 1000, 1)

    return {"n": len(ordered), "p50_ms": rank(0.5), "p90_ms": rank(0.9), "p99_ms": rank(0.99), "max_ms": rank(1.0)}
