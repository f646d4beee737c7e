"""What a step costs as a function of its rows, measured on the running engine.

A decode step of B requests and a verify step of R token rows run the same decode-shaped forward
(graphexec/batch/forward_mode.py TARGET_VERIFY), so one table keyed by rows prices both.  Every
decode and verify step the scheduler runs adds its wall time (forward, sampling and bookkeeping)
to the entry of its row count; an entry is the least of its last `window` times.  Interference
only ever adds time, so the least is the step's own cost, and one slow step (a page fault, a
neighbour) does not price a row count for good, as it would in an average seeded by it; graphs
swapped in by background capture or a longer context move it within `window` steps.  A row count never
measured is interpolated between measured neighbours, or extrapolated with a per-row slope
(measured between the two largest entries, else `prior_row_fraction` of the largest's per-row
time: about what an extra row cost SmolLM2 at small batches on a 2-core CPU, see the step-ms line
of `graphexec-bench bench=spec`); a guess on the cheap side, so a size gets tried and is then
priced by what it really cost.
"""

from __future__ import annotations

import bisect
from collections import deque


class StepCosts:
    def __init__(self, window: int = 8, prior_row_fraction: float = 0.25):
        self.prior_row_fraction = prior_row_fraction
        self._window = window
        self._samples: dict[int, deque[float]] = {}
        self._seconds: dict[int, float] = {}
        self._rows: list[int] = []  # measured row counts, sorted

    def observe(self, rows: int, seconds: float) -> None:
        samples = self._samples.get(rows)
        if samples is None:
            bisect.insort(self._rows, rows)
            samples = self._samples[rows] = deque(maxlen=self._window)
        samples.append(seconds)
        self._seconds[rows] = min(samples)

    def measured(self, rows: int) -> bool:
        return rows in self._seconds

    def estimate(self, rows: int) -> float | None:
        """Seconds for a step of `rows` rows; None before any step was measured."""
        if rows in self._seconds:
            return self._seconds[rows]
        if not self._rows:
            return None
        at = bisect.bisect_left(self._rows, rows)
        if 0 < at < len(self._rows):
            lo, hi = self._rows[at - 1], self._rows[at]
            t_lo, t_hi = self._seconds[lo], self._seconds[hi]
            return t_lo + (t_hi - t_lo) * (rows - lo) / (hi - lo)
        if at == 0:  # below every measurement: never cheaper than nothing, never dearer than the smallest
            return self._seconds[self._rows[0]]
        top = self._rows[-1]
        if len(self._rows) >= 2:
            below = self._rows[-2]
            slope = max(0.0, (self._seconds[top] - self._seconds[below]) / (top - below))
        else:
            slope = self.prior_row_fraction * self._seconds[top] / top
        return self._seconds[top] + slope * (rows - top)

    def as_dict(self) -> dict[int, float]:
        return {rows: round(self._seconds[rows] * 1e3, 3) for rows in self._rows}
