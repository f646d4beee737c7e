"""The one scoped channel from ModelRunner to the attention op: KV pool and per-step metadata.
It lives with its reader (the op); the runner, above, sets it.

The model's forward takes only (input_ids, positions); attention finds everything else here, so a
compiler tracing the model never sees, copies or functionalizes the KV cache.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator

from graphexec.attention.backend import ForwardContext


_CURRENT: contextvars.ContextVar[ForwardContext | None] = contextvars.ContextVar(
    "graphexec_forward_context", default=None
)


@contextlib.contextmanager
def forward_context(ctx: ForwardContext) -> Iterator[ForwardContext]:
    if _CURRENT.get() is not None:
        raise RuntimeError("forward contexts do not nest: one forward runs at a time per thread")
    token = _CURRENT.set(ctx)
    try:
        yield ctx
    finally:
        _CURRENT.reset(token)


def get_forward_context() -> ForwardContext:
    ctx = _CURRENT.get()
    if ctx is None:
        raise RuntimeError("attention ran outside ModelRunner.forward: no forward context is active")
    return ctx
