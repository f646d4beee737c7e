"""The server's API keys, gathered once at start from the config, the environment and key files,
and the rule that refuses to expose a server without any.

Every source adds keys; none replaces another:

    user keys    server.api_key (a key or a list), GRAPHEXEC_API_KEY (comma-separated),
                 server.api_key_file (one per line; blank lines and `#` comments skipped)
    admin keys   server.admin_api_key, GRAPHEXEC_ADMIN_API_KEY, server.admin_api_key_file

`Keys` holds SHA-256 digests, never the keys: `Keys.role` compares equal-length digests with
`hmac.compare_digest` against every key, so neither the time nor an early exit tells how much of a
guess was right, nor which key or how long.  Errors name the option, variable or file, never a key.
Checking requests is auth.py's job; this module does no I/O after start.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import secrets
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from graphexec.errors import ConfigError
from graphexec.server.config import ServerConfig, check_key

ENV_API_KEY = "GRAPHEXEC_API_KEY"
ENV_ADMIN_API_KEY = "GRAPHEXEC_ADMIN_API_KEY"
USER, ADMIN = "user", "admin"


@dataclass(frozen=True)
class Keys:
    """Digests of the user and admin keys; no keys at all means the server is open."""

    user: tuple[bytes, ...] = ()
    admin: tuple[bytes, ...] = ()

    @classmethod
    def of(cls, user: Iterable[str] = (), admin: Iterable[str] = ()) -> Keys:
        return cls(tuple(_digest(k.encode()) for k in user), tuple(_digest(k.encode()) for k in admin))

    @property
    def required(self) -> bool:
        return bool(self.user or self.admin)

    def role(self, presented: bytes) -> str | None:
        """ADMIN, USER, or None for a key that is neither.  Every key is compared, whatever matches."""
        digest = _digest(presented)
        admin = _any_equal(digest, self.admin)
        user = _any_equal(digest, self.user)
        return ADMIN if admin else USER if user else None


def load_keys(config: ServerConfig, environ: Mapping[str, str] | None = None) -> Keys:
    """The keys `config` and `environ` (default: this process's) configure; a ConfigError for a
    bad key or file, or for a non-loopback `server.host` that no key or client certificate guards
    unless `server.allow_unauthenticated`."""
    environ = os.environ if environ is None else environ
    user = _gather(config.api_key, "server.api_key", environ, ENV_API_KEY, config.api_key_file, "server.api_key_file")
    admin = _gather(
        config.admin_api_key, "server.admin_api_key", environ, ENV_ADMIN_API_KEY,
        config.admin_api_key_file, "server.admin_api_key_file",
    )
    keys = Keys.of(user, admin)
    if _exposed_unguarded(config, keys) and not config.allow_unauthenticated:
        raise ConfigError(
            f"server.host={config.host} serves beyond this machine, and no API key is set: anyone who "
            f"can reach port {config.port} could generate, flush the cache and read the metrics. Set "
            f"server.api_key_file, {ENV_API_KEY} or server.api_key (and clients send "
            "`Authorization: Bearer <key>`), or server.allow_unauthenticated=true to serve without one"
        )
    return keys


def exposure_warning(config: ServerConfig, keys: Keys) -> str | None:
    """What graphexec-serve should say at start about who can reach it, if anything."""
    if _exposed_unguarded(config, keys):
        return (
            f"server.host={config.host} without an API key (server.allow_unauthenticated=true): "
            "anyone who can reach this port may use the server"
        )
    if keys.required and not is_loopback(config.host) and config.ssl_certfile is None:
        return (
            f"server.host={config.host} without TLS: API keys cross the network in clear; set "
            "server.ssl_certfile and server.ssl_keyfile, or serve behind a TLS proxy"
        )
    return None


def replica_token() -> str:
    """A data-parallel run's own key between its front and its replicas; it dies with the run."""
    return secrets.token_urlsafe(32)


def replica_key_env(token: str) -> dict[str, str | None]:
    """A replica's environment for `token` as its only key (its admin key; the front's own keys,
    which the replica would inherit, unset), so the token never appears on a command line."""
    return {ENV_API_KEY: None, ENV_ADMIN_API_KEY: token}


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a hostname: whatever it resolves to may be reachable from elsewhere


def _exposed_unguarded(config: ServerConfig, keys: Keys) -> bool:
    # A required client certificate (mutual TLS) guards the server as a key does.
    guarded = keys.required or config.ssl_cert_reqs == "required"
    return not guarded and not is_loopback(config.host)


def _gather(
    value: str | tuple[str, ...] | None, option: str, environ: Mapping[str, str], variable: str,
    path: str | None, file_option: str,
) -> list[str]:
    keys = [value] if isinstance(value, str) else list(value or ())
    if variable in environ:
        keys += _split(environ[variable], variable)
    if path is not None:
        keys += _read(path, file_option)
    return keys


def _split(text: str, variable: str) -> list[str]:
    keys = [k.strip() for k in text.split(",")]
    if not all(keys):
        # An empty variable (or a stray comma) was meant to set a key: refusing beats serving open.
        raise ConfigError(f"{variable} is set but holds an empty key (keys are comma-separated)")
    for key in keys:
        check_key(key, variable)
    return keys


def _read(path: str, option: str) -> list[str]:
    try:
        with open(path, encoding="utf-8") as file:
            lines = [line.strip() for line in file]
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"{option}: cannot read {path}: {getattr(error, 'strerror', None) or error}") from None
    keys = [line for line in lines if line and not line.startswith("#")]
    if not keys:
        raise ConfigError(f"{option}: {path} holds no key (one per line)")
    for key in keys:
        check_key(key, f"{option} ({path})")
    return keys


def _digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()


def _any_equal(digest: bytes, digests: tuple[bytes, ...]) -> bool:
    found = False
    for candidate in digests:
        found |= hmac.compare_digest(digest, candidate)  # no early exit: the time is the same for all
    return found
