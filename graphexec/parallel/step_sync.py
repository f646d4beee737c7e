"""Rank 0 → the other tensor-parallel ranks, once per step: what to run next.

Rank 0 owns the scheduler and the KV allocation; the other ranks own only their shard of the
weights and of the KV pool.  Before every forward rank 0 broadcasts a `StepMessage`: the
ForwardBatch without its sampling state (only rank 0 samples) and the changes its request →
token table made since the last message (graphexec/cache/req_to_token_pool.py's journal).  Every
rank then runs the same forward and the same LM-head rows, whose collectives keep them in step.

The message travels in a fixed wire format (step_schema.py, step_codec.py: int64 words and raw
integer-tensor bytes, never pickle; a worker builds nothing the bytes name) over a gloo group of
torch.distributed's (also on CUDA, where the model's collectives use NCCL): an 8-byte length and
the message in a fixed-size byte buffer, so a step costs one broadcast; a message longer than the
buffer (a long prompt's chunk) follows in a second.  A worker that receives a malformed message
raises WorkerFailedError and exits, and the group fails with it.

Any failure inside a step leaves the ranks out of step (some wait in a collective the others
will never join), so it is fatal: `StepSender.step` turns it into WorkerFailedError, and the
engine fails its requests and stops.  A rank that hangs is caught by the process group's
timeout (`parallel.timeout_s`); an idle rank 0 sends keep-alive messages so that waiting
workers never mistake idleness for a hang.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Iterator

import torch
import torch.distributed as dist

from graphexec.batch.forward_batch import ForwardBatch
from graphexec.errors import WorkerFailedError
from graphexec.parallel.step_codec import decode, encode
from graphexec.parallel.step_schema import StepKind, StepMessage, StepMessageError

__all__ = ["StepKind", "StepMessage", "StepSender", "receive"]

# One broadcast carries a message up to this size (a decode step's is ~0.5 KiB); the rest follows.
_BUFFER_BYTES = 64 * 1024
_LENGTH_BYTES = 8
# A length past this is no step message (a 32k-token chunk with its table changes is ~1.5 MiB): a
# worker refuses it rather than allocate whatever a corrupt or hostile length asks for.
_MAX_MESSAGE_BYTES = 1 << 30


class StepSender:
    """Rank 0's end.  `group` is the gloo control group; `ranks` the other ranks (for errors)."""

    def __init__(self, group: dist.ProcessGroup, world_size: int, keep_alive_s: float):
        self.group = group
        self.world_size = world_size
        self.keep_alive_s = keep_alive_s
        self._last_sent = time.monotonic()
        self._failed: WorkerFailedError | None = None

    @contextlib.contextmanager
    def step(self, fb: ForwardBatch, table_changes: list) -> Iterator[None]:
        """Send fb, then run the body (this rank's share of the same forward); any error on the
        way is fatal (WorkerFailedError)."""
        batch = dataclasses.replace(fb, sampling_info=None)  # encoding copies its tensors to the CPU
        with self._fatal("a step"):
            self._send(StepMessage(StepKind.FORWARD, batch, tuple(table_changes)))
            yield

    def keep_alive(self, table_changes: list) -> None:
        """Send a no-op if nothing was sent for keep_alive_s (the engine loop calls it when idle)."""
        if time.monotonic() - self._last_sent >= self.keep_alive_s:
            with self._fatal("a keep-alive"):
                self._send(StepMessage(StepKind.KEEP_ALIVE, table_changes=tuple(table_changes)))

    def stop(self) -> None:
        """Tell the workers to exit (best effort: they may already be gone)."""
        if self._failed is None:
            with contextlib.suppress(Exception):
                self._send(StepMessage(StepKind.STOP))

    @property
    def failed(self) -> WorkerFailedError | None:
        return self._failed

    def _send(self, message: StepMessage) -> None:
        if self._failed is not None:
            raise self._failed
        payload = encode(message)
        head = bytearray(_BUFFER_BYTES)
        head[:_LENGTH_BYTES] = len(payload).to_bytes(_LENGTH_BYTES, "little")
        first = payload[: _BUFFER_BYTES - _LENGTH_BYTES]
        head[_LENGTH_BYTES : _LENGTH_BYTES + len(first)] = first
        dist.broadcast(torch.frombuffer(head, dtype=torch.uint8), src=0, group=self.group)
        if len(payload) > len(first):
            rest = torch.frombuffer(bytearray(payload[len(first) :]), dtype=torch.uint8)
            dist.broadcast(rest, src=0, group=self.group)
        self._last_sent = time.monotonic()

    @contextlib.contextmanager
    def _fatal(self, what: str) -> Iterator[None]:
        try:
            yield
        except WorkerFailedError:
            raise
        except Exception as error:
            self._failed = WorkerFailedError(
                f"tensor parallelism ({self.world_size} ranks) failed during {what}: {error}. The ranks are out "
                "of step, so the engine stops; a rank that died, hung past parallel.timeout_s, or raised is the "
                "usual cause (see that rank's log)"
            )
            raise self._failed from error


def receive(group: dist.ProcessGroup) -> StepMessage:
    """A worker's end: block for rank 0's next message.  A malformed one raises WorkerFailedError
    (the worker exits, and the group fails with it)."""
    head = torch.empty(_BUFFER_BYTES, dtype=torch.uint8)
    dist.broadcast(head, src=0, group=group)
    length = int.from_bytes(head[:_LENGTH_BYTES].numpy().tobytes(), "little")
    try:
        if not 0 < length <= _MAX_MESSAGE_BYTES:
            raise StepMessageError(f"message length {length} is not in 1..{_MAX_MESSAGE_BYTES}")
        payload = head[_LENGTH_BYTES : _LENGTH_BYTES + length]
        if length > payload.numel():
            rest = torch.empty(length - payload.numel(), dtype=torch.uint8)
            dist.broadcast(rest, src=0, group=group)
            payload = torch.cat((payload, rest))
        return decode(payload)
    except StepMessageError as error:
        raise WorkerFailedError(f"rank 0 sent a malformed step message: {error}") from error
