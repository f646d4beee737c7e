"""Typed, frozen settings of the HTTP server, from the `server` config group (configs/server/).

configs/server/default.yaml is the one place that holds the defaults and says what each option
does; `from_mapping` requires every option, so a new one cannot silently take a second default.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Mapping, Sequence

from graphexec.errors import ConfigError
from graphexec.server.tool_parsers import PARSER_OPTIONS

LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
CERT_REQS = ("none", "optional", "required")  # server.ssl_cert_reqs: client certificates
# Routes that only an admin key opens (auth.py), on graphexec-serve and on the data-parallel front.
ADMIN_ROUTES = frozenset({"/flush_cache"})


@dataclass(frozen=True)
class ServerConfig:
    host: str
    port: int  # 0 lets the OS pick a free port
    max_queued_requests: int  # beyond scheduler.max_running_requests; one more answers 503
    log_level: str
    queue_full_retry_after_s: int  # the Retry-After header of that 503
    max_body_bytes: int  # a larger request body answers 413 before it is read in full
    clamp_max_tokens: bool  # prompt + max_tokens over the bound: clamp (true) or answer 400 (false)
    completions_max_tokens: int | None  # /v1/completions without max_tokens; None: the room left
    request_read_timeout_s: float  # for the headers, then again for the body; 408 or close after
    keep_alive_timeout_s: float  # an idle keep-alive connection is closed after this
    limit_concurrency: int | None  # uvicorn's: connections + tasks beyond it answer 503; None: no limit
    max_prompts_per_request: int  # /v1/completions `prompt` as a list: more prompts answer 400
    max_n: int  # choices per prompt (`n`): more answer 400
    tool_parser: str  # how tool calls are written and read: one of PARSER_OPTIONS (tool_parsers.py)
    # Who may call it (auth.py, api_keys.py).  Keys stay out of repr: a logged config shows none.
    api_key: str | tuple[str, ...] | None = field(repr=False)  # `Authorization: Bearer` keys
    api_key_file: str | None  # more keys, one per line
    admin_api_key: str | tuple[str, ...] | None = field(repr=False)  # open admin routes too
    admin_api_key_file: str | None
    public_routes: tuple[str, ...]  # paths served without a key
    public_metrics: bool  # /metrics and /metrics/json without a key
    allow_unauthenticated: bool  # a non-loopback host without any key: serve (true) or refuse
    ssl_certfile: str | None  # TLS: uvicorn's options of the same names
    ssl_keyfile: str | None
    ssl_ca_certs: str | None
    ssl_cert_reqs: str  # one of CERT_REQS

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
        _check_together(values)
        return cls(**{name: _frozen(values[name]) for name in names})


def check_key(key: object, source: str) -> None:
    """One API key, wherever it came from (`source` names the option, variable or file); the
    message never quotes the key."""
    if not isinstance(key, str) or not key:
        raise ConfigError(f"{source}: a key must be a non-empty string")
    if not all(33 <= ord(c) <= 126 for c in key):
        raise ConfigError(f"{source}: a key must be printable ASCII without spaces (it is sent in an HTTP header)")


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


def _keys(value: object, name: str) -> None:
    if value is None:
        return
    keys = [value] if isinstance(value, str) else value
    if not _is_list(keys) or not keys:
        raise ConfigError(f"{name} must be a key, a non-empty list of keys, or null; got a {type(value).__name__}")
    for key in keys:
        check_key(key, name)


def _readable_file(value: object, name: str) -> None:
    if value is None:
        return
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{name} must be a file path or null, got {value!r}")
    try:
        with open(value, "rb"):
            pass
    except OSError as error:
        raise ConfigError(f"{name}: cannot read {value}: {error.strerror or error}") from None


def _routes(value: object, name: str) -> None:
    if not _is_list(value) or not all(isinstance(r, str) and r.startswith("/") for r in value):
        raise ConfigError(f"{name} must be a list of paths starting with /, got {value!r}")


def _tool_parser(value: object, name: str) -> None:
    if value not in PARSER_OPTIONS:
        raise ConfigError(f"{name} must be one of {list(PARSER_OPTIONS)}, got {value!r}")


def _cert_reqs(value: object, name: str) -> None:
    if value not in CERT_REQS:
        raise ConfigError(f"{name} must be one of {list(CERT_REQS)}, got {value!r}")


def _check_together(values: Mapping[str, Any]) -> None:
    admin = sorted(ADMIN_ROUTES.intersection(values["public_routes"]))
    if admin:
        raise ConfigError(f"server.public_routes: {admin[0]} is an admin route (server.admin_api_key opens it)")
    for name in ("ssl_keyfile", "ssl_ca_certs"):
        if values[name] is not None and values["ssl_certfile"] is None:
            raise ConfigError(f"server.{name} needs server.ssl_certfile (TLS is on only with a certificate)")
    if values["ssl_cert_reqs"] != "none" and values["ssl_ca_certs"] is None:
        raise ConfigError(
            f"server.ssl_cert_reqs={values['ssl_cert_reqs']} needs server.ssl_ca_certs "
            "(the CA certificates that client certificates are checked against)"
        )


def _is_list(value: object) -> bool:
    return isinstance(value, Sequence) and not isinstance(value, (str, bytes))  # a list, or OmegaConf's


def _frozen(value: Any) -> Any:
    # Lists from YAML become tuples: the config is frozen, so is what it holds.
    return tuple(value) if _is_list(value) else value


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
    "completions_max_tokens": _optional_limit,
    "request_read_timeout_s": _positive_seconds,
    "keep_alive_timeout_s": _positive_seconds,
    "limit_concurrency": _optional_limit,
    "max_prompts_per_request": _int_at_least(1),
    "max_n": _int_at_least(1),
    "tool_parser": _tool_parser,
    "api_key": _keys,
    "api_key_file": _readable_file,
    "admin_api_key": _keys,
    "admin_api_key_file": _readable_file,
    "public_routes": _routes,
    "public_metrics": _bool,
    "allow_unauthenticated": _bool,
    "ssl_certfile": _readable_file,
    "ssl_keyfile": _readable_file,
    "ssl_ca_certs": _readable_file,
    "ssl_cert_reqs": _cert_reqs,
}
