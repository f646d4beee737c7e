"""Paired timing: alternate the sides (A B A B ...) so machine noise lands on all of them alike."""

from __future__ import annotations

import statistics
import time
from typing import Callable, Mapping


def paired_ms(sides: Mapping[str, Callable[[], object]], rounds: int, steps: int) -> dict[str, dict[str, float]]:
    """Median / min / max milliseconds per call of each side, over `rounds` alternating rounds."""
    per_side: dict[str, list[float]] = {name: [] for name in sides}
    for fn in sides.values():  # warm-up outside the timed rounds
        fn()
    for _ in range(rounds):
        for name, fn in sides.items():
            t0 = time.perf_counter()
            for _ in range(steps):
                fn()
            per_side[name].append((time.perf_counter() - t0) * 1e3 / steps)
    return {
        name: {"median_ms": statistics.median(v), "min_ms": min(v), "max_ms": max(v)} for name, v in per_side.items()
    }
