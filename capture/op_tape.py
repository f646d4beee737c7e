"""The op tape: a graph recorder that works on any device, by recording aten calls.

Between `begin()` and `end()` every aten op that runs is written down with its argument and
output tensors.  `replay()` calls the ops again, in order, on the same argument tensors and
copies each fresh result into the output tensor recorded for it, so every tensor keeps the
address it had at capture.  Those are a CUDA graph's semantics: replay reads whatever the fixed
input buffers hold now, Python between the ops does not run again, and a value read on the host
during recording (a sync) would be frozen, so it is refused, as CUDA capture refuses it.

It is slower than eager (a Python call and a copy per op) and keeps every intermediate alive.
What it is for: the segmented-capture logic of the CUDA path (boundary buffers, static inputs,
breaks between graphs, padding) runs and is tested on a machine without a GPU, and a wrong
buffer shows up as a wrong token rather than as a crash on the one device that can run it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from capture.segments import GraphRecorder, Replayable

aten = torch.ops.aten
# Ops whose result depends on device values read on the host: not capturable in a CUDA graph.
_HOST_READS = frozenset({aten._local_scalar_dense.default, aten.nonzero.default, aten.equal.default, aten.is_nonzero.default})


@dataclass
class _Call:
    op: torch._ops.OpOverload
    args: tuple
    kwargs: dict
    outputs: list[torch.Tensor]

    def replay(self) -> None:
        fresh = [x for x in pytree.tree_leaves(self.op(*self.args, **self.kwargs)) if isinstance(x, torch.Tensor)]
        for recorded, value in zip(self.outputs, fresh, strict=True):
            if value is not recorded:
                recorded.copy_(value)


class _Recording(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[_Call] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _HOST_READS:
            raise RuntimeError(f"{func} reads a device value on the host inside a recorded segment; a CUDA graph cannot capture it")
        out = func(*args, **kwargs)
        outputs = [x for x in pytree.tree_leaves(out) if isinstance(x, torch.Tensor)]
        if func._schema.is_mutable or not _only_aliases(outputs, (args, kwargs)):
            self.calls.append(_Call(func, args, kwargs, outputs))
        return out


def _only_aliases(outputs: list[torch.Tensor], inputs: Any) -> bool:
    """Whether every output shares memory with an input: a view of tensors the tape already holds
    stays valid without replay.  Decided on the tensors, not the schema: `reshape` and
    `contiguous` are declared aliasing but copy when they must."""
    storages = {x.untyped_storage().data_ptr() for x in pytree.tree_leaves(inputs) if isinstance(x, torch.Tensor)}
    return all(x.untyped_storage().data_ptr() in storages for x in outputs)


class Tape(Replayable):
    def __init__(self, calls: list[_Call]):
        self.calls = calls

    def replay(self) -> None:
        for call in self.calls:
            call.replay()


class TapeRecorder(GraphRecorder):
    name = "tape"

    def __init__(self) -> None:
        self._recording: _Recording | None = None

    def begin(self) -> None:
        if self._recording is not None:
            raise RuntimeError("begin() while a tape is recording")
        self._recording = _Recording()
        self._recording.__enter__()

    def end(self) -> Replayable:
        recording, self._recording = self._recording, None
        if recording is None:
            raise RuntimeError("end() without begin()")
        recording.__exit__(None, None, None)
        return Tape(recording.calls)
