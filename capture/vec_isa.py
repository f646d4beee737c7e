"""Inductor's CPU-ISA probe, answered from a record kept beside the plan when nothing it depends on moved.

Before the first C++ kernel of a process inductor checks every vector ISA the CPU claims by
building a tiny library with that ISA's flags and dlopening it in a subprocess: ten subprocesses,
~1.9 s of the first decode bucket a warm start loads (`graphexec-bench startup`, 2-core Xeon).  Some
ISAs check an extension the same way even when told the ISA is fine (AVX-512 BF16, VNNI, AMX: six
more, ~0.4 s).  The answers are a function of the CPU's flags and the C++ compiler, so a process
that probed for real writes them down (`remember`): the ISAs and every check's answer.  A later
process whose CPU claims exactly the recorded ISAs and whose compiler is the same file skips the
probe and the recorded checks (`answered`).  Anything else probes as usual.

The boundary: this room reads and seeds inductor's ISA choice; the record is an artifact of the
plan's key (capture/artifacts.py), trusted or rejected like the compiled layers beside it.
"""

from __future__ import annotations

import contextlib
import hashlib
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


class IsaRecord:
    """The record of one plan key's folder."""

    def __init__(self, store: ArtifactStore | None):
        self._store = store
        self._probed_here = False
        self._checks: dict[str, bool] = {}  # what inductor's checks answered in this process
        self._recorded: dict | None = None  # the record, once `_holds` trusted it

    @contextlib.contextmanager
    def answered(self) -> Iterator[None]:
        """Inside, inductor takes the recorded ISAs and checks without probing, when the record
        still holds and this process has not chosen yet; otherwise inductor probes itself, and
        its checks' answers are kept for `remember`."""
        from torch._inductor import config
        from torch._inductor.cpu_vec_isa import valid_vec_isa_list

        if valid_vec_isa_list.cache_info().currsize or not self._holds():
            self._probed_here = True
            with self._checks_seen(lambda key, probe: self._checks.setdefault(key, probe())):
                yield
            return
        with config.patch({"cpp.vec_isa_ok": True}), self._checks_seen(self._recorded_check):
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
        if not isinstance(recorded, dict) or recorded.get("compiler") != _compiler() or not isinstance(recorded.get("checks"), dict):
            return False
        self._recorded = recorded
        with config.patch({"cpp.vec_isa_ok": True}), self._checks_seen(self._recorded_check):
            claimed = [str(isa) for isa in valid_vec_isa_list()]
        if claimed != recorded.get("isas"):
            # The CPU claims an ISA the compiler did not pass: forget the unprobed list, probe.
            valid_vec_isa_list.cache_clear()
            return False
        return True

    def _recorded_check(self, key: str, probe) -> bool:
        answer = self._recorded["checks"].get(key)
        return probe() if answer is None else bool(answer)

    @staticmethod
    @contextlib.contextmanager
    def _checks_seen(answer) -> Iterator[None]:
        """Inductor's check of one ISA (build a library with its flags, dlopen it in a
        subprocess) goes through `answer(key, probe)`: the recorded answer, or the real probe."""
        from torch._inductor.cpu_vec_isa import VecISA

        check_build = VecISA.check_build

        def seen(isa, code: str) -> bool:
            return answer(_check_key(isa, code), lambda: check_build(isa, code))

        VecISA.check_build = seen
        try:
            yield
        finally:
            VecISA.check_build = check_build

    def remember(self) -> None:
        """After a compile or load in a process that probed for real: record its answers, once.
        Every compiled region keeps a record of its own and only the first to compile sees the
        checks run, so what a record of the same ISAs and compiler holds already is kept."""
        if not self._probed_here or self._store is None:
            return
        self._probed_here = False
        record = self._record()
        try:
            payload = self._store.load(NAME)
            stored = None if payload is None else json.loads(payload)
        except (UntrustedArtifact, ValueError):
            stored = None
        if isinstance(stored, dict) and isinstance(stored.get("checks"), dict) and \
                (stored.get("isas"), stored.get("compiler")) == (record["isas"], record["compiler"]):
            record["checks"] = stored["checks"] | record["checks"]
            if record == stored:
                return
        try:
            self._store.save(NAME, json.dumps(record, sort_keys=True).encode())
        except OSError as error:
            _log.warning("could not write %s: %r", self._store.path(NAME), error)

    def _record(self) -> dict:
        from torch._inductor.cpu_vec_isa import valid_vec_isa_list

        return {"isas": [str(isa) for isa in valid_vec_isa_list()], "compiler": _compiler(), "checks": self._checks}


def _check_key(isa, code: str) -> str:
    """One check: the ISA, the flags it builds with right now (an extension's check adds its
    own), the code it builds."""
    return f"{isa} {isa._arch_flags} {hashlib.sha256(code.encode()).hexdigest()[:16]}"
