"""Does a bucket's graph pay for itself?  Time it against the eager forward on the same padded
batch, interleaved, and keep the graph only if it is faster by more than the noise.

Interleaving (eager, graph, eager, graph, ...) in one thread puts both sides under the same
machine state (another process, frequency, cache), which drifts by 15-35 % between runs on a
small shared CPU; medians of the pairs shed the odd preempted run.  The decision is data
(`BucketDecision`), kept with the plan (capture/plan_store.py) so a warm start does not measure
again.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable

# Interleaved pairs timed per bucket after one untimed call of each side: up to MAX_PAIRS, fewer
# (never under MIN_PAIRS) once the timed calls have taken BUDGET_S, so a big bucket's measurement
# costs about a second, not its forward's time 16 times over.
MAX_PAIRS = 7
MIN_PAIRS = 3
BUDGET_S = 1.0


@dataclass(frozen=True)
class BucketDecision:
    """Whether a bucket runs its graph, and what that was decided on."""

    kept: bool
    reason: str  # "faster", "not faster", "keep=all"
    eager_ms: float | None = None  # median, None when nothing was measured
    graph_ms: float | None = None

    @property
    def speedup(self) -> float | None:
        if not self.eager_ms or not self.graph_ms:
            return None
        return self.eager_ms / self.graph_ms

    def as_dict(self) -> dict[str, Any]:
        speedup = self.speedup
        return {
            "kept": self.kept,
            "reason": self.reason,
            "eager_ms": None if self.eager_ms is None else round(self.eager_ms, 4),
            "graph_ms": None if self.graph_ms is None else round(self.graph_ms, 4),
            "speedup": None if speedup is None else round(speedup, 4),
        }

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "BucketDecision":
        return cls(
            kept=bool(values["kept"]),
            reason=str(values["reason"]),
            eager_ms=None if values.get("eager_ms") is None else float(values["eager_ms"]),
            graph_ms=None if values.get("graph_ms") is None else float(values["graph_ms"]),
        )


def time_interleaved(
    eager: Callable[[], Any], graph: Callable[[], Any], max_pairs: int = MAX_PAIRS, budget_s: float = BUDGET_S
) -> tuple[float, float]:
    """Median milliseconds of `eager` and of `graph`, called alternately (MIN_PAIRS to
    `max_pairs` times each, within about `budget_s`) after one untimed call of each."""
    eager()
    graph()
    eager_ms: list[float] = []
    graph_ms: list[float] = []
    while len(eager_ms) < max_pairs and (len(eager_ms) < MIN_PAIRS or sum(eager_ms) + sum(graph_ms) < budget_s * 1000.0):
        for fn, out in ((eager, eager_ms), (graph, graph_ms)):
            t0 = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t0) * 1000.0)
    return statistics.median(eager_ms), statistics.median(graph_ms)


def decide(eager_ms: float, graph_ms: float, min_speedup: float) -> BucketDecision:
    """Keep the graph only if eager takes at least `min_speedup` times as long."""
    kept = eager_ms >= min_speedup * graph_ms
    return BucketDecision(kept=kept, reason="faster" if kept else "not faster", eager_ms=eager_ms, graph_ms=graph_ms)
