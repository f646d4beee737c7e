"""The capture plan on disk: which buckets each backend keeps, and the timings that decided it.

A plan is filed under a key: a hash of everything that changes what a graph does or how fast it
runs (the caller's key material: model file, resolved options, library versions, device, CPU
ISA).  A changed key is another file, so it is measured anew.  A file that cannot be trusted
(unreadable, not JSON, a checksum that does not match its content, another key's material) is
logged once and ignored: the caller measures again and overwrites it.  Never a crash, never a
decision taken from a foreign file.

    <cache_dir>/<key hash>/plan.json  {"format", "key", "backends": {path: {bucket: decision}}, "checksum"}

Compiled code a backend persists lives in the same folder (capture/artifacts.py, `artifacts()`),
so one key names the decisions and the code they were taken on.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any, Mapping

from capture.artifacts import ArtifactStore
from capture.measure import BucketDecision

_log = logging.getLogger(__name__)
_FORMAT = 1

Decisions = dict[str, dict[int, BucketDecision]]  # backend config path -> bucket -> decision


def key_hash(key: Mapping[str, Any]) -> str:
    return hashlib.sha256(_canonical(key).encode()).hexdigest()[:24]


class PlanStore:
    """One key's plan file under `cache_dir`."""

    def __init__(self, cache_dir: str | os.PathLike, key: Mapping[str, Any]):
        self.key = json.loads(_canonical(key))
        self.path = Path(cache_dir).expanduser() / key_hash(self.key) / "plan.json"

    def artifacts(self) -> ArtifactStore:
        """The compiled-code artifacts of this key, beside its plan."""
        return ArtifactStore(self.path.parent, key_hash(self.key))

    def load(self) -> Decisions | None:
        """The stored decisions, or None when there is no trustworthy file for this key."""
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as error:
            return self._distrust(f"unreadable ({error})")
        try:
            data = json.loads(raw.decode("utf-8"))
            body = {"format": data["format"], "key": data["key"], "backends": data["backends"]}
            if data["checksum"] != _checksum(body):
                return self._distrust("its checksum does not match its content")
            if body["format"] != _FORMAT or body["key"] != self.key:
                return self._distrust("it was written for another key")
            return {
                path: {int(bucket): BucketDecision.from_dict(d) for bucket, d in buckets.items()}
                for path, buckets in body["backends"].items()
            }
        except (ValueError, KeyError, TypeError, AttributeError) as error:
            return self._distrust(f"malformed ({type(error).__name__}: {error})")

    def save(self, decisions: Decisions) -> None:
        """Write atomically: a reader sees the old file or the new one, never half of one."""
        body = {
            "format": _FORMAT,
            "key": self.key,
            "backends": {
                path: {str(bucket): d.as_dict() for bucket, d in sorted(buckets.items())}
                for path, buckets in sorted(decisions.items())
            },
        }
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".plan-", suffix=".json")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(body | {"checksum": _checksum(body)}, f, indent=1, sort_keys=True)
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def _distrust(self, why: str) -> None:
        _log.warning("capture plan %s ignored (%s); measuring again and rewriting it", self.path, why)
        return None


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)


def _checksum(body: Mapping[str, Any]) -> str:
    # Over the decisions as they will be read back (rounded by as_dict), so a round trip matches.
    return hashlib.sha256(_canonical(body).encode()).hexdigest()
