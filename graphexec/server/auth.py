"""Bearer-key checks in front of every route: a pure ASGI middleware, so it covers the whole app
(/openapi.json and /docs, unknown paths, whatever route comes next) and never touches a body.

With any key configured (api_keys.py), a request must send `Authorization: Bearer <key>` unless
its path is one of `server.public_routes` (or /metrics, /metrics/json under
`server.public_metrics`):

    no key, or one that is not configured        401, `WWW-Authenticate: Bearer`, OpenAI's
                                                 `invalid_api_key` error body
    a user key on an admin route (ADMIN_ROUTES)  403 for the methods that route serves; any other
                                                 method goes on to the router's 405 (with `Allow`)
    an admin key                                 every route

Paths match exactly (`/health/` is not `/health`), as the routes see them (less the app's
`root_path`, as Starlette routes), so anything not listed needs a key.  A refused
request's body is left unread; the protocol discards it under its read deadline (uvicorn_setup.py).
Nothing here logs, and no answer quotes what the client sent.

`Access` states these rules once: the middleware enforces them and openapi.py publishes them
(a bearer security scheme, 401 and 403 answers), so /openapi.json says what the server does.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from fastapi import FastAPI
from starlette.routing import BaseRoute, Mount
from starlette.types import ASGIApp, Receive, Scope, Send

from graphexec.server.api_keys import ADMIN, Keys
from graphexec.server.config import ADMIN_ROUTES, ServerConfig
from graphexec.server.errors import APIError

METRICS_ROUTES = frozenset({"/metrics", "/metrics/json"})
_BEARER = b"bearer "


@dataclass(frozen=True)
class Access:
    """Which paths need a key, and which an admin key: what BearerAuth enforces, as published."""

    keys_required: bool
    public: frozenset[str]
    admin: frozenset[str] = ADMIN_ROUTES

    @classmethod
    def of(cls, config: ServerConfig, keys: Keys) -> Access:
        public = frozenset(config.public_routes) | (METRICS_ROUTES if config.public_metrics else frozenset())
        return cls(keys.required, public)

    def protects(self, path: str) -> bool:
        return self.keys_required and path not in self.public

    def needs_admin(self, path: str) -> bool:
        return self.protects(path) and path in self.admin


class BearerAuth:
    """The middleware; `public` paths pass without a key, `admin` paths need an admin key for the
    methods their `routes` serve (every method of an admin path no route serves)."""

    def __init__(
        self, app: ASGIApp, keys: Keys, public: frozenset[str], admin: frozenset[str] = ADMIN_ROUTES,
        routes: Sequence[BaseRoute] = (),
    ):
        self.app = app
        self.keys = keys
        self.public = public
        served = _served_methods(routes)
        # path -> the methods that need an admin key there; None: every method.
        self.admin = {path: served.get(path) for path in admin}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or not self.keys.required or _route_path(scope) in self.public:
            await self.app(scope, receive, send)
            return
        refusal = self._refusal(scope, _route_path(scope))
        if refusal is None:
            await self.app(scope, receive, send)
        elif scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})  # policy violation; no route uses one yet
        else:
            await refusal.response()(scope, receive, send)

    def _refusal(self, scope: Scope, path: str) -> APIError | None:
        presented = _bearer_token(scope["headers"])
        if presented is None:
            return _unauthorized(
                "no API key: send it as `Authorization: Bearer <key>`", 'Bearer realm="graphexec"'
            )
        role = self.keys.role(presented)
        if role is None:
            return _unauthorized("invalid API key", 'Bearer realm="graphexec", error="invalid_token"')
        if role != ADMIN and self._admin_only(path, scope.get("method")):
            return APIError(
                403, f"{path} needs an admin key (server.admin_api_key)",
                type="permission_error", code="admin_key_required",
                headers={"WWW-Authenticate": 'Bearer realm="graphexec", error="insufficient_scope"'},
            )
        return None

    def _admin_only(self, path: str, method: str | None) -> bool:
        if path not in self.admin:
            return False
        methods = self.admin[path]
        # A method the route does not serve is no use of it: the router answers 405 with `Allow`.
        return methods is None or method is None or method in methods


def install_auth(app: FastAPI, config: ServerConfig, keys: Keys) -> Access:
    """`app` behind `keys` (`api_keys.load_keys(config)`), with `config`'s public routes; the
    rules it enforces, for the published schema (openapi.py)."""
    access = Access.of(config, keys)
    # The live list, not a copy: Starlette builds the middleware at the app's first event, by
    # when every route of the app is added, wherever install_auth was called.
    app.add_middleware(BearerAuth, keys=keys, public=access.public, admin=access.admin, routes=app.router.routes)
    return access


def _served_methods(routes: Iterable[BaseRoute], prefix: str = "") -> dict[str, frozenset[str] | None]:
    """{path: methods} of every route under `routes`, through included routers and mounts; None
    for a path some route serves whatever the method (an ASGI app, a websocket)."""
    served: dict[str, frozenset[str] | None] = {}

    def add(path: str, methods: frozenset[str] | None) -> None:
        known = served.get(path, frozenset())
        served[path] = None if methods is None or known is None else known | methods

    for route in routes:
        included = getattr(route, "original_router", None)  # FastAPI includes routers lazily
        if included is not None:
            children = _served_methods(included.routes, prefix + route.include_context.prefix)
        elif isinstance(route, Mount):
            children = _served_methods(route.routes, prefix + route.path)
        elif hasattr(route, "path"):
            methods = getattr(route, "methods", None)
            children = {prefix + route.path: frozenset(methods) if methods else None}
        else:
            children = {}
        for path, methods in children.items():
            add(path, methods)
    return served


def _route_path(scope: Scope) -> str:
    # What the routes match: the path less a root_path the app is mounted under (Starlette's rule),
    # so a mounted app's admin routes stay admin routes.
    path, root = scope["path"], scope.get("root_path", "")
    if root and path.startswith(root) and path[len(root):][:1] in ("/", ""):
        return path[len(root):]
    return path


def _bearer_token(headers: list[tuple[bytes, bytes]]) -> bytes | None:
    for name, value in headers:
        if name == b"authorization":  # ASGI servers lower-case header names
            scheme_and_token = value.strip()
            if scheme_and_token[: len(_BEARER)].lower() == _BEARER:
                return scheme_and_token[len(_BEARER):].strip() or None
            return None
    return None


def _unauthorized(message: str, challenge: str) -> APIError:
    return APIError(
        401, message, type="invalid_request_error", code="invalid_api_key", headers={"WWW-Authenticate": challenge}
    )
