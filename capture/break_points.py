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
import threading
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


class _BreakSwitch(threading.local):
    """Which break points are active in this thread, and who runs them.  Changed only by
    `breaking()` and `intercepting()`, which restore it on exit; compiled code guards on `active`,
    so segments compiled under one set never run under another.  Per thread, so a `breaking()`
    entered on one engine's loop thread never cuts a forward running on another's:
    Dynamo traces and guards a thread-local's attribute as it does a plain object's (torch 2.13
    cannot trace `ContextVar.get()`, gb0156; tests/test_segments.py)."""

    def __init__(self) -> None:
        self.active: frozenset[str] = frozenset()
        self.handler: BreakHandler | None = None


class _Marks:
    """Marked functions whose compiler-disabled twin is not made yet: `breaking()` makes them,
    because torch.compiler.disable imports Dynamo (~2 s), which an eager engine never needs.
    Filled as modules are imported (the decorator) and drained once, under a lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._unprepared: list[tuple[Callable[..., Any], list[Callable[..., Any]]]] = []

    def add(self, fn: Callable[..., Any], twin: list[Callable[..., Any]]) -> None:
        with self._lock:
            self._unprepared.append((fn, twin))

    def prepare(self) -> None:
        with self._lock:
            while self._unprepared:
                fn, twin = self._unprepared.pop()
                twin.append(torch.compiler.disable(fn, recursive=True))


_SWITCH = _BreakSwitch()
_MARKS = _Marks()


def break_point(name: str) -> Callable[[F], F]:
    def mark(fn: F) -> F:
        eager: list[Callable[..., Any]] = []  # filled by _MARKS.prepare() before a break is active
        _MARKS.add(fn, eager)

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
    _MARKS.prepare()
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
