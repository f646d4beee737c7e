"""Rank 0's side of tensor parallelism: the other ranks, the process group, and the sender that
announces every forward to them (graphexec/parallel/step_sync.py).

Outside torchrun, rank 0 starts ranks 1..N-1 itself on this machine; under torchrun they already
exist (on any machine) and rank 0 only joins.  `close` stops them: a STOP message, then a grace
period, then SIGKILL for a worker still there, so shutdown never leaves an orphan.
"""

from __future__ import annotations

import torch

from graphexec.config import EngineConfig
from graphexec.errors import ConfigError
from graphexec.parallel import launch
from graphexec.parallel.step_sync import StepSender


class TPDriver:
    def __init__(self, config: EngineConfig):
        info = launch.from_torchrun()
        self.workers: launch.LocalWorkers | None = None
        if info is None:
            self.workers = launch.LocalWorkers.start(config)
            info = self.workers.info
        else:
            launch.check_world(config, info)
            if not info.is_driver:
                raise ConfigError(
                    f"the Engine runs on rank 0; rank {info.rank} of torchrun's {info.world_size} must run "
                    "graphexec.engine.tp_worker.run_worker (graphexec-serve and graphexec-generate do)"
                )
        self.config = launch.rank_config(config, info)
        torch.set_num_threads(launch.threads_per_rank(config, info))
        self.ctx = self.workers.join_group(self.config) if self.workers else launch.join(self.config, info)
        self.sender: StepSender | None = None

    @property
    def tp(self):
        return self.ctx.tp

    def start_serving(self) -> StepSender:
        """After capture: serving timeouts on, and the sender the runner announces steps with."""
        timeout_s = self.config.parallel.timeout_s
        launch.serving(self.ctx, timeout_s, self.config.device)
        # Keep-alives well inside the timeout, so an idle engine never looks hung to its workers.
        self.sender = StepSender(self.ctx.control, self.ctx.info.world_size, keep_alive_s=timeout_s / 4)
        return self.sender

    def close(self) -> None:
        failed = self.sender is not None and self.sender.failed is not None
        if self.sender is not None:
            self.sender.stop()
        if self.workers is not None:
            # After a failure a worker may be hung (and never exit): no grace period then.
            self.workers.stop(grace_s=0.5 if failed else launch.STOP_GRACE_S)
        launch.leave()
