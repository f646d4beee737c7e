"""One OpenAI request through the engine: read, prepare, admit (or 503), generate, answer or stream.

The event loop only moves bytes and deltas.  Preparing a request (JSON parsing, chat templating,
tokenization, the token bound) runs on one worker thread owned by `OpenAIServing`, so /health and
every stream keep answering while a 10 MB prompt is tokenized.  That path runs no torch op, so the
thread never starts an OpenMP team of its own.  Validation happens before anything is queued, so
a bad request costs no KV.  A client that goes away aborts its request with one INFO line: a
stream's generator is cancelled (Starlette watches for the disconnect) and a plain request races
its result against the disconnect message.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Generic, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from graphexec.engine.engine import Engine
from graphexec.engine.request_output import RequestDelta, RequestOutput
from graphexec.engine.request_stream import AsyncRequestStream
from graphexec.errors import EngineClosedError, InvalidRequestError, RequestFailedError
from graphexec.sampling_params import SamplingParams
from graphexec.server.config import ServerConfig
from graphexec.server.errors import (
    CLIENT_CLOSED_REQUEST,
    APIError,
    client_address,
    from_invalid_request,
    from_validation_error,
)
from graphexec.server.heap import give_back_free_heap
from graphexec.server.limits import TokenBound, read_body
from graphexec.server.protocol import ChatCompletionRequest, CompletionRequest
from graphexec.server.responses import LogprobsFormatter, ResponseHeader, sse

Body = TypeVar("Body", CompletionRequest, ChatCompletionRequest)

_log = logging.getLogger(__name__)

# Bodies from this size on may leave hundreds of MB of freed tokenizer memory in the worker's
# malloc arena (heap.py); below it, the trim would cost more than it returns.
_TRIM_AFTER_BYTES = 1 << 20


@dataclass(frozen=True)
class Prepared(Generic[Body]):
    """A request ready for the engine: its validated body, prompt token ids and sampling."""

    body: Body
    prompt_ids: list[int]
    params: SamplingParams


class OpenAIServing:
    def __init__(self, engine: Engine, config: ServerConfig):
        self.engine = engine
        self.config = config
        self.model_name = engine.config.model.name
        # One thread: requests are prepared in arrival order, and a huge prompt costs one core, not
        # all of them.  ThreadPoolExecutor starts it on the first request.
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="graphexec-http-prepare")

    def close(self) -> None:
        """Stop the worker thread (the app's shutdown); a preparation under way still finishes."""
        self._worker.shutdown(wait=False, cancel_futures=True)

    async def completions(self, request: Request) -> Response:
        prepared = await self._prepare(request, CompletionRequest, self._completion_prompt)
        body = prepared.body
        stream = self._start(prepared)
        header = ResponseHeader(f"cmpl-{uuid.uuid4().hex}", int(time.time()), self.model_name)
        formatter = LogprobsFormatter(self.engine.tokenizer)
        if body.stream:
            def chunks(delta: RequestDelta) -> list[dict]:
                if not (delta.text or delta.logprobs or delta.finished):
                    return []
                return [header.completion_chunk(delta.text, formatter.completion(delta.logprobs), delta.finish_reason)]

            return self._sse(stream, [], chunks, header, "text_completion", body.include_usage, request)
        output = await self._result(stream, request)
        if output is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        return JSONResponse(header.completion(output, formatter.completion(output.logprobs)))

    async def chat(self, request: Request) -> Response:
        prepared = await self._prepare(request, ChatCompletionRequest, self._chat_prompt)
        body = prepared.body
        stream = self._start(prepared)
        header = ResponseHeader(f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), self.model_name)
        formatter = LogprobsFormatter(self.engine.tokenizer)
        if body.stream:
            def chunks(delta: RequestDelta) -> list[dict]:
                if not (delta.text or delta.logprobs or delta.finished):
                    return []
                content = {"content": delta.text} if delta.text or not delta.finished else {}
                return [header.chat_chunk(content, formatter.chat(delta.logprobs), delta.finish_reason)]

            opening = [header.chat_chunk({"role": "assistant", "content": ""}, None, None)]
            return self._sse(stream, opening, chunks, header, "chat.completion.chunk", body.include_usage, request)
        output = await self._result(stream, request)
        if output is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        return JSONResponse(header.chat(output, formatter.chat(output.logprobs)))

    async def _prepare(
        self, request: Request, model: type[Body], encode: Callable[[Body], tuple[list[int], str]]
    ) -> Prepared[Body]:
        """Read the body on the loop (bounded in size and time), then prepare it on the worker."""
        raw = await read_body(request, self.config.max_body_bytes, self.config.request_read_timeout_s)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._worker, self._prepare_now, raw, model, encode)

    def _prepare_now(
        self, raw: bytearray, model: type[Body], encode: Callable[[Body], tuple[list[int], str]]
    ) -> Prepared[Body]:
        """On the worker thread: parse, tokenize, bound max_tokens; every failure an APIError."""
        try:
            body = self._parse(raw, model)
            prompt_ids, prompt_field = encode(body)
            field, requested = body.requested_max_tokens()
            bound = TokenBound(self.engine.max_context, self.engine.max_request_tokens, self.config.clamp_max_tokens)
            max_new_tokens = bound.max_new_tokens(len(prompt_ids), requested, field=field, prompt_field=prompt_field)
            params = body.to_sampling_params(self.engine.config.sampling, max_new_tokens)
            if params.structured is not None:
                self.engine.prepare_grammar(params.structured)  # compiled here, not on the event loop
            return Prepared(body, prompt_ids, params)
        except InvalidRequestError as error:
            raise from_invalid_request(error) from None
        finally:
            if len(raw) >= _TRIM_AFTER_BYTES:
                give_back_free_heap()

    def _parse(self, raw: bytearray, model: type[Body]) -> Body:
        try:
            body = model.model_validate_json(raw)
        except ValidationError as error:
            raise from_validation_error(error) from None
        if body.model != self.model_name:
            raise APIError(
                404, f"model {body.model!r} does not exist; this server serves {self.model_name!r}",
                type="invalid_request_error", param="model", code="model_not_found",
            )
        return body

    def _completion_prompt(self, body: CompletionRequest) -> tuple[list[int], str]:
        return self.engine.prompt_encoder.encode(body.prompt, chat=False, label="prompt"), "prompt"

    def _chat_prompt(self, body: ChatCompletionRequest) -> tuple[list[int], str]:
        return self.engine.encode_chat(body.chat_messages()), "messages"

    def _start(self, prepared: Prepared) -> AsyncRequestStream:
        """On the loop: the queue limit, then the engine (astream must run on the consuming loop)."""
        self._admit()
        try:
            return self.engine.astream(prepared.prompt_ids, prepared.params)
        except InvalidRequestError as error:
            raise from_invalid_request(error) from None
        except EngineClosedError as error:
            raise APIError(503, str(error), type="server_error", code="engine_closed") from None

    def _admit(self) -> None:
        """Requests beyond the running capacity queue; past the queue limit they get a 503."""
        capacity = self.engine.config.scheduler.max_running_requests
        queued = self.engine.num_unfinished() - capacity
        if queued >= self.config.max_queued_requests:
            raise APIError(
                503, f"server is at capacity: {capacity} requests running and {queued} queued "
                f"(server.max_queued_requests={self.config.max_queued_requests}); retry later",
                type="server_error", code="queue_full",
                headers={"Retry-After": str(self.config.queue_full_retry_after_s)},
            )

    async def _result(self, stream: AsyncRequestStream, request: Request) -> RequestOutput | None:
        """The whole output, or None when the client disconnected first (the request is aborted)."""
        result = asyncio.ensure_future(stream.result())
        disconnect = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({result, disconnect}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            disconnect.cancel()
            if not result.done():
                result.cancel()  # the client left (or this handler was cancelled): abort
                stream.cancel()
        if not result.done() or result.cancelled():
            _log.info("client %s went away; aborted request %s", client_address(request), stream.request_id)
            return None
        try:
            return result.result()
        except RequestFailedError as error:
            raise APIError(500, str(error), type="server_error") from error

    def _sse(
        self,
        stream: AsyncRequestStream,
        opening: list[dict],
        chunks: Callable[[RequestDelta], list[dict]],
        header: ResponseHeader,
        object_name: str,
        include_usage: bool,
        request: Request,
    ) -> StreamingResponse:
        async def events() -> AsyncIterator[str]:
            try:
                for chunk in opening:
                    yield sse(chunk)
                async for delta in stream:
                    for chunk in chunks(delta):
                        yield sse(chunk)
                    if delta.finished and include_usage:
                        yield sse(header.usage_chunk(delta.output, object_name))
            except RequestFailedError as error:
                yield sse({"error": {"message": str(error), "type": "server_error", "param": None, "code": None}})
            finally:
                if not stream.finished:  # the client went away mid-stream (or the server is stopping)
                    client = client_address(request)
                    _log.info("client %s went away mid-stream; aborted request %s", client, stream.request_id)
                    stream.cancel()
            yield sse("[DONE]")

        return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def _disconnected(request: Request) -> None:
    """Returns when the client closes the connection (the body has been read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass

