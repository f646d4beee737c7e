"""Bearer-key checks in front of every route: a pure ASGI middleware, so it covers the whole app
(/openapi.json and /docs, unknown paths, whatever route comes next) and never touches a body.

With any key configured (api_keys.py), a request must send `Authorization: Bearer <key>` unless
its path is one of `server.public_routes` (or /metrics, /metrics/json under
`server.public_metrics`):

    no key, or one that is not configured        401, `WWW-Authenticate: Bearer`, OpenAI's
                                                 `invalid_api_key` error body
    a user key on an admin route (ADMIN_ROUTES)  403
    an admin key                                 every route

Paths match exactly (`/health/` is not `/health`), as the routes see them (less the app's
`root_path`, as Starlette routes), so anything not listed needs a key.  A refused
request's body is left unread; the protocol discards it under its read deadline (uvicorn_setup.py).
Nothing here logs, and no answer quotes what the client sent.
"""

from __future__ import annotations

from fastapi import FastAPI
from starlette.types import ASGIApp, Receive, Scope, Send

from graphexec.server.api_keys import ADMIN, Keys
from graphexec.server.config import ADMIN_ROUTES, ServerConfig
from graphexec.server.errors import APIError

METRICS_ROUTES = frozenset({"/metrics", "/metrics/json"})
_BEARER = b"bearer "


class BearerAuth:
    """The middleware; `public` paths pass without a key, `admin` paths need an admin key."""

    def __init__(self, app: ASGIApp, keys: Keys, public: frozenset[str], admin: frozenset[str] = ADMIN_ROUTES):
        self.app = app
        self.keys = keys
        self.public = public
        self.admin = admin

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
        if path in self.admin and role != ADMIN:
            return APIError(
                403, f"{path} needs an admin key (server.admin_api_key)",
                type="permission_error", code="admin_key_required",
                headers={"WWW-Authenticate": 'Bearer realm="graphexec", error="insufficient_scope"'},
            )
        return None


def install_auth(app: FastAPI, config: ServerConfig, keys: Keys) -> None:
    """`app` behind `keys` (`api_keys.load_keys(config)`), with `config`'s public routes."""
    public = frozenset(config.public_routes) | (METRICS_ROUTES if config.public_metrics else frozenset())
    app.add_middleware(BearerAuth, keys=keys, public=public)


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
