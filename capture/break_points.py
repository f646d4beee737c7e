"""Break points: functions a piecewise capture runs eagerly between its captured segments.

`@break_point("attention")` marks a function; the model knows nothing else about capture.
Outside `breaking(...)` a marked function is an ordinary call (a whole-forward graph traces
straight through it).  Inside `breaking({"attention"})` it is excluded from compilation, so the
compiler cuts the forward there: one segment before it, one after, the function eager between.

A segment recorder (capture/segments.py) goes one step further: inside `intercepting(handler)`
an active break point is handed to `handler.on_break` instead of being called, so the recorder
can close the graph it is recording, run the break eagerly and open the next graph.  Code that
cuts its forward itself (tc_piecewise) hands each piece to `run_piece`, which goes to
`handler.on_piece`: the recorder records that piece as one graph.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterable, Iterator, Protocol, TypeVar

import torch

F = TypeVar("F", bound=Callable)

# The break point every model has: attention over the paged KV pool.
ATTENTION = "attention"
# A break around the whole forward: every op runs eagerly through the piecewise path (debugging).
DEBUG = "debug"


class BreakHandler(Protocol):
    def on_break(self, name: str, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any: ...

    def on_piece(self, fn: Callable[..., Any], args: tuple) -> Any: ...


class _BreakSwitch:
    """Which break points are active, and who runs them.  Changed only by `breaking()` and
    `intercepting()`, which restore it on exit; compiled code guards on `active`, so segments
    compiled under one set never run under another."""

    __slots__ = ("active", "handler", "unprepared")

    def __init__(self) -> None:
        self.active: frozenset[str] = frozenset()
        self.handler: BreakHandler | None = None
        # Marked functions whose compiler-disabled twin is not made yet: `breaking()` makes them,
        # because torch.compiler.disable imports Dynamo (~2 s), which an eager engine never needs.
        self.unprepared: list[tuple[Callable[..., Any], list[Callable[..., Any]]]] = []

    def prepare(self) -> None:
        while self.unprepared:
            fn, twin = self.unprepared.pop()
            twin.append(torch.compiler.disable(fn, recursive=True))


# TODO(issue 26): per context (a ContextVar), so a `breaking()` entered in one thread could never
# cut a forward running in another.  Not yet: torch 2.13's Dynamo cannot trace ContextVar.get()
# (measured: "Unsupported method call ... method `get` of class `ContextVar`", gb0156), so every
# marked function would break a fullgraph=True trace (full_graph, tc_piecewise) and cut every
# segmented one at each break point whether active or not; assume_constant_result over the read
# fails on a frozenset and would not guard anyway.  A plain object's attribute is traced and
# guarded (tests/test_segments.py), and today a forward and its `breaking()` share the engine
# loop's thread.
_SWITCH = _BreakSwitch()


def break_point(name: str) -> Callable[[F], F]:
    def mark(fn: F) -> F:
        eager: list[Callable[..., Any]] = []  # filled by _SWITCH.prepare() before a break is active
        _SWITCH.unprepared.append((fn, eager))

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            if name not in _SWITCH.active:
                return fn(*args, **kwargs)
            return run_break(name, eager[0], args, kwargs)

        wrapper.break_point_name = name  # type: ignore[attr-defined]
        return wrapper  # type: ignore[return-value]

    return mark


def run_break(name: str, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """Run an active break: through the intercepting handler if one is set, else eagerly.  Breaks
    nested inside a break (attention inside the debug break) run eagerly, unintercepted."""
    handler = _SWITCH.handler
    if handler is None:
        return fn(*args, **kwargs)
    with _suspended(handler):
        return handler.on_break(name, fn, args, kwargs)


def run_piece(fn: Callable[..., Any], args: tuple) -> Any:
    """Run one piece of a forward cut by its caller: plainly, or as a graph being recorded."""
    handler = _SWITCH.handler
    if handler is None:
        return fn(*args)
    with _suspended(handler):
        return handler.on_piece(fn, args)


@contextlib.contextmanager
def _suspended(handler: BreakHandler) -> Iterator[None]:
    _SWITCH.handler = None
    try:
        yield
    finally:
        _SWITCH.handler = handler


@contextlib.contextmanager
def breaking(names: Iterable[str]) -> Iterator[None]:
    _SWITCH.prepare()
    previous = _SWITCH.active
    _SWITCH.active = frozenset(names)
    try:
        yield
    finally:
        _SWITCH.active = previous


@contextlib.contextmanager
def intercepting(handler: BreakHandler) -> Iterator[None]:
    if _SWITCH.handler is not None:
        raise RuntimeError("segment recordings do not nest: a break handler is already set")
    _SWITCH.handler = handler
    try:
        yield
    finally:
        _SWITCH.handler = None
