"""A tensor-parallel rank other than 0: build the same runner on its shard, then serve the steps
rank 0 announces (graphexec/parallel/worker.py), until told to stop or the group breaks.

    python -m graphexec.engine.tp_worker RANK WORLD INIT_METHOD PARENT_PID  < JSON config
        (started by rank 0 on one machine: graphexec/parallel/launch.py LocalWorkers)
    run_worker(config, info)
        (under torchrun: graphexec-serve / graphexec-generate on ranks != 0)
"""

from __future__ import annotations

import logging
import sys

import torch

from graphexec.config import EngineConfig
from graphexec.engine.rank_setup import load_and_capture
from graphexec.parallel import launch
from graphexec.parallel.worker import serve_steps

_log = logging.getLogger(__name__)


def run_worker(config: EngineConfig, info: launch.RankInfo) -> None:
    config = launch.rank_config(config, info)
    torch.set_num_threads(launch.threads_per_rank(config, info))
    ctx = launch.join(config, info)
    try:
        with torch.inference_mode():
            rank = load_and_capture(config, ctx.tp)
            launch.serving(ctx, config.parallel.timeout_s, config.device)
            serve_steps(ctx.control, rank.runner, rank.kv_cache)
    finally:
        launch.leave()


def run_if_worker(config: EngineConfig) -> bool:
    """Under torchrun, on a rank other than 0: serve as a worker until rank 0 stops, then True.
    False everywhere else (the caller goes on to build the Engine)."""
    info = launch.from_torchrun()
    if info is None or config.parallel.tp_size == 1 and info.world_size == 1:
        return False
    launch.check_world(config, info)
    if info.is_driver:
        return False
    run_worker(config, info)
    return True


def main() -> None:
    rank, world, init_method, parent = sys.argv[1:5]
    launch.watch_parent(int(parent))
    config = launch.load_config(sys.stdin.buffer)
    info = launch.RankInfo(int(rank), int(world), int(rank), int(world), init_method)
    try:
        run_worker(config, info)
    except Exception:
        _log.exception("tensor-parallel rank %s failed", rank)
        sys.exit(1)


if __name__ == "__main__":
    main()
