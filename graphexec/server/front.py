"""The data-parallel front: one HTTP server before `parallel.dp_size` replica servers.

Each replica is a whole graphexec-serve (graphexec/parallel/replicas.py starts them); the front
does no model work.  It proxies every OpenAI route to one replica over HTTP (httpx):

    POST /v1/completions, /v1/chat/completions, /v1/responses
                                                 the replica `Router.pick` chooses (least-loaded,
                                                 prefix affinity); answers stream through chunk
                                                 by chunk (server-sent events as they come)
    POST /tokenize, /detokenize, GET /tokenizer_info   the least-loaded replica
    GET  /v1/models, /docs                       the first replica up
    GET  /openapi.json                           the first replica's, its keys' rules the front's
    GET  /health                                 every replica's, aggregated
    POST /flush_cache                            every replica
    GET  /metrics, /metrics/json                 every replica's, relabelled and totalled (front_metrics.py)

Keys are checked here, once (auth.py, as graphexec-serve checks them); the replicas answer only
the front's per-run token, which replaces the client's `Authorization` on every proxied request,
so a client's key never reaches a replica and a replica's loopback port is no way around the keys.
Every proxied answer carries `x-graphexec-replica: i`.  A replica's error keeps its status and
body.  A client that goes away closes the request to the replica, which aborts it.  A replica
that cannot be reached answers 503 naming it, and the router sends it nothing more.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from graphexec.parallel.router import NoReplicaError, Router, prefix_key
from graphexec.server.api_keys import load_keys
from graphexec.server.auth import Access, install_auth
from graphexec.server.config import ServerConfig
from graphexec.server.errors import CLIENT_CLOSED_REQUEST, APIError, install_error_handlers
from graphexec.server.front_metrics import PROMETHEUS_TEXT, merge_json, merge_prometheus
from graphexec.server.limits import read_body
from graphexec.server.openapi import document_access

_log = logging.getLogger(__name__)

REPLICA_HEADER = "x-graphexec-replica"
# Hop-by-hop headers, and those each server sets for itself.
_DROPPED_HEADERS = frozenset(
    {"host", "connection", "keep-alive", "transfer-encoding", "te", "upgrade", "proxy-connection", "date", "server"}
)
# A request's headers the front replaces: its length (the body is re-sent) and the client's key.
_REPLACED_REQUEST_HEADERS = _DROPPED_HEADERS | {"content-length", "authorization"}
# Aggregated routes ask every replica; one that does not answer within this is reported as down.
_PROBE_TIMEOUT_S = 10.0
# Connecting to a replica on this machine takes microseconds: a replica that does not accept within
# this is gone.  Reading has no deadline: a long generation answers when it ends.
_CONNECT_TIMEOUT_S = 5.0


class Front:
    """The front's state: replica URLs, their in-flight requests, the router, the HTTP client."""

    def __init__(
        self, upstreams: Sequence[str], router: Router, replica_keep_alive_s: float, replica_token: str | None = None
    ):
        self.upstreams = [u.rstrip("/") for u in upstreams]
        self.router = router
        self.loads = [0] * len(self.upstreams)
        self.client: httpx.AsyncClient | None = None
        self._replica_keep_alive_s = replica_keep_alive_s
        self._replica_token = replica_token

    def open(self) -> None:
        timeout = httpx.Timeout(None, connect=_CONNECT_TIMEOUT_S)
        # Requests in flight are bounded by the front's uvicorn (server.limit_concurrency), not here.
        # An idle connection is dropped well before the replica's keep-alive timeout closes it, so
        # a request rarely meets a connection the replica is closing (`_send` retries the rest).
        limits = httpx.Limits(
            max_connections=None, max_keepalive_connections=64, keepalive_expiry=self._replica_keep_alive_s / 2
        )
        token = self._replica_token
        headers = {"authorization": f"Bearer {token}"} if token is not None else None
        # trust_env=False: loopback traffic to the replicas never goes through a proxy from the environment.
        self.client = httpx.AsyncClient(timeout=timeout, limits=limits, headers=headers, trust_env=False)

    async def close(self) -> None:
        if self.client is not None:
            await self.client.aclose()

    def pick(self, key: str | None) -> int:
        """The replica for a request with prefix `key` (None: the least-loaded); 503 if none is up."""
        try:
            return self.router.pick(key, self.loads)
        except NoReplicaError:
            raise _all_down() from None

    def first_up(self) -> int:
        alive = self.router.alive
        if not alive:
            raise _all_down()
        return alive[0]

    async def proxy(self, request: Request, replica: int, body: bytes | None = None) -> Response:
        """`request` forwarded to `replica`; its answer streamed back as it arrives."""
        assert self.client is not None
        url = self.upstreams[replica] + request.url.path + (f"?{request.url.query}" if request.url.query else "")
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _REPLACED_REQUEST_HEADERS}
        self.loads[replica] += 1
        try:
            upstream = await _unless_disconnected(request, self._send(request.method, url, headers, body))
        except httpx.TransportError as error:
            self.loads[replica] -= 1
            raise self._replica_failed(replica, error) from None
        except BaseException:
            self.loads[replica] -= 1
            raise
        if upstream is None:  # the client left while the replica worked (a non-streaming answer)
            self.loads[replica] -= 1
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        return _Relay(upstream, replica, self._relay_done)

    async def _send(self, method: str, url: str, headers: dict[str, str], body: bytes | None) -> httpx.Response:
        """Send; once more on a new connection when a kept-alive one was closed under the request
        (the replica never read it).  A replica that refuses connections fails at once."""
        assert self.client is not None

        def send() -> Awaitable[httpx.Response]:
            return self.client.send(self.client.build_request(method, url, headers=headers, content=body), stream=True)

        try:
            return await send()
        except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError):
            return await send()

    def _relay_done(self, replica: int, error: BaseException | None) -> None:
        self.loads[replica] -= 1
        if isinstance(error, httpx.TransportError):
            self._replica_failed(replica, error)

    def _replica_failed(self, replica: int, error: Exception) -> APIError:
        self.router.mark_down(replica)
        message = (
            f"data-parallel replica {replica} ({self.upstreams[replica]}) failed: "
            f"{type(error).__name__}: {error}; the front routes around it"
        )
        _log.error(message)
        return APIError(503, message, type="server_error", code="replica_unavailable")

    async def get(self, replica: int, path: str) -> httpx.Response:
        """`GET path` of `replica`, read whole; a 503 (the replica marked down) if it does not answer."""
        assert self.client is not None
        try:
            return await self.client.get(self.upstreams[replica] + path, timeout=_PROBE_TIMEOUT_S)
        except httpx.TransportError as error:
            raise self._replica_failed(replica, error) from None

    async def ask_all(self, method: str, path: str) -> list[httpx.Response | None]:
        """Every replica's answer to `method path` (None where a replica did not answer)."""
        assert self.client is not None

        async def ask(url: str) -> httpx.Response | None:
            try:
                return await self.client.request(method, url + path, timeout=_PROBE_TIMEOUT_S)
            except httpx.HTTPError:
                return None

        return list(await asyncio.gather(*(ask(u) for u in self.upstreams)))


class _Relay(StreamingResponse):
    """A replica's answer passed through; whatever ends it (the end, an error, the client leaving
    before or during the stream) closes the upstream response and calls `done` once."""

    def __init__(self, upstream: httpx.Response, replica: int, done: Callable[[int, BaseException | None], None]):
        headers = {k: v for k, v in upstream.headers.items() if k.lower() not in _DROPPED_HEADERS}
        headers[REPLICA_HEADER] = str(replica)
        super().__init__(upstream.aiter_raw(), status_code=upstream.status_code, headers=headers)
        self._upstream, self._replica, self._done = upstream, replica, done

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        error: BaseException | None = None
        try:
            await super().__call__(scope, receive, send)
        except httpx.TransportError as caught:  # the replica died mid-answer: the client's stream ends
            error = caught
        finally:
            await self._upstream.aclose()
            self._done(self._replica, error)


async def _unless_disconnected(request: Request, sending: Awaitable[httpx.Response]) -> httpx.Response | None:
    """The replica's response, or None when the client disconnects first (the request to the
    replica is then cancelled: its connection closes and the replica aborts the work)."""
    send = asyncio.ensure_future(sending)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({send, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if send.done():
        return send.result()
    send.cancel()
    with contextlib.suppress(asyncio.CancelledError, httpx.HTTPError):
        await send
    return None


async def _disconnected(request: Request) -> None:
    # The body is read already: the next message is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _all_down() -> APIError:
    return APIError(503, "every data-parallel replica is down", type="server_error", code="replica_unavailable")


def create_front_app(
    upstreams: Sequence[str],
    router: Router,
    config: ServerConfig,
    on_shutdown: Callable[[], None] | None = None,
    replica_token: str | None = None,
) -> FastAPI:
    """The front for replica servers at `upstreams` (base URLs, replica i at index i), which run
    with the same `config` (so the same keep-alive timeout) and take `replica_token` as their admin
    key (`api_keys.replica_token`); `on_shutdown` (stopping the replicas) runs when the app shuts down.
    A ConfigError for bad keys, or a non-loopback host without one (api_keys.load_keys)."""
    keys = load_keys(config)
    front = Front(upstreams, router, config.keep_alive_timeout_s, replica_token)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        front.open()
        try:
            yield
        finally:
            await front.close()
            # Here, not after uvicorn.run returns: on SIGTERM uvicorn re-raises the signal once the
            # app has shut down, and the process ends before its caller's `finally`.
            if on_shutdown is not None:
                await asyncio.to_thread(on_shutdown)

    # The OpenAPI schema and docs are the replicas' (their request models), proxied below.
    app = FastAPI(title="graphexec front", lifespan=lifespan, openapi_url=None, docs_url=None, redoc_url=None)
    app.state.server_config = config
    app.state.front = front
    install_error_handlers(app)
    access = install_auth(app, config, keys)
    _generation_routes(app, front, config)
    _single_replica_routes(app, front, config)
    _schema_route(app, front, access)
    _aggregate_routes(app, front)
    return app


def _generation_routes(app: FastAPI, front: Front, config: ServerConfig) -> None:
    async def routed(request: Request) -> Response:
        body = bytes(await read_body(request, config.max_body_bytes, config.request_read_timeout_s))
        try:
            parsed = json.loads(body)
        except ValueError:
            parsed = None  # the replica answers the 400
        key = prefix_key(request.url.path, parsed) if isinstance(parsed, dict) else None
        return await front.proxy(request, front.pick(key), body)

    for path in ("/v1/completions", "/v1/chat/completions", "/v1/responses"):
        app.add_api_route(path, routed, methods=["POST"], include_in_schema=False)


def _single_replica_routes(app: FastAPI, front: Front, config: ServerConfig) -> None:
    async def any_replica(request: Request) -> Response:
        body = None
        if request.method == "POST":
            body = bytes(await read_body(request, config.max_body_bytes, config.request_read_timeout_s))
        return await front.proxy(request, front.pick(None), body)

    async def first_replica(request: Request) -> Response:
        return await front.proxy(request, front.first_up())

    for path, method in (("/tokenize", "POST"), ("/detokenize", "POST"), ("/tokenizer_info", "GET")):
        app.add_api_route(path, any_replica, methods=[method], include_in_schema=False)
    for path in ("/v1/models", "/docs"):
        app.add_api_route(path, first_replica, methods=["GET"], include_in_schema=False)


def _schema_route(app: FastAPI, front: Front, access: Access) -> None:
    async def openapi() -> Response:
        """The replicas' schema (their request models and bounds) with the keys documented as the
        front checks them: a replica takes only the front's token, clients take the front's keys."""
        replica = front.first_up()
        answer = await front.get(replica, "/openapi.json")
        headers = {REPLICA_HEADER: str(replica)}
        if answer.status_code != 200:
            media_type = answer.headers.get("content-type")
            return Response(answer.content, status_code=answer.status_code, media_type=media_type, headers=headers)
        schema = answer.json()
        document_access(schema, access)
        return JSONResponse(schema, headers=headers)

    app.add_api_route("/openapi.json", openapi, methods=["GET"], include_in_schema=False)


def _aggregate_routes(app: FastAPI, front: Front) -> None:
    @app.get("/health")
    async def health() -> JSONResponse:
        """ok: every replica is; degraded: some are (still 200, requests are served); stopped: none."""
        answers = await front.ask_all("GET", "/health")
        states = [_state(a) for a in answers]
        for replica, state in enumerate(states):
            if state == "ok":
                front.router.mark_up(replica)
            else:
                front.router.mark_down(replica)
        up = states.count("ok")
        status = "ok" if up == len(states) else "degraded" if up else "stopped"
        return JSONResponse({"status": status, "replicas": states}, status_code=200 if up else 503)

    @app.post("/flush_cache")
    async def flush_cache() -> JSONResponse:
        answers = await front.ask_all("POST", "/flush_cache")
        for replica, answer in enumerate(answers):
            if answer is None:
                return APIError(503, f"data-parallel replica {replica} did not answer", type="server_error").response()
            if answer.status_code != 200:
                return JSONResponse(answer.json(), status_code=answer.status_code, headers={REPLICA_HEADER: str(replica)})
        flushed = [a.json()["flushed_slots"] for a in answers]
        return JSONResponse({"flushed_slots": sum(flushed), "replicas": flushed})

    @app.get("/metrics")
    async def metrics() -> Response:
        """Each replica's Prometheus metrics labelled replica="i", and replica="total" sums."""
        answers = await front.ask_all("GET", "/metrics")
        texts = [a.text if a is not None and a.status_code == 200 else None for a in answers]
        return Response(merge_prometheus(texts), media_type=PROMETHEUS_TEXT)

    @app.get("/metrics/json")
    async def metrics_json() -> dict[str, Any]:
        """{front: the router's counters and in-flight requests, replicas: each one's /metrics/json
        (null if it did not answer), total: their numbers summed}."""
        answers = await front.ask_all("GET", "/metrics/json")
        replicas = [a.json() if a is not None and a.status_code == 200 else None for a in answers]
        router = front.router
        state = {"in_flight": list(front.loads), "down": [i for i in range(len(answers)) if router.is_down(i)]}
        return {
            "front": router.counters.as_dict() | state | {"known_prefixes": router.known_prefixes()},
            "replicas": replicas,
            "total": merge_json(replicas),
        }


def _state(answer: httpx.Response | None) -> str:
    if answer is None:
        return "unreachable"
    try:
        return str(answer.json().get("status", answer.status_code))
    except ValueError:
        return f"http {answer.status_code}"
