"""The FastAPI app: OpenAI-compatible routes over one `Engine`.

    POST /v1/completions, /v1/chat/completions   (stream=true answers server-sent events)
    POST /v1/responses   OpenAI's Responses API, stateless (responses_protocol.py)
    GET  /v1/models, /health
    GET  /metrics        Prometheus text (metrics.py: a registry per app)
    GET  /metrics/json   the engine's EngineMetrics as JSON (the snapshot /metrics served before)
    GET  /tokenizer_info, POST /tokenize, /detokenize   (vLLM's bodies; tokenize.py)
    POST /flush_cache    (drop the prefix cache; 409 while requests are in flight)
    GET  /openapi.json, /docs   (the request models, as routing.BodyRoute validates them)

Request bodies are pydantic models in the endpoints' signatures (so the schema is the real one),
read within the server's bounds and validated on the worker thread (routing.py).  With API keys
configured, every route but `server.public_routes` needs one, /flush_cache an admin one (auth.py).
Each route documents the error statuses it answers; the published schema adds the keys' rules and
this app's own bounds (openapi.py).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from typing import Literal

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from graphexec.engine.engine import Engine
from graphexec.server.api_keys import load_keys
from graphexec.server.auth import install_auth
from graphexec.server.config import ServerConfig
from graphexec.server.errors import ERROR_RESPONSES, APIError, error_responses, install_error_handlers
from graphexec.server.front_metrics import PROMETHEUS_TEXT
from graphexec.server.metrics import ServerMetrics
from graphexec.server.openapi import ServedLimits, document_access, document_limits, publish
from graphexec.server.protocol import ChatCompletionRequest, CompletionRequest
from graphexec.server.responses_protocol import ResponsesRequest
from graphexec.server.routing import BodyRoute
from graphexec.server.serving import OpenAIServing
from graphexec.server.tokenize import DetokenizeRequest, TokenizeRequest, TokenizerEndpoints

# What a route with a JSON body answers besides 200 (a generation route may also be at capacity).
_BODY_ERRORS = ERROR_RESPONSES | error_responses(400, 404, 408, 413)
_GENERATION_ERRORS = _BODY_ERRORS | error_responses(503)


class HealthStatus(BaseModel):
    status: Literal["ok", "stopped"]


def create_app(engine: Engine, config: ServerConfig) -> FastAPI:
    """The app; run it under `uvicorn_setup.uvicorn_options(config)` (app.state.server_config).
    A ConfigError for bad keys, or a non-loopback host without one (api_keys.load_keys)."""
    keys = load_keys(config)  # first: a refusal leaves no worker thread behind
    metrics = ServerMetrics(engine)
    serving = OpenAIServing(engine, config, metrics)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        try:
            yield
        finally:
            serving.close()  # the worker thread goes with the app; the engine is the caller's

    app = FastAPI(title="graphexec", redoc_url=None, lifespan=lifespan)
    app.state.server_config = config
    app.state.body_parser = serving  # BodyRoute's reader and validator (routing.py)
    install_error_handlers(app)
    access = install_auth(app, config, keys)
    limits = ServedLimits.of(engine, config)
    publish(app, partial(document_access, access=access), partial(document_limits, limits=limits))
    started = int(time.time())
    app.include_router(_generation_routes(serving))
    app.include_router(_tokenizer_routes(serving, TokenizerEndpoints(engine, serving.model_name, serving.tool_prompt)))

    @app.get("/v1/models")
    async def models() -> dict:
        model = {
            "id": serving.model_name,
            "object": "model",
            "created": started,
            "owned_by": "graphexec",
            "max_model_len": engine.max_context,
        }
        return {"object": "list", "data": [model]}

    health_answers = {200: {"model": HealthStatus}, 503: {"model": HealthStatus, "description": "The engine has stopped"}}

    @app.get("/health", responses=health_answers)
    async def health() -> JSONResponse:
        serving_now = engine.is_serving
        return JSONResponse({"status": "ok" if serving_now else "stopped"}, status_code=200 if serving_now else 503)

    @app.post("/flush_cache", responses=error_responses(409))
    async def flush_cache() -> JSONResponse:
        try:
            freed = await asyncio.to_thread(engine.flush_cache)
        except RuntimeError as error:
            return APIError(409, str(error), type="conflict_error").response()
        return JSONResponse({"flushed_slots": freed})

    @app.get("/metrics", response_class=Response)
    async def prometheus_metrics() -> Response:
        """Prometheus text: request counts by finish reason, running/waiting requests, KV slots,
        prefix-cache hit tokens, TTFT/TPOT/e2e histograms, retractions, and each capture backend's
        executions and fallbacks once, labelled with the ForwardModes that share it."""
        return Response(metrics.exposition(), media_type=PROMETHEUS_TEXT)

    @app.get("/metrics/json")
    async def metrics_json() -> dict:
        """JSON snapshot of EngineMetrics: running and waiting requests, KV slots
        used/free/reserved/cached, tokens/s over the last seconds, finished requests by reason,
        and per ForwardMode its capture backend's counters (executions = graph replays, fallbacks
        to eager; `modes` lists the modes sharing that backend)."""
        return {
            "model": serving.model_name,
            "uptime_s": round(time.time() - started, 3),
            "max_queued_requests": config.max_queued_requests,
            **engine.metrics().as_dict(),
        }

    return app


def _generation_routes(serving: OpenAIServing) -> APIRouter:
    router = APIRouter(route_class=BodyRoute, responses=_GENERATION_ERRORS)

    @router.post("/v1/completions", response_class=Response)
    async def completions(request: Request, body: CompletionRequest) -> Response:
        """Legacy completions: `prompt` is a string, token ids, or a list of either (one choice per
        prompt × n, prompt-major)."""
        return await serving.completions(request, body)

    @router.post("/v1/chat/completions", response_class=Response)
    async def chat_completions(request: Request, body: ChatCompletionRequest) -> Response:
        return await serving.chat(request, body)

    @router.post("/v1/responses", response_class=Response)
    async def responses(request: Request, body: ResponsesRequest) -> Response:
        """OpenAI's Responses API over the chat template, stateless: nothing is stored, so the
        whole conversation comes in `input` each time.  stream=true answers named events
        (`response.created` ... `response.completed`)."""
        return await serving.responses(request, body)

    return router


def _tokenizer_routes(serving: OpenAIServing, tokenizer: TokenizerEndpoints) -> APIRouter:
    router = APIRouter(route_class=BodyRoute)

    @router.get("/tokenizer_info")
    async def tokenizer_info() -> dict:
        return await serving.on_worker(tokenizer.info)

    @router.post("/tokenize", response_class=Response, responses=_BODY_ERRORS)
    async def tokenize(request: Request, body: TokenizeRequest) -> Response:
        return JSONResponse(await serving.on_worker_for(request, tokenizer.tokenize, body))

    @router.post("/detokenize", response_class=Response, responses=_BODY_ERRORS)
    async def detokenize(request: Request, body: DetokenizeRequest) -> Response:
        return JSONResponse(await serving.on_worker_for(request, tokenizer.detokenize, body))

    return router
