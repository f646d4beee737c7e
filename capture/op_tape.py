"""The op tape: a graph recorder that works on any device, by recording aten calls.

Between `begin()` and `end()` every aten op that runs is written down with its argument and
output tensors.  `replay()` calls the ops again, in order, on the same argument tensors and
copies each fresh result into the output tensor recorded for it, so every tensor keeps the
address it had at capture.  Those are a CUDA graph's semantics: replay reads whatever the fixed
input buffers hold now, Python between the ops does not run again, and a value read on the host
during recording (a sync) would be frozen, so it is refused, as CUDA capture refuses it.

A custom op the caller names as traced (graphexec: attention, whose Python route reads this
forward's metadata from the host) is recorded the way a CUDA graph records it: by what it
launches.  Its implementation runs with the tape still on, so its aten ops are written down and
replay re-runs those, not the Python around them, which would read host state of replay time
that a CUDA graph would have frozen.  If its kernel issues no aten op (a native kernel), the call
itself is written down, like every other op.

It is slower than eager (a Python call and a copy per op) and keeps every intermediate alive.
What it is for: the segmented-capture logic of the CUDA path (boundary buffers, static inputs,
breaks between graphs, padding) runs and is tested on a machine without a GPU, and a wrong
buffer shows up as a wrong token rather than as a crash on the one device that can run it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

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


class _TapeMode(TorchDispatchMode):
    """Writes down the aten calls that run while it is active (one tape per begin/end)."""

    def __init__(self, traced_ops: frozenset[str]) -> None:
        super().__init__()
        self.traced_ops = traced_ops
        self.calls: list[_Call] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _HOST_READS:
            raise RuntimeError(f"{func} reads a device value on the host inside a recorded segment; a CUDA graph cannot capture it")
        if func._schema.name in self.traced_ops:
            return self._record_through(func, args, kwargs)
        out = func(*args, **kwargs)
        self._record(func, args, kwargs, out)
        return out

    def _record(self, func, args: tuple, kwargs: dict, out: Any) -> None:
        outputs = [x for x in pytree.tree_leaves(out) if isinstance(x, torch.Tensor)]
        if func._schema.is_mutable or not _only_aliases(outputs, (args, kwargs)):
            self.calls.append(_Call(func, args, kwargs, outputs))

    def _record_through(self, func, args: tuple, kwargs: dict) -> Any:
        """Run a custom op's kernel for its device with this tape still recording (see the module
        docstring); record the call itself only if its kernel issued no aten op."""
        first = len(self.calls)
        with self:
            out = func.redispatch(torch._C.DispatchKeySet(_device_key(args, kwargs)), *args, **kwargs)
        if len(self.calls) == first:
            self._record(func, args, kwargs, out)
        return out


_DEVICE_KEYS = {"cpu": torch._C.DispatchKey.CPU, "cuda": torch._C.DispatchKey.CUDA, "meta": torch._C.DispatchKey.Meta}


def _device_key(args: tuple, kwargs: dict) -> torch._C.DispatchKey:
    devices = {x.device.type for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)}
    if len(devices) != 1 or next(iter(devices)) not in _DEVICE_KEYS:
        raise RuntimeError(f"the op tape records custom ops on one of {sorted(_DEVICE_KEYS)}, got tensors on {sorted(devices)}")
    return _DEVICE_KEYS[devices.pop()]


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

    def __init__(self, traced_ops: Iterable[str] = ()) -> None:
        self.traced_ops = frozenset(traced_ops)
        self._mode: _TapeMode | None = None

    def begin(self) -> None:
        if self._mode is not None:
            raise RuntimeError("begin() while a tape is recording")
        self._mode = _TapeMode(self.traced_ops)
        self._mode.__enter__()

    def end(self) -> Replayable:
        mode, self._mode = self._mode, None
        if mode is None:
            raise RuntimeError("end() without begin()")
        mode.__exit__(None, None, None)
        return Tape(mode.calls)
