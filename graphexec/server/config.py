"""Typed, frozen settings of the HTTP server, from the `server` config group (configs/server/).

configs/server/default.yaml is the one place that holds the defaults and says what each option
does; `from_mapping` requires every option, so a new one cannot silently take a second default.
"""

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
    queue_full_retry_after_s: int  # the Retry-After header of that 503
    max_body_bytes: int  # a larger request body answers 413 before it is read in full
    clamp_max_tokens: bool  # prompt + max_tokens over the bound: clamp (true) or answer 400 (false)
    request_read_timeout_s: float  # for the headers, then again for the body; 408 or close after
    keep_alive_timeout_s: float  # an idle keep-alive connection is closed after this
    limit_concurrency: int | None  # uvicorn's: connections + tasks beyond it answer 503; None: no limit
    max_prompts_per_request: int  # /v1/completions `prompt` as a list: more prompts answer 400
    max_n: int  # choices per prompt (`n`): more answer 400

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> ServerConfig:
        names = [f.name for f in fields(cls)]
        unknown = sorted(set(values) - set(names))
        if unknown:
            raise ConfigError(f"server.{unknown[0]} is not an option; known: {sorted(names)}")
        missing = [name for name in names if name not in values]
        if missing:
            raise ConfigError(f"server.{missing[0]} is missing")
        for name in names:
            _CHECKS[name](values[name], f"server.{name}")
        return cls(**{name: values[name] for name in names})


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return _is_int(value) or isinstance(value, float)


def _host(value: object, name: str) -> None:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{name} must be a non-empty string, got {value!r}")


def _port(value: object, name: str) -> None:
    if not _is_int(value) or not 0 <= value <= 65535:
        raise ConfigError(f"{name} must be an integer in [0, 65535], got {value!r}")


def _int_at_least(minimum: int) -> Any:
    def check(value: object, name: str) -> None:
        if not _is_int(value) or value < minimum:
            raise ConfigError(f"{name} must be an integer >= {minimum}, got {value!r}")

    return check


def _positive_seconds(value: object, name: str) -> None:
    if not _is_number(value) or not value > 0:
        raise ConfigError(f"{name} must be a number of seconds > 0, got {value!r}")


def _bool(value: object, name: str) -> None:
    if not isinstance(value, bool):
        raise ConfigError(f"{name} must be true or false, got {value!r}")


def _log_level(value: object, name: str) -> None:
    if value not in LOG_LEVELS:
        raise ConfigError(f"{name} must be one of {list(LOG_LEVELS)}, got {value!r}")


def _optional_limit(value: object, name: str) -> None:
    if value is not None and (not _is_int(value) or value < 1):
        raise ConfigError(f"{name} must be an integer >= 1 or null (no limit), got {value!r}")


_CHECKS = {
    "host": _host,
    "port": _port,
    "max_queued_requests": _int_at_least(0),
    "log_level": _log_level,
    "queue_full_retry_after_s": _int_at_least(0),
    "max_body_bytes": _int_at_least(1),
    "clamp_max_tokens": _bool,
    "request_read_timeout_s": _positive_seconds,
    "keep_alive_timeout_s": _positive_seconds,
    "limit_concurrency": _optional_limit,
    "max_prompts_per_request": _int_at_least(1),
    "max_n": _int_at_least(1),
}
