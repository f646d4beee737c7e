"""A tensor-parallel rank other than 0, once built (graphexec/engine/tp_worker.py builds it): run
every forward rank 0 announces, until told to stop or the group breaks.

A worker samples nothing and schedules nothing: it mirrors rank 0's request → token table from
the changes each message carries and computes its share of each forward, whose collectives
rank 0 joins.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.distributed as dist

from graphexec.batch.forward_batch import ForwardBatch
from graphexec.parallel.step_sync import StepKind, receive


class StepRunner(Protocol):
    """What a worker runs each announced batch through (a graphexec/runner ModelRunner)."""

    device: torch.device

    def forward_logits(self, fb: ForwardBatch) -> object: ...


class TableMirror(Protocol):
    """The worker's copy of rank 0's request → token table (a graphexec/cache KVCacheManager)."""

    def replay_table_changes(self, changes: list) -> None: ...


def serve_steps(control: dist.ProcessGroup, runner: StepRunner, table: TableMirror) -> None:
    """Receive and run steps until rank 0 says STOP (a broken group raises WorkerFailedError)."""
    while True:
        message = receive(control)
        table.replay_table_changes(list(message.table_changes))
        if message.kind is StepKind.STOP:
            return
        if message.kind is StepKind.FORWARD:
            runner.forward_logits(message.batch.to(runner.device))
