"""How graphexec-serve runs uvicorn: the HTTP protocol (h11 with a read deadline), the
connection and TLS options of `ServerConfig`, and a log config that shows graphexec's own INFO lines.

uvicorn (h11 or httptools) has no timeout for reading a request's headers: a client that connects
and sends half a request line holds its socket forever.  `ReadTimeoutH11Protocol` arms a timer
whenever the connection waits for bytes no handler reads: request headers (a new connection, or
the first bytes of the next request on a keep-alive one), or the rest of a body the app refused
unread.  The body a handler reads has the app's own timeout (limits.read_body); idle keep-alive
connections keep uvicorn's timer.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import socket
import ssl
from types import MappingProxyType
from typing import Any

import h11
from uvicorn.config import LOGGING_CONFIG
from uvicorn.protocols.http.h11_impl import H11Protocol

from graphexec.server.config import ServerConfig

_log = logging.getLogger(__name__)

_CERT_REQS = MappingProxyType({"none": ssl.CERT_NONE, "optional": ssl.CERT_OPTIONAL, "required": ssl.CERT_REQUIRED})
_REQUEST_TIMEOUT = b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"


class ReadTimeoutH11Protocol(H11Protocol):
    """uvicorn's h11 protocol plus a read deadline (`read_timeout_s`) for what no handler reads:
    a request's headers, and the rest of a body the app answered without reading (a 413).

    The deadline is armed once per wait, not per byte, so trickling bytes cannot extend it.
    """

    read_timeout_s: float = 30.0  # set per server by `protocol_class`

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        _no_delay(transport)
        self._read_timer: asyncio.TimerHandle | None = None
        self._timer_for: str | None = None  # the wait the timer belongs to
        super().connection_made(transport)
        self._update_read_timer()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._update_read_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._update_read_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_read_timer()
        super().connection_lost(exc)

    def _waiting(self) -> str | None:
        """What the connection waits for that no handler reads, if anything."""
        if self.conn.their_state is h11.IDLE:
            # A new connection (no request yet), or the first bytes of the next request on a kept-alive
            # one; a kept-alive connection without them is idle, and uvicorn's keep-alive timer has it.
            fresh = self.scope is None
            return "headers" if fresh or self.conn.trailing_data[0] else None
        if self.conn.their_state is h11.SEND_BODY and self.cycle is not None and self.cycle.response_complete:
            # Answered without reading the body (413): h11 discards the rest, which a well-behaved
            # client sends before it reads the answer; closing at once would reset the connection
            # under it and lose the 413 (asyncio clients see a ReadError).
            return "body"
        return None

    def _update_read_timer(self) -> None:
        waiting = self._waiting()
        if waiting == self._timer_for:
            return  # the same wait: its deadline stands
        self._cancel_read_timer()
        if waiting is not None and not self.transport.is_closing():
            self._read_timer = self.loop.call_later(self.read_timeout_s, self._read_timed_out)
            self._timer_for = waiting

    def _cancel_read_timer(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
        self._read_timer, self._timer_for = None, None

    def _read_timed_out(self) -> None:
        self._read_timer, self._timer_for = None, None
        waiting = self._waiting()
        if self.transport.is_closing() or waiting is None:
            return
        started = waiting == "headers" and bool(self.conn.trailing_data[0])
        what = {
            "headers": "request headers incomplete" if started else "no request",
            "body": "rest of a refused body not received",
        }[waiting]
        client = "%s:%d" % self.client if self.client else "?"
        timeout = self.read_timeout_s
        _log.info("closed connection from %s: %s within %g s (server.request_read_timeout_s)", client, what, timeout)
        # A client that started a request gets an answer; h11 cannot send one before it has read a
        # request, so the bytes are written directly, and the connection ends here either way.
        if started:
            self.transport.write(_REQUEST_TIMEOUT)
        self.transport.close()


def _no_delay(transport: asyncio.Transport) -> None:
    """TCP_NODELAY on the connection, whatever socket uvicorn was handed.

    asyncio sets it only on sockets whose `proto` is IPPROTO_TCP; a listening socket made with
    `socket.socket()` (proto 0), as one passed to uvicorn with `sockets=`/`fd=` may be, gives
    connections without it.  h11 writes a response's headers and body separately, so Nagle's
    algorithm then holds the body until the client's delayed ACK: 40 ms on every response.
    """
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def protocol_class(read_timeout_s: float) -> type[ReadTimeoutH11Protocol]:
    """The protocol with this server's read deadline (uvicorn instantiates it per connection)."""
    return type("ReadTimeoutH11Protocol", (ReadTimeoutH11Protocol,), {"read_timeout_s": read_timeout_s})


def uvicorn_options(config: ServerConfig, **overrides: Any) -> dict[str, Any]:
    """Keyword arguments of `uvicorn.run` / `uvicorn.Config` under `config`; `overrides` win."""
    options: dict[str, Any] = {
        "host": config.host,
        "port": config.port,
        "log_level": config.log_level,
        "http": protocol_class(config.request_read_timeout_s),
        "timeout_keep_alive": config.keep_alive_timeout_s,
        "limit_concurrency": config.limit_concurrency,
    }
    if config.ssl_certfile is not None:
        options |= {
            "ssl_certfile": config.ssl_certfile,
            "ssl_keyfile": config.ssl_keyfile,
            "ssl_ca_certs": config.ssl_ca_certs,
            "ssl_cert_reqs": _CERT_REQS[config.ssl_cert_reqs],
        }
    return options | overrides


def log_config(level: str) -> dict:
    """uvicorn's own log config, plus graphexec's loggers on the same stderr handler.

    Without it graphexec's INFO lines (a client that went away, a stalled connection closed)
    would reach no handler: graphexec-serve configures no root logger.
    """
    config = copy.deepcopy(LOGGING_CONFIG)
    config["loggers"]["graphexec"] = {"handlers": ["default"], "level": level.upper(), "propagate": False}
    return config
