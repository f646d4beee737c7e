"""The capture process of a serving engine (graphexec/engine/background_capture.py starts it):
build the engine's model and runner from the engine's config, compile the buckets it was given
and save their artifacts where the engine's capture then loads them, reporting each on stdout.

    python -m graphexec.engine.capture_worker PARENT_PID  < {"config", "work", "key", "threads"}

`work`: [config path, bucket, "graph" | "interim"] in the order to build them (a bucket's
stand-in, `compile.interim_buckets`, comes before any graph).

It times nothing and writes no plan: the engine times each bucket it loads against eager and
keeps the plan.  A key that differs from the engine's (another thread count, another CPU model
name: anything capture_key reads of the process) would store the artifacts where the engine
never looks, so it stops before compiling anything.  Its KV pool is small (`_SLOTS` at most; the
capture batches' padding rows all write one dummy slot): the artifacts do not depend on the
pool's size (the attention op reads the pool outside any graph; capture_key leaves it out).
"""

from __future__ import annotations

import json
import logging
import signal
import sys
from dataclasses import replace

import torch

from graphexec.config import EngineConfig
from graphexec.engine.background_capture import INTERIM, Report
from graphexec.engine.rank_setup import load_and_capture
from graphexec.parallel import launch
from graphexec.parallel.replicas import die_with

_log = logging.getLogger(__name__)
_SLOTS = 1024
# Exit codes the engine's warning quotes.
KEY_MISMATCH = 3


def main() -> None:
    _die_with(int(sys.argv[1]))
    logging.basicConfig(level=logging.WARNING)
    job = json.load(sys.stdin.buffer)
    torch.set_num_threads(int(job["threads"]))
    config = EngineConfig.from_mapping(job["config"])
    config = replace(config, cache=replace(config.cache, num_slots=min(config.cache.num_slots, _SLOTS), prefix_cache=False))
    runner = load_and_capture(config, capture=False).runner
    if runner.artifact_key != job["key"]:
        _log.error("this process's capture key %s is not the engine's %s: nothing built", runner.artifact_key, job["key"])
        sys.exit(KEY_MISMATCH)
    for config_path, bucket, stage in job["work"]:
        _report(Report("start", config_path, bucket, stage=stage))
        try:
            runner.build_apart(config_path, bucket, interim=stage == INTERIM)
        except Exception as error:  # noqa: BLE001 - the engine captures this bucket itself
            _log.exception("building %s bucket %d (%s) failed", config_path, bucket, stage)
            _report(Report("failed", config_path, bucket, f"{error!r}"[:300], stage))
        else:
            _report(Report("done", config_path, bucket, stage=stage))


def _die_with(engine_pid: int) -> None:
    """Killed when the engine thread that started this process ends, even while stopped: the
    engine stops this process whenever it serves, and a stopped process cannot watch for its
    parent (where the platform has no parent-death signal it watches while it runs)."""
    if not die_with(engine_pid, signal.SIGKILL, "capture process"):
        launch.watch_parent(engine_pid)


def _report(report: Report) -> None:
    sys.stdout.buffer.write(report.line())
    sys.stdout.buffer.flush()


if __name__ == "__main__":
    main()
