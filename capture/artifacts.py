"""Compiled-code artifacts on disk, beside the capture plan of the same key (capture/plan_store.py).

An artifact is opaque bytes a backend produced (full_graph's ahead-of-time compiled layer,
capture/aot_region.py) under a name the backend chose.  The store adds what makes it safe to load
on a later start: the key it was built for, its name and a checksum over both and the bytes.  A
file that cannot be trusted (unreadable, truncated, another key's or another name's, a checksum
that does not match) raises UntrustedArtifact; the backend logs it once (`reject`), compiles
again and overwrites it.  Never a crash, never bytes handed back from a foreign file.  capture/ knows no
key material: the caller hands in the key's hash (PlanStore.artifacts()).

    <cache_dir>/<key hash>/<name>.aot   b"graphexec-artifact 1\\n" {"key", "name", "bytes", "sha256"} b"\\n" payload
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Callable

_log = logging.getLogger(__name__)
_MAGIC = b"graphexec-artifact 1\n"
_SUFFIX = ".aot"


class UntrustedArtifact(ValueError):
    """A stored artifact that must not be loaded; the message says why."""


class ArtifactStore:
    """The artifacts of one key: a folder, and the key's hash each file must carry."""

    def __init__(self, directory: str | os.PathLike, key_hash: str):
        self.directory = Path(directory).expanduser()
        self.key_hash = key_hash

    def path(self, name: str) -> Path:
        return self.directory / f"{name}{_SUFFIX}"

    def load(self, name: str) -> bytes | None:
        """The payload stored under `name`, or None when there is none; UntrustedArtifact when there
        is one that cannot be trusted."""
        path = self.path(name)
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as error:
            raise UntrustedArtifact(f"unreadable ({error})")
        header_end = raw.find(b"\n", len(_MAGIC))
        if not raw.startswith(_MAGIC) or header_end < 0:
            raise UntrustedArtifact("not an artifact file")
        try:
            header = json.loads(raw[len(_MAGIC) : header_end].decode("utf-8"))
            key, stored_name, size, digest = header["key"], header["name"], header["bytes"], header["sha256"]
        except (ValueError, KeyError, TypeError) as error:
            raise UntrustedArtifact(f"malformed header ({type(error).__name__}: {error})")
        payload = raw[header_end + 1 :]
        if len(payload) != size:
            raise UntrustedArtifact(f"truncated ({len(payload)} of {size} bytes)")
        if digest != _checksum(key, stored_name, payload):
            raise UntrustedArtifact("its checksum does not match its content")
        if key != self.key_hash or stored_name != name:
            raise UntrustedArtifact("it was written for another key or artifact")
        return payload

    def load_parts(self, name: str, reject: Callable[[str, str], None]) -> tuple[bytes, bytes] | None:
        """`name`'s payload split at its first line (what a format records it was compiled on) and
        the rest; None when there is none, or, after `reject(name, why)`, when it cannot be trusted."""
        try:
            payload = self.load(name)
        except UntrustedArtifact as error:
            return reject(name, str(error))
        if payload is None:
            return None
        first_line, _, rest = payload.partition(b"\n")
        return first_line, rest

    def save(self, name: str, payload: bytes) -> None:
        """Write atomically: a reader sees the old file or the new one, never half of one."""
        header = {"key": self.key_hash, "name": name, "bytes": len(payload), "sha256": _checksum(self.key_hash, name, payload)}
        self.directory.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=".artifact-", suffix=_SUFFIX)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(_MAGIC + json.dumps(header, sort_keys=True).encode() + b"\n" + payload)
            os.replace(tmp, self.path(name))
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def reject(self, name: str, why: str) -> None:
        """Log that the artifact `name` is not used (the one warning a bad file costs)."""
        _log.warning("compiled artifact %s ignored (%s); compiling again and rewriting it", self.path(name), why)
        return None


def _checksum(key: str, name: str, payload: bytes) -> str:
    # Over the key and the name too: a file copied from another key's folder or another bucket's
    # name does not check out even though its bytes are intact.
    digest = hashlib.sha256()
    for part in (key.encode(), b"\0", name.encode(), b"\0", payload):
        digest.update(part)
    return digest.hexdigest()
