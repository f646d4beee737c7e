"""Paired timing: alternate the sides (A B A B ...) so machine noise lands on all of them alike."""

from __future__ import annotations

import time
from typing import Callable, Mapping

import torch

from bench.stats import min_median_max_ms, upper_median


def device_sync(device: torch.device) -> Callable[[], None]:
    """What makes a timer honest on `device`: CUDA work is asynchronous, so wait for it."""
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def paired_ms(
    sides: Mapping[str, Callable[[], object]], rounds: int, steps: int, sync: Callable[[], None] = lambda: None
) -> dict[str, dict[str, float]]:
    """Median / min / max milliseconds per call of each side, over `rounds` alternating rounds.
    `sync` (see `device_sync`) runs before each timer starts and before it stops."""
    per_side: dict[str, list[float]] = {name: [] for name in sides}
    for fn in sides.values():  # warm-up outside the timed rounds
        fn()
    for _ in range(rounds):
        for name, fn in sides.items():
            sync()
            t0 = time.perf_counter()
            for _ in range(steps):
                fn()
            sync()
            per_side[name].append((time.perf_counter() - t0) * 1e3 / steps)
    return {name: min_median_max_ms(v) for name, v in per_side.items()}


def median_us_per_call(fn: Callable[[], object], seconds: float, min_calls: int = 5) -> float:
    """µs per call: the median of calls timed one by one for `seconds` (at least `min_calls`), so
    the multi-millisecond stalls a shared machine inflicts now and then (a descheduled vCPU) do not
    move the result."""
    fn()
    times = []
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline or len(times) < min_calls:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return upper_median(times) * 1e6
