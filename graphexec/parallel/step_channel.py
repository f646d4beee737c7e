"""How a rank's ModelRunner tells the other tensor-parallel ranks about each forward: a step
channel, handed to the runner when it is built (graphexec/engine/rank_setup.py).

Rank 0 of several gets a `StepSender` (step_sync.py): before each forward it sends the batch and
the request → token table changes since the last message, and when idle it sends keep-alives.
Every other rank, and a single rank, gets `NO_PEERS`, which sends nothing.  The runner calls
the channel the same way either way, so no code path asks how many ranks there are.
"""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager
from typing import Protocol

from graphexec.batch.forward_batch import ForwardBatch


class StepChannel(Protocol):
    @property
    def keep_alive_s(self) -> float | None:
        """How often an idle rank 0 must call `keep_alive`; None: never."""

    def step(self, fb: ForwardBatch, table_changes: list) -> AbstractContextManager[None]:
        """Announce fb's forward (and the table changes before it); the body runs this rank's share."""

    def keep_alive(self, table_changes: list) -> None:
        """Idle: tell the other ranks this one is alive (sends only when keep_alive_s has passed)."""


class NoPeers:
    """The channel of a rank that announces nothing: one rank alone, or a worker rank."""

    keep_alive_s: float | None = None

    def step(self, fb: ForwardBatch, table_changes: list) -> AbstractContextManager[None]:
        return contextlib.nullcontext()

    def keep_alive(self, table_changes: list) -> None:
        pass


NO_PEERS = NoPeers()
