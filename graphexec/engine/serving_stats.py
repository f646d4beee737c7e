"""Counters of the engine loop (tokens generated, requests ended), readable from any thread."""

from __future__ import annotations

import threading
from collections import Counter, deque

# Throughput is averaged over the last few seconds: long enough to smooth single steps, short
# enough that /metrics shows the current load rather than the lifetime average.
THROUGHPUT_WINDOW_S = 10.0


class ServingStats:
    def __init__(self, window_s: float = THROUGHPUT_WINDOW_S):
        self._window_s = window_s
        self._lock = threading.Lock()
        self._steps: deque[tuple[float, int]] = deque()  # (time, tokens generated) per step
        self._tokens_total = 0
        self._finished: Counter[str] = Counter()

    def record_tokens(self, now: float, count: int) -> None:
        if count == 0:
            return
        with self._lock:
            self._steps.append((now, count))
            self._tokens_total += count
            self._drop_old(now)

    def record_finish(self, reason: str) -> None:
        with self._lock:
            self._finished[reason] += 1

    def tokens_per_s(self, now: float) -> float:
        with self._lock:
            self._drop_old(now)
            return sum(count for _, count in self._steps) / self._window_s

    def tokens_total(self) -> int:
        with self._lock:
            return self._tokens_total

    def finished(self) -> dict[str, int]:
        """Requests ended so far, per finish reason ("stop", "length", "abort", "error")."""
        with self._lock:
            return {reason: self._finished[reason] for reason in ("stop", "length", "abort", "error")}

    def _drop_old(self, now: float) -> None:
        while self._steps and self._steps[0][0] < now - self._window_s:
            self._steps.popleft()
