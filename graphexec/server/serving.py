"""One OpenAI request through the engine: validate, admit (or 503), generate, answer or stream.

Validation happens before anything is queued, so a bad request costs no KV.  A client that goes
away aborts its request: a stream's generator is cancelled (Starlette watches for the disconnect)
and a plain request races its result against the disconnect message.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from graphexec.engine import Engine
from graphexec.errors import EngineClosedError, InvalidRequestError, RequestFailedError
from graphexec.request_output import RequestDelta, RequestOutput
from graphexec.request_stream import AsyncRequestStream
from graphexec.server.config import ServerConfig
from graphexec.server.errors import APIError, from_invalid_request, from_validation_error
from graphexec.server.protocol import ChatCompletionRequest, CompletionRequest
from graphexec.server.responses import LogprobsFormatter, ResponseHeader, sse

Body = TypeVar("Body", CompletionRequest, ChatCompletionRequest)

# nginx's status for "the client closed the connection before the answer"; nobody receives it.
_CLIENT_CLOSED_REQUEST = 499


class OpenAIServing:
    def __init__(self, engine: Engine, config: ServerConfig):
        self.engine = engine
        self.config = config
        self.model_name = engine.config.model.name

    async def completions(self, request: Request) -> Response:
        body = await self._parse(request, CompletionRequest)
        stream = self._start(body, lambda: self.engine.prompt_encoder.encode(body.prompt, chat=False, label="prompt"))
        header = ResponseHeader(f"cmpl-{uuid.uuid4().hex}", int(time.time()), self.model_name)
        formatter = LogprobsFormatter(self.engine.tokenizer)
        if body.stream:
            def chunks(delta: RequestDelta) -> list[dict]:
                if not (delta.text or delta.logprobs or delta.finished):
                    return []
                return [header.completion_chunk(delta.text, formatter.completion(delta.logprobs), delta.finish_reason)]

            return self._sse(stream, [], chunks, header, "text_completion", body.include_usage)
        output = await self._result(stream, request)
        if output is None:
            return Response(status_code=_CLIENT_CLOSED_REQUEST)
        return JSONResponse(header.completion(output, formatter.completion(output.logprobs)))

    async def chat(self, request: Request) -> Response:
        body = await self._parse(request, ChatCompletionRequest)
        stream = self._start(body, lambda: self.engine.encode_chat(body.chat_messages()))
        header = ResponseHeader(f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), self.model_name)
        formatter = LogprobsFormatter(self.engine.tokenizer)
        if body.stream:
            def chunks(delta: RequestDelta) -> list[dict]:
                if not (delta.text or delta.logprobs or delta.finished):
                    return []
                content = {"content": delta.text} if delta.text or not delta.finished else {}
                return [header.chat_chunk(content, formatter.chat(delta.logprobs), delta.finish_reason)]

            opening = [header.chat_chunk({"role": "assistant", "content": ""}, None, None)]
            return self._sse(stream, opening, chunks, header, "chat.completion.chunk", body.include_usage)
        output = await self._result(stream, request)
        if output is None:
            return Response(status_code=_CLIENT_CLOSED_REQUEST)
        return JSONResponse(header.chat(output, formatter.chat(output.logprobs)))

    async def _parse(self, request: Request, model: type[Body]) -> Body:
        try:
            body = model.model_validate_json(await request.body())
        except ValidationError as error:
            raise from_validation_error(error) from None
        if body.model != self.model_name:
            raise APIError(
                404, f"model {body.model!r} does not exist; this server serves {self.model_name!r}",
                type="invalid_request_error", param="model", code="model_not_found",
            )
        return body

    def _start(self, body: CompletionRequest | ChatCompletionRequest, encode: Callable[[], list[int]]) -> AsyncRequestStream:
        try:
            params = body.to_sampling_params(self.engine.config.sampling)
            prompt_ids = encode()
            self._admit()
            return self.engine.astream(prompt_ids, params)
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
                stream.cancel()  # no-op once finished; aborts when the client went away mid-stream
            yield sse("[DONE]")

        return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def _disconnected(request: Request) -> None:
    """Returns when the client closes the connection (the body has been read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass

