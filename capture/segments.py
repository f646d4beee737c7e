"""Segmented capture: a forward recorded as [graph, break, graph, ..., graph] and replayed so.

This is the Breakable CUDA Graph mechanism, independent of what a "graph" is: a
`GraphRecorder` (capture/recorders.py) opens and closes graphs; `record_segments` runs a
forward with every active break point intercepted.  At each break the open graph is closed,
the break runs eagerly on its real arguments, and a new graph is opened.  The break's outputs
are kept: they are the boundary buffers the next graph was recorded against.  (A forward that
cuts itself into pieces, tc_piecewise, has each piece recorded as one graph instead.)

Replay runs graph 0, then each break on the very argument tensors it saw during capture
(fixed addresses, which the graph before it has just rewritten), copies the break's fresh
outputs into its boundary buffers, runs the next graph, and so on.  Breaks read anything else
they need (attention: this batch's ragged metadata) from the forward context at replay time,
which is what lets them stay outside the graph.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Sequence

import torch
from torch.utils import _pytree as pytree

from capture.break_points import intercepting


class Replayable(ABC):
    """One recorded graph: replay re-runs its work on the same memory."""

    @abstractmethod
    def replay(self) -> None: ...


class GraphRecorder(ABC):
    """The graph primitive: what a segmented capture needs from a device."""

    name: str = ""

    def session(self) -> ContextManager[None]:
        """Entered around a whole recording (CUDA: the capture stream)."""
        return contextlib.nullcontext()

    @abstractmethod
    def begin(self) -> None:
        """Start recording a graph: work issued from now on is recorded (and still runs)."""

    @abstractmethod
    def end(self) -> Replayable:
        """Stop recording; the graph recorded since `begin`."""


@dataclass
class RecordedBreak:
    name: str
    fn: Callable[..., Any]
    args: tuple
    kwargs: dict
    output: Any  # what the break returned during capture: the boundary buffers

    def replay(self) -> None:
        fresh = self.fn(*self.args, **self.kwargs)
        for buffer, value in zip(_tensors(self.output), _tensors(fresh), strict=True):
            if value is not buffer:
                buffer.copy_(value)


class SegmentedGraph:
    """A forward as graphs and eager breaks, in the order they ran; `replay()` returns the output
    of capture time, rewritten in place by this replay."""

    def __init__(self, steps: Sequence[Replayable | RecordedBreak], output: Any):
        self.steps, self.output = tuple(steps), output

    @property
    def num_segments(self) -> int:
        return sum(not isinstance(step, RecordedBreak) for step in self.steps)

    @property
    def breaks(self) -> tuple[RecordedBreak, ...]:
        return tuple(step for step in self.steps if isinstance(step, RecordedBreak))

    def replay(self) -> Any:
        for step in self.steps:
            step.replay()
        return self.output


class _BreakRecorder:
    """The break handler of one recording (see capture.break_points.intercepting).

    `implicit` (breakable): a graph is open from the start, closed at each break, reopened after
    it and closed at the end, so segments = breaks + 1.  Otherwise (tc_piecewise) the forward
    hands over its pieces one by one (`on_piece`), each recorded as a graph of its own."""

    def __init__(self, recorder: GraphRecorder, implicit: bool):
        self.recorder, self.implicit = recorder, implicit
        self.steps: list[Replayable | RecordedBreak] = []

    def on_break(self, name: str, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        if self.implicit:
            self.steps.append(self.recorder.end())
        try:
            output = fn(*args, **kwargs)
        finally:
            if self.implicit:
                self.recorder.begin()
        if not all(isinstance(x, torch.Tensor) for x in pytree.tree_leaves(output) if x is not None):
            raise TypeError(f"break point {name!r} returned {type(output).__name__}: a recorded break may return only tensors")
        self.steps.append(RecordedBreak(name, fn, args, kwargs, output))
        return output

    def on_piece(self, fn: Callable[..., Any], args: tuple) -> Any:
        if self.implicit:
            return fn(*args)  # inside the open graph already
        self.recorder.begin()
        try:
            return fn(*args)
        finally:
            self.steps.append(self.recorder.end())


def record_segments(recorder: GraphRecorder, forward: Callable[[], Any], implicit: bool = True) -> SegmentedGraph:
    """Run `forward()` once, recording it as graphs between its breaks (see `_BreakRecorder`).
    Every recorded forward, whatever the backend and the recorder, is a SegmentedGraph: a decode
    graph is one with zero breaks."""
    recording = _BreakRecorder(recorder, implicit)
    with recorder.session():
        if implicit:
            recorder.begin()
        try:
            with intercepting(recording):
                output = forward()
        finally:
            if implicit:
                recording.steps.append(recorder.end())
    return SegmentedGraph(recording.steps, output)


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [x for x in pytree.tree_leaves(tree) if isinstance(x, torch.Tensor)]
