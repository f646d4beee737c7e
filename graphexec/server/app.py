"""The FastAPI app: OpenAI-compatible routes over one `Engine`.

    POST /v1/completions, /v1/chat/completions   (stream=true answers server-sent events)
    GET  /v1/models, /health, /metrics
    POST /flush_cache   (drop the prefix cache; 409 while requests are in flight)

/metrics is JSON (not Prometheus text): the engine's EngineMetrics (running and waiting requests,
KV slots used/free/reserved/cached, tokens/s over the last seconds, finished requests by reason, and
per-ForwardMode capture backend counters: executions = graph replays, fallbacks to eager).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from graphexec.engine.engine import Engine
from graphexec.server.config import ServerConfig
from graphexec.server.errors import APIError, install_error_handlers
from graphexec.server.serving import OpenAIServing


def create_app(engine: Engine, config: ServerConfig) -> FastAPI:
    """The app; run it under `uvicorn_setup.uvicorn_options(config)` (app.state.server_config)."""
    serving = OpenAIServing(engine, config)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        try:
            yield
        finally:
            serving.close()  # the worker thread goes with the app; the engine is the caller's

    app = FastAPI(title="graphexec", openapi_url=None, docs_url=None, redoc_url=None, lifespan=lifespan)
    app.state.server_config = config
    install_error_handlers(app)
    started = int(time.time())

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await serving.completions(request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await serving.chat(request)

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

    @app.get("/health")
    async def health() -> JSONResponse:
        serving_now = engine.is_serving
        return JSONResponse({"status": "ok" if serving_now else "stopped"}, status_code=200 if serving_now else 503)

    @app.post("/flush_cache")
    async def flush_cache() -> JSONResponse:
        try:
            freed = await asyncio.to_thread(engine.flush_cache)
        except RuntimeError as error:
            return APIError(409, str(error), type="conflict_error").response()
        return JSONResponse({"flushed_slots": freed})

    @app.get("/metrics")
    async def metrics() -> dict:
        return {
            "model": serving.model_name,
            "uptime_s": round(time.time() - started, 3),
            "max_queued_requests": config.max_queued_requests,
            **engine.metrics().as_dict(),
        }

    return app
