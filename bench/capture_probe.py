"""Start an engine in this (fresh) process and print, as one JSON line on stdout, what starting it
cost: whole start seconds, peak RSS, and per distinct capture backend its seconds and bytes per
bucket.  The capture suite (bench/capture.py) runs it once per phase, cold and warm.

    graphexec-bench capture_probe model=tiny-llama capture.decode.buckets=[1,4]

On failure it exits non-zero with a one-line reason as the last line of stderr.
"""

from __future__ import annotations

import resource
import time
from typing import Any

from bench.workers import emit


def config_without_progress_bars(overrides: list[str]):
    """The engine config for `overrides`, with capture progress bars off: they would bury the
    error line on stderr.  Capture happens before the engine returns (`capture.background=false`),
    so what is timed is the plan's steady state.  Modes that alias another mode's spec
    (`mixed: ${.extend}`) are left alone, so they keep resolving to the very same spec and still
    share its backend."""
    from omegaconf import DictConfig, OmegaConf

    from graphexec.batch.forward_mode import ForwardMode
    from graphexec.config import EngineConfig, compose

    cfg = compose(overrides)
    quiet = [
        f"capture.{key}.progress=false"
        for key in (mode.config_key for mode in ForwardMode)
        if key in cfg.capture and not OmegaConf.is_interpolation(cfg.capture, key)
        and isinstance(cfg.capture[key], DictConfig) and "progress" in cfg.capture[key]
    ]
    return EngineConfig.from_dictconfig(compose([*overrides, *quiet, "++capture.background=false"]))


def distinct_backends(runner) -> list[dict[str, Any]]:
    """One entry per backend instance: modes sharing a spec share one instance (ModelRunner
    builds one per distinct spec), so `backend_stats()`, keyed by mode, would count it twice."""
    by_instance: dict[int, dict[str, Any]] = {}
    for mode, backend in runner.backends.items():
        stats = backend.stats
        entry = by_instance.setdefault(id(backend), {
            "modes": [], "backend": backend.name, "buckets": [],
            "executions": stats.executions, "fallbacks": stats.fallbacks, "padded_rows": stats.padded_rows,
        })
        entry["modes"].append(mode.config_key)
        if entry["buckets"]:
            continue
        # Every bucket with a state: a dropped one has no capture seconds when a stored plan
        # skipped it, and its timings when it was measured here.
        rows = sorted(set(stats.capture_seconds) | set(stats.states))
        entry["buckets"] = [
            {
                "bucket": bucket,
                "seconds": stats.capture_seconds.get(bucket),
                "bytes": stats.capture_bytes.get(bucket, 0),
                "state": stats.states.get(bucket),
                "origin": stats.origins.get(bucket),  # artifact (loaded) | compiled | dynamo | None
            }
            | (stats.decisions[bucket].as_dict() if bucket in stats.decisions else {})
            for bucket in rows
        ]
    return list(by_instance.values())


def peak_rss_bytes() -> int:
    # ru_maxrss is KiB on Linux.  Inductor's compile workers are other processes: not counted.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def probe(overrides: list[str]) -> dict[str, Any]:
    t0 = time.perf_counter()
    from graphexec import Engine

    engine = Engine(config=config_without_progress_bars(overrides))
    start_seconds = time.perf_counter() - t0
    return {"start_seconds": start_seconds, "peak_rss_bytes": peak_rss_bytes(), "backends": distinct_backends(engine.runner)}


def main(argv: list[str]) -> None:
    emit("probe", lambda: probe(argv))
