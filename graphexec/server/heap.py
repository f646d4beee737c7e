"""Giving freed heap memory back to the OS after a large request body (glibc only; elsewhere a no-op).

Tokenizing a few MB of text allocates hundreds of MB of small objects (the tokenizer's per-token
records, the id list) on the worker thread's malloc arena.  glibc keeps freed arena memory for
reuse, so one rejected 4 MB prompt would leave the server's RSS hundreds of MB higher for good;
`malloc_trim(0)` walks every arena and returns what is free.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.cache
def _malloc_trim():
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to call
        return None


def give_back_free_heap() -> None:
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
