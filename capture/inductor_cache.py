"""Inductor's on-disk cache location for one stretch of compiling (full_graph's `compile.cache_dir`).

torch 2.13 has no inductor config option for it: every cache path (FX graphs, AOT autograd, kernel
code, C++ builds, locks, Triton's cache beneath it) goes through
`torch._inductor.runtime.cache_dir_utils.cache_dir()`, which reads TORCHINDUCTOR_CACHE_DIR on each
call, and inductor hands the variable's current value to its compile workers with every job.  So
the variable set around a compile reaches everything that compile writes or loads.  Set for the
whole process instead, it would send every later compile (other backends', other engines' in the
same process) and every child process into this backend's directory; here it is set only while a
bucket of this backend is compiled or its artifact loaded, and restored after.  (Two exceptions,
both harmless: a recompile while serving, after a guard fails, uses inductor's default; and
inductor's autotuning record, max-autotune only, keeps the first directory the process used.)
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator

_VARIABLE = "TORCHINDUCTOR_CACHE_DIR"


@contextlib.contextmanager
def inductor_cache_dir(directory: str | None) -> Iterator[None]:
    """Inductor caches under `directory` within the block; None: wherever it would anyway."""
    if directory is None:
        yield
        return
    previous = os.environ.get(_VARIABLE)
    os.environ[_VARIABLE] = os.path.abspath(os.path.expanduser(directory))
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(_VARIABLE, None)  # inductor may have set it itself meanwhile
        else:
            os.environ[_VARIABLE] = previous
