"""Where a decode step's time goes outside the model: timers around the engine's own calls.

    forward        ModelRunner.forward: the capture backend's forward (padding, attention
                   metadata, the graph or eager model), the model's hidden rows
    logits+sample  the rest of ModelRunner.forward_and_sample: LM head on the sampled rows, sampler
    scheduler      the rest of Scheduler.step: admission, slot allocation, ForwardBatch building,
                   appending tokens, finishing requests
    publish        the engine loop's per-step publishing: detokenizing, stop strings, streams

Host overhead is everything but `forward` and `logits+sample`, as a share of the whole step.

`graphexec-bench host_overhead [pytest options]` runs the pytest-benchmark micro-suites of the same
host-side costs (tests/test_bench_host_overhead.py; the default test run skips them).
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

MICRO_SUITES = Path(__file__).resolve().parent.parent / "tests" / "test_bench_host_overhead.py"


@contextmanager
def step_timers(engine) -> Iterator[list[dict[str, Any]]]:
    """Time every engine-loop step while inside; yields the list the per-step records go into.
    Wraps the calls on these instances only, and restores them on exit."""
    records: list[dict[str, Any]] = []
    current: dict[str, Any] = {}  # this step's seconds per wrapped call, its mode and batch size

    def timed(obj, name: str, before: Callable = lambda *args: None, after: Callable = lambda: None):
        fn = getattr(obj, name)

        def wrapper(*args, **kwargs):
            before(*args)
            t0 = time.perf_counter()
            try:
                out = fn(*args, **kwargs)
            finally:
                current[name] = current.get(name, 0.0) + time.perf_counter() - t0
            after()
            return out

        setattr(obj, name, wrapper)
        return obj, name

    def record() -> None:  # after publishing, which ends a step
        if "step" in current:
            records.append(dict(current))

    def mode(fb) -> None:
        current.update(mode=fb.forward_mode.name.lower(), batch_size=fb.batch_size)

    patched = [timed(engine.runner, "forward", before=mode), timed(engine.runner, "forward_and_sample"),
               timed(engine.scheduler, "step", before=current.clear), timed(engine.loop, "publish", after=record)]
    try:
        yield records
    finally:
        for obj, name in patched:
            delattr(obj, name)  # the class's method shows through again


def breakdown(records: list[dict[str, Any]], mode: str = "decode") -> dict[str, float]:
    """Mean milliseconds per step of each part, over the steps of `mode`, and the host share."""
    steps = [r for r in records if r.get("mode") == mode and "forward_and_sample" in r]
    if not steps:
        return {}

    def mean_ms(fn) -> float:
        return 1e3 * sum(fn(r) for r in steps) / len(steps)

    parts = {"forward_ms": mean_ms(lambda r: r["forward"]),
             "logits_sample_ms": mean_ms(lambda r: r["forward_and_sample"] - r["forward"]),
             "scheduler_ms": mean_ms(lambda r: r["step"] - r["forward_and_sample"]),
             "publish_ms": mean_ms(lambda r: r.get("publish", 0.0))}
    total = sum(parts.values())
    return {"steps": len(steps), **parts, "step_ms": total,
            "host_fraction": (parts["scheduler_ms"] + parts["publish_ms"]) / total}


def main(argv: list[str]) -> int:
    import pytest

    os.environ["GRAPHEXEC_BENCH_MICRO"] = "1"  # the micro-suites' switch: skipped without it
    return pytest.main([str(MICRO_SUITES), "--benchmark-only", "-p", "no:cacheprovider", *argv])
