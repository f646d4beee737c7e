"""What the engine is doing, for monitoring (the server's /metrics, /health, `Engine.metrics()`).

The scheduler, the KV cache and the runner belong to the engine loop's thread.  After every
iteration, before any caller hears of its results, the loop publishes a `LoopSnapshot` of their
numbers (frozen; replaced whole, never changed), and every other thread reads only that.  So a
client that reads the metrics right after its answer sees its request finished and its KV
released, and no reader ever walks a structure the loop is changing.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Mapping

if TYPE_CHECKING:
    from graphexec.engine.serving_stats import ServingStats
    from graphexec.runner.model_runner import ModelRunner
    from graphexec.scheduler.scheduler import Scheduler


@dataclass(frozen=True)
class LoopSnapshot:
    """The loop-owned numbers, as of the end of one loop iteration."""

    running: int
    kv_slots_total: int
    kv_slots_free: int
    kv_slots_reserved: int
    kv_slots_cached: int
    retractions_total: int
    backends: Mapping[str, Mapping[str, Any]]
    speculation: Mapping[str, Any] | None = None  # SpeculationStats.as_dict(); None: speculation off

    @classmethod
    def take(cls, scheduler: Scheduler, runner: ModelRunner) -> LoopSnapshot:
        """On the thread that owns scheduler and runner (the loop's, or the builder's before it starts)."""
        kv = scheduler.kv_cache
        return cls(
            running=len(scheduler.running),
            kv_slots_total=kv.num_slots,
            kv_slots_free=kv.num_free,
            kv_slots_reserved=scheduler.promised_slots,
            kv_slots_cached=kv.num_cached,
            retractions_total=scheduler.num_retractions,
            backends=runner.backend_stats(),
            speculation=None if scheduler.speculator is None else scheduler.speculator.stats().as_dict(),
        )


@dataclass(frozen=True)
class EngineMetrics:
    running: int  # requests in the decode batch
    waiting: int  # requests submitted and not running yet (queued for a batch slot or KV)
    kv_slots_total: int
    kv_slots_used: int
    kv_slots_free: int
    # Slots admission counts as spoken for beyond what requests have mapped: their worst case
    # (scheduler.admission=reserve) or the tokens they still compute plus the decode estimate (optimistic).
    kv_slots_reserved: int
    kv_slots_cached: int  # owned by the prefix cache (part of kv_slots_used; evictable unless in use)
    retractions_total: int  # running requests whose KV was taken back under pressure (they resumed later)
    tokens_per_s: float  # generated tokens per second over the last few seconds
    generated_tokens_total: int
    finished: Mapping[str, int]  # ended requests by finish reason, plus "error"
    backends: Mapping[str, Mapping[str, Any]]  # per ForwardMode: backend name, replays, fallbacks, ...
    # Speculative decoding (None when off): verify steps, drafted and accepted tokens, acceptance
    # rate, mean accepted drafts per verified request-step and their histogram, measured step ms by rows.
    speculation: Mapping[str, Any] | None = None

    @classmethod
    def collect(cls, snapshot: LoopSnapshot, unfinished: int, stats: ServingStats) -> EngineMetrics:
        """From the loop's last snapshot, its count of unfinished requests and its serving stats
        (both kept under their own locks, readable from any thread)."""
        return cls(
            running=snapshot.running,
            waiting=max(0, unfinished - snapshot.running),
            kv_slots_total=snapshot.kv_slots_total,
            kv_slots_used=snapshot.kv_slots_total - snapshot.kv_slots_free,
            kv_slots_free=snapshot.kv_slots_free,
            kv_slots_reserved=snapshot.kv_slots_reserved,
            kv_slots_cached=snapshot.kv_slots_cached,
            retractions_total=snapshot.retractions_total,
            tokens_per_s=stats.tokens_per_s(time.perf_counter()),
            generated_tokens_total=stats.tokens_total(),
            finished=stats.finished(),
            backends=snapshot.backends,
            speculation=snapshot.speculation,
        )

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)
