"""Rank 0's side of tensor parallelism: the other ranks, the process group, and the step channel
that announces every forward to them (step_sync.py's StepSender, handed to rank 0's ModelRunner).

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
        # Keep-alives well inside the timeout, so an idle engine never looks hung to its workers.
        self.channel = StepSender(self.ctx.control, info.world_size, keep_alive_s=self.config.parallel.timeout_s / 4)
        self._serving = False

    @property
    def tp(self):
        return self.ctx.tp

    def start_serving(self) -> None:
        """After capture (which every rank runs in lockstep, announcing nothing): serving timeouts on."""
        launch.serving(self.ctx, self.config.parallel.timeout_s, self.config.device)
        self._serving = True

    def close(self) -> None:
        failed = self.channel.failed is not None
        if self._serving:  # before that, workers listen for nothing: they are stopped below
            self.channel.stop()
        if self.workers is not None:
            # After a failure a worker may be hung (and never exit): no grace period then.
            self.workers.stop(grace_s=0.5 if failed else launch.STOP_GRACE_S)
        launch.leave()
