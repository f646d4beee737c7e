"""Typed, frozen settings of the HTTP server, from the `server` config group (configs/server/)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Mapping

from graphexec.errors import ConfigError

LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


@dataclass(frozen=True)
class ServerConfig:
    host: str
    port: int  # 0 lets the OS pick a free port
    max_queued_requests: int  # beyond scheduler.max_running_requests; one more answers 503
    log_level: str

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> ServerConfig:
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - names)
        if unknown:
            raise ConfigError(f"server.{unknown[0]} is not an option; known: {sorted(names)}")
        missing = sorted(names - set(values))
        if missing:
            raise ConfigError(f"server.{missing[0]} is missing")
        host, port, queued, level = values["host"], values["port"], values["max_queued_requests"], values["log_level"]
        if not isinstance(host, str) or not host:
            raise ConfigError(f"server.host must be a non-empty string, got {host!r}")
        if not _is_int(port) or not 0 <= port <= 65535:
            raise ConfigError(f"server.port must be an integer in [0, 65535], got {port!r}")
        if not _is_int(queued) or queued < 0:
            raise ConfigError(f"server.max_queued_requests must be an integer >= 0, got {queued!r}")
        if level not in LOG_LEVELS:
            raise ConfigError(f"server.log_level must be one of {list(LOG_LEVELS)}, got {level!r}")
        return cls(host=host, port=port, max_queued_requests=queued, log_level=level)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
