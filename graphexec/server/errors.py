"""OpenAI-style error responses: `{"error": {"message", "type", "param", "code"}}` with a status.

Every failure the server answers (bad JSON, a validation error, graphexec's InvalidRequestError,
an unknown route, the queue limit, a bug) takes this one shape, so clients parse a single format.
A client that went away before its request was read gets no answer and costs one INFO line.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from types import MappingProxyType

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import Response

from graphexec.errors import InvalidRequestError

_log = logging.getLogger(__name__)

# graphexec's own names for request fields, as the HTTP API spells them.
_ENGINE_TO_API_FIELD = MappingProxyType({"max_new_tokens": "max_tokens"})
_LEADING_FIELD = re.compile(r"^([a-z_]+)")


class ErrorBody(BaseModel):
    """The published schema of every error answer (`APIError.response` builds it)."""

    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorBody


# In /openapi.json for the routes with a body: any other 4XX answer, in OpenAI's shape.  Its
# presence also keeps FastAPI from publishing a 422, which this server never sends (validation
# failures are 400s).
ERROR_RESPONSES = {"4XX": {"model": ErrorResponse, "description": "OpenAI-shaped error; `param` names the field"}}

# What each error status a route documents means here (`error_responses`); the statuses keys add
# (401, 403) are documented from the app's access rules instead (openapi.py).
_ERROR_MEANINGS = {
    400: "Invalid request: `param` names the field",
    404: "`model` is not the model this server serves",
    408: "The body did not arrive within server.request_read_timeout_s",
    409: "The cache cannot be flushed while requests are in flight",
    413: "The body is larger than server.max_body_bytes",
    503: "At capacity (server.max_queued_requests; retry after `Retry-After` seconds), or the engine has stopped",
}


def error_responses(*statuses: int) -> dict[int | str, dict]:
    """FastAPI `responses=` for the error statuses a route answers, with OpenAI's error body."""
    return {status: {"model": ErrorResponse, "description": _ERROR_MEANINGS[status]} for status in statuses}


# nginx's status for "the client closed the connection before the answer"; nobody receives it.
CLIENT_CLOSED_REQUEST = 499


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str,
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def response(self) -> JSONResponse:
        body = {"message": self.message, "type": self.type, "param": self.param, "code": self.code}
        return JSONResponse({"error": body}, status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, type="invalid_request_error", param=param, code=code)


def model_not_found(model: str, served: str) -> APIError:
    return APIError(
        404, f"model {model!r} does not exist; this server serves {served!r}",
        type="invalid_request_error", param="model", code="model_not_found",
    )


def from_validation_error(error: ValidationError) -> APIError:
    """The first problem pydantic found, as a 400 whose message and param name the field."""
    first = error.errors(include_url=False)[0]
    if first["type"] == "json_invalid":
        return bad_request(f"request body is not valid JSON: {first['ctx']['error']}", code="invalid_json")
    param = _param_name(first["loc"])
    if param is None:
        return bad_request(f"request body must be a JSON object: {first['msg']}")
    message = first["msg"].removeprefix("Value error, ")
    if first["type"] == "extra_forbidden":
        message = "unknown field (not part of this API)"
    elif first["type"] == "missing":
        message = "field required"
    return bad_request(f"{param}: {message}", param=param)


def from_invalid_request(error: InvalidRequestError) -> APIError:
    """graphexec's own validation (prompt length, vocabulary, sampling ranges) as a 400."""
    param = error.param
    if param is None:
        match = _LEADING_FIELD.match(str(error))
        param = match.group(1) if match else None
    param = _ENGINE_TO_API_FIELD.get(param, param)
    return bad_request(str(error), param=param)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, error: APIError) -> JSONResponse:
        return error.response()

    @app.exception_handler(RequestValidationError)
    async def _request_validation(request: Request, error: RequestValidationError) -> JSONResponse:
        # FastAPI's own validation (a query or path parameter): a 400 in OpenAI's shape, not a 422.
        first = error.errors()[0]
        param = _param_name(tuple(first["loc"])[1:])
        message = first["msg"].removeprefix("Value error, ")
        return bad_request(f"{param}: {message}" if param else message, param=param).response()

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, error: HTTPException) -> JSONResponse:
        # Unknown routes and methods: Starlette's 404/405, in OpenAI's shape.  Its headers stay: a
        # 405 must say in `Allow` which methods the route serves (RFC 9110).
        kind = "not_found_error" if error.status_code == 404 else "invalid_request_error"
        message = f"{request.method} {request.url.path}: {error.detail}"
        return APIError(error.status_code, message, type=kind, headers=error.headers).response()

    @app.exception_handler(ClientDisconnect)
    async def _client_gone(request: Request, error: ClientDisconnect) -> Response:
        # Handled here, not by the catch-all below: that one logs a traceback and Starlette re-raises
        # to uvicorn, which logs a second one; a client hanging up is routine, not a server fault.
        _log.info(
            "client %s went away before its request was read: %s %s",
            client_address(request), request.method, request.url.path,
        )
        return Response(status_code=CLIENT_CLOSED_REQUEST)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, error: Exception) -> JSONResponse:
        _log.exception("unhandled error serving %s %s", request.method, request.url.path)
        return APIError(500, f"internal error: {error!r}", type="server_error").response()


def client_address(request: Request) -> str:
    return f"{request.client.host}:{request.client.port}" if request.client else "?"


def _param_name(loc: tuple) -> str | None:
    """`("messages", 0, "content")` -> "messages[0].content"; stops at pydantic's type tags."""
    name = ""
    for part in loc:
        if isinstance(part, int):
            name += f"[{part}]"
        elif part.isidentifier() and part.islower() and part not in {"str", "int", "float", "bool", "list"}:
            name += f".{part}" if name else part
        else:  # a union member tag like "list[int]" or "function-plain[...]"
            break
    return name or None
