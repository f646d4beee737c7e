"""Routes whose JSON body is a typed request model, read within the server's bounds and validated
off the event loop.

A route of `BodyRoute` declares its body as a pydantic model in the endpoint's signature
(`async def completions(request: Request, body: CompletionRequest)`), so FastAPI publishes the
model in /openapi.json and /docs.  The body is not read by FastAPI, though: FastAPI would read it
whole (no size or time bound) and parse it on the event loop.  Instead the route's handler reads
it through `limits.read_body` (413 past `server.max_body_bytes`, 408 past
`server.request_read_timeout_s`), has the app's body parser validate it on the server's worker
thread (`model_validate_json`, strict, errors as OpenAI 400s naming the field), and calls the
endpoint with the model.  The parser is the app's (`app.state.body_parser`), not a global.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any, Protocol

from fastapi import Request
from fastapi.routing import APIRoute
from pydantic import BaseModel
from starlette.responses import Response


class BodyParser(Protocol):
    async def parse(self, request: Request, model: type[BaseModel]) -> BaseModel: ...


class BodyRoute(APIRoute):
    """An APIRoute whose one body parameter is read and validated by the app's `BodyParser`;
    its endpoint takes `request` and that parameter, and returns a Response."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        params = self.dependant.body_params
        if len(params) != 1 or not isinstance(params[0].field_info.annotation, type):
            return super().get_route_handler()  # no body, or not one model: FastAPI's own handling
        name, model = params[0].name, params[0].field_info.annotation
        endpoint = self.endpoint

        async def handler(request: Request) -> Response:
            parser: BodyParser = request.app.state.body_parser
            body = await parser.parse(request, model)
            return await endpoint(request=request, **{name: body})

        return handler
