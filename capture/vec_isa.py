"""Inductor's CPU-ISA probe, answered from a record kept beside the plan when nothing it depends on moved.

Before the first C++ kernel of a process inductor checks every vector ISA the CPU claims by
building a tiny library with that ISA's flags and dlopening it in a subprocess: ten subprocesses,
~1.9 s of the first decode bucket a warm start loads (`graphexec-bench startup`, 2-core Xeon).  The
answer is a function of the CPU's flags and the C++ compiler, so a process that probed for real
writes it down (`remember`), and a later process whose CPU claims exactly the recorded ISAs and
whose compiler is the same file skips the probe (`answered`).  Anything else probes as usual.

The boundary: this room reads and seeds inductor's ISA choice; the record is an artifact of the
plan's key (capture/artifacts.py), trusted or rejected like the compiled layers beside it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
from typing import Iterator

from capture.artifacts import ArtifactStore, UntrustedArtifact

_log = logging.getLogger(__name__)
NAME = "inductor.vec_isa"


def _compiler() -> list:
    """Which C++ compiler inductor would run, as a file identity (no subprocess: that is what costs)."""
    from torch._inductor import config

    names = config.cpp.cxx if isinstance(config.cpp.cxx, (list, tuple)) else (config.cpp.cxx,)
    for name in names:
        path = shutil.which(name) if name else None
        if path:
            real = os.path.realpath(path)
            stat = os.stat(real)
            return [real, stat.st_size, stat.st_mtime_ns]
    return []


def _record() -> dict:
    from torch._inductor.cpu_vec_isa import valid_vec_isa_list

    return {"isas": [str(isa) for isa in valid_vec_isa_list()], "compiler": _compiler()}


class IsaRecord:
    """The record of one plan key's folder."""

    def __init__(self, store: ArtifactStore | None):
        self._store = store
        self._probed_here = False

    @contextlib.contextmanager
    def answered(self) -> Iterator[None]:
        """Inside, inductor takes the recorded ISAs without probing, when the record still holds
        and this process has not chosen yet; otherwise a plain scope (inductor probes itself)."""
        from torch._inductor import config
        from torch._inductor.cpu_vec_isa import valid_vec_isa_list

        if valid_vec_isa_list.cache_info().currsize or not self._holds():
            self._probed_here = True
            yield
            return
        with config.patch({"cpp.vec_isa_ok": True}):
            yield

    def _holds(self) -> bool:
        from torch._inductor import config
        from torch._inductor.cpu_vec_isa import valid_vec_isa_list

        if self._store is None:
            return False
        try:
            payload = self._store.load(NAME)
            recorded = None if payload is None else json.loads(payload)
        except (UntrustedArtifact, ValueError) as error:
            self._store.reject(NAME, str(error))
            return False
        if not isinstance(recorded, dict) or recorded.get("compiler") != _compiler():
            return False
        with config.patch({"cpp.vec_isa_ok": True}):
            claimed = [str(isa) for isa in valid_vec_isa_list()]
        if claimed != recorded.get("isas"):
            # The CPU claims an ISA the compiler did not pass: forget the unprobed list, probe.
            valid_vec_isa_list.cache_clear()
            return False
        return True

    def remember(self) -> None:
        """After a compile or load in a process that probed for real: record its answer, once."""
        if not self._probed_here or self._store is None:
            return
        self._probed_here = False
        record = json.dumps(_record(), sort_keys=True).encode()
        try:
            if self._store.load(NAME) == record:
                return
        except UntrustedArtifact:
            pass
        try:
            self._store.save(NAME, record)
        except OSError as error:
            _log.warning("could not write %s: %r", self._store.path(NAME), error)
