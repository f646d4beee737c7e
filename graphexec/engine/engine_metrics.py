"""A snapshot of what the engine is doing, for monitoring (the server's /metrics).

Read from any thread while the loop runs: each number is read once, without stopping the loop,
so two numbers may be a step apart.  Good enough for a dashboard; nothing schedules on them.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping

if TYPE_CHECKING:
    from graphexec.engine.engine_loop import EngineLoop
    from graphexec.runner.model_runner import ModelRunner
    from graphexec.scheduler.scheduler import Scheduler


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

    @classmethod
    def collect(cls, scheduler: Scheduler, runner: ModelRunner, loop: EngineLoop) -> EngineMetrics:
        running = len(scheduler.running)
        kv = scheduler.kv_cache
        free = kv.num_free
        return cls(
            running=running,
            waiting=max(0, loop.num_unfinished() - running),
            kv_slots_total=kv.num_slots,
            kv_slots_used=kv.num_slots - free,
            kv_slots_free=free,
            kv_slots_reserved=_read_while_changing(lambda: scheduler.promised_slots),
            kv_slots_cached=kv.num_cached,
            retractions_total=scheduler.num_retractions,
            tokens_per_s=loop.stats.tokens_per_s(time.perf_counter()),
            generated_tokens_total=loop.stats.tokens_total(),
            finished=loop.stats.finished(),
            backends=runner.backend_stats(),
        )

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _read_while_changing(read: Callable[[], int]) -> int:
    # Summing a dict the loop thread is resizing raises; the next try sees it settled.
    for _ in range(100):
        try:
            return read()
        except RuntimeError:
            continue
    return -1
