"""Break points: functions a piecewise capture runs eagerly between its captured segments.

`@break_point("attention")` marks a function; the model knows nothing else about capture.
Outside `breaking(...)` a marked function is an ordinary call (a whole-forward graph traces
straight through it).  Inside `breaking({"attention"})` it is excluded from compilation, so the
compiler cuts the forward there: one segment before it, one after, the function eager between.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Callable, Iterable, Iterator, TypeVar

import torch

F = TypeVar("F", bound=Callable)

# The break point every model has: attention over the paged KV pool.
ATTENTION = "attention"
# A break around the whole forward: every op runs eagerly through the piecewise path (debugging).
DEBUG = "debug"


class _BreakSwitch:
    """Which break points are active.  Changed only by `breaking()`, which restores it on exit;
    compiled code guards on it, so segments compiled under one set never run under another."""

    __slots__ = ("active",)

    def __init__(self) -> None:
        self.active: frozenset[str] = frozenset()


_SWITCH = _BreakSwitch()


def break_point(name: str) -> Callable[[F], F]:
    def mark(fn: F) -> F:
        eager = torch.compiler.disable(fn, recursive=True)

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            if name in _SWITCH.active:
                return eager(*args, **kwargs)
            return fn(*args, **kwargs)

        wrapper.break_point_name = name  # type: ignore[attr-defined]
        return wrapper  # type: ignore[return-value]

    return mark


@contextlib.contextmanager
def breaking(names: Iterable[str]) -> Iterator[None]:
    previous = _SWITCH.active
    _SWITCH.active = frozenset(names)
    try:
        yield
    finally:
        _SWITCH.active = previous
