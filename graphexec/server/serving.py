"""One OpenAI request through the engine: read, prepare, admit (or 503), generate, answer or stream.

The event loop only moves bytes and deltas.  Parsing a body (routing.BodyRoute hands it here) and
preparing a request (chat templating, tokenization, the token bound) run on one worker thread
owned by `OpenAIServing`, so /health and every stream keep answering while a 10 MB prompt is
tokenized.  That path runs no torch op, so the thread never starts an OpenMP team of its own.
Validation happens before anything is queued, so a bad request costs no KV.

A request fans out into one engine request per prompt × n (fanout.py), submitted together so the
scheduler batches them; choice `p * n + i` is prompt p's i-th, as OpenAI numbers them.  With a
`seed`, choice i of each prompt is seeded with `(seed + i) mod 2**64`, so each is reproducible on
its own and choices differ; without one (or greedy) choices are independent draws (identical,
greedy).  A client that goes away aborts every request of its own, with one INFO line.

A chat request with `tools` is planned by tools.py (checks, the constraint its tool_choice asks
for), templated by tool_prompt.py, and its replies are read for calls by tool_parsers.py (as
they stream: tool_stream.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Generic, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError

from graphexec.engine.engine import Engine
from graphexec.engine.request_output import RequestDelta, RequestOutput
from graphexec.engine.request_stream import AsyncRequestStream
from graphexec.errors import EngineClosedError, InvalidRequestError, RequestFailedError
from graphexec.sampling_params import SamplingParams
from graphexec.server import fanout
from graphexec.server.config import ServerConfig
from graphexec.server.errors import (
    CLIENT_CLOSED_REQUEST,
    APIError,
    bad_request,
    client_address,
    from_invalid_request,
    from_validation_error,
    model_not_found,
)
from graphexec.server.heap import give_back_free_heap
from graphexec.server.limits import TokenBound, read_body
from graphexec.server.metrics import ServerMetrics
from graphexec.server.protocol import ChatCompletionRequest, CompletionRequest
from graphexec.server.responses import LogprobsFormatter, ResponseHeader, sse, usage
from graphexec.server.responses_input import chat_messages, tool_plan
from graphexec.server.responses_output import ResponseEvents, ResponseShell, new_id, sse_event, text_logprobs
from graphexec.server.responses_protocol import ResponsesRequest
from graphexec.server.tool_parsers import resolve_format
from graphexec.server.tool_prompt import ToolPrompt
from graphexec.server.tool_stream import ToolCallChunks
from graphexec.server.tools import ToolPlan

Body = TypeVar("Body", CompletionRequest, ChatCompletionRequest, ResponsesRequest)
Model = TypeVar("Model", bound=BaseModel)
Result = TypeVar("Result")

_log = logging.getLogger(__name__)

# Bodies from this size on may leave hundreds of MB of freed tokenizer memory in the worker's
# malloc arena (heap.py); below it, the trim would cost more than it returns.
_TRIM_AFTER_BYTES = 1 << 20

_SEED_MODULUS = 2**64  # torch.Generator seeds are unsigned 64-bit

_SSE_HEADERS = MappingProxyType({"Cache-Control": "no-cache"})


@dataclass(frozen=True)
class Prepared(Generic[Body]):
    """A request ready for the engine: its body, and per choice (prompt-major) ids and sampling."""

    body: Body
    prompt_ids: list[list[int]]
    params: list[SamplingParams]
    tools: ToolPlan | None = None  # a chat request's tool calling (tools.py)

    @property
    def n(self) -> int:
        return self.body.n


class OpenAIServing:
    def __init__(self, engine: Engine, config: ServerConfig, metrics: ServerMetrics):
        self.engine = engine
        self.config = config
        self.metrics = metrics
        self.model_name = engine.config.model.name
        # One thread: requests are prepared in arrival order, and a huge prompt costs one core, not
        # all of them.  ThreadPoolExecutor starts it on the first request.
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="graphexec-http-prepare")
        template = engine.tokenizer.chat_template if engine.tokenizer is not None else None
        self.tool_prompt = ToolPrompt(engine.tokenizer, resolve_format(config.tool_parser, template))

    def close(self) -> None:
        """Stop the worker thread (the app's shutdown); a preparation under way still finishes."""
        self._worker.shutdown(wait=False, cancel_futures=True)

    async def on_worker(self, function: Callable[..., Result], *args: Any) -> Result:
        """`function(*args)` on the worker thread (tokenizing, templating: never on the loop)."""
        return await asyncio.get_running_loop().run_in_executor(self._worker, function, *args)

    async def on_worker_for(self, request: Request, function: Callable[..., Result], *args: Any) -> Result:
        """`on_worker` for a request whose body `parse` read: the heap is trimmed after a large one."""

        def run() -> Result:
            try:
                return function(*args)
            finally:
                _trim_after(request.state.body_bytes)

        return await self.on_worker(run)

    async def parse(self, request: Request, model: type[Model]) -> Model:
        """routing.BodyParser: the body read within the bounds, then validated on the worker."""
        raw = await read_body(request, self.config.max_body_bytes, self.config.request_read_timeout_s)
        request.state.body_bytes = len(raw)  # for the heap trim after its preparation
        return await self.on_worker(self._validate, raw, model)

    def _validate(self, raw: bytearray, model: type[Model]) -> Model:
        try:
            return model.model_validate_json(raw)
        except ValidationError as error:
            _trim_after(len(raw))  # a valid body is trimmed after its tokenization instead
            raise from_validation_error(error) from None

    async def completions(self, request: Request, body: CompletionRequest) -> Response:
        prepared = await self.on_worker(self._prepare_now, body, self._completion_prompts, request.state.body_bytes)
        streams = self._start(prepared)
        header = ResponseHeader(f"cmpl-{uuid.uuid4().hex}", int(time.time()), self.model_name)
        formatters = [LogprobsFormatter(self.engine.tokenizer) for _ in streams]
        if body.stream:
            # Echo streams the prompt first: at once, or with logprobs as soon as they exist (the
            # choice's first delta, after its prefill), so the chunks join into the unstreamed choice.
            echo_waits = [body.echo and body.logprobs is not None] * len(streams)

            def chunks(index: int, delta: RequestDelta) -> list[dict]:
                sent = []
                if echo_waits[index]:
                    echo_waits[index] = False
                    text, logprobs = formatters[index].echo(prepared.prompt_ids[index], delta.prompt_logprobs)
                    sent.append(header.completion_chunk(index, text, logprobs, None))
                if delta.text or delta.logprobs or delta.finished:
                    logprobs = formatters[index].completion(delta.logprobs)
                    sent.append(header.completion_chunk(index, delta.text, logprobs, delta.finish_reason))
                return sent

            opening = []
            if body.echo and body.logprobs is None:
                echoed = [f.echo(ids, None)[0] for f, ids in zip(formatters, prepared.prompt_ids)]
                opening = [header.completion_chunk(i, text, None, None) for i, text in enumerate(echoed)]
            return self._sse(streams, prepared, opening, chunks, header, "text_completion", request)
        outputs = await self._results(streams, request)
        if outputs is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        choices = [self._completion_choice(header, i, out, formatters[i], body) for i, out in enumerate(outputs)]
        return JSONResponse(header.completion(choices, usage(outputs, prepared.n)))

    @staticmethod
    def _completion_choice(
        header: ResponseHeader, index: int, output: RequestOutput, formatter: LogprobsFormatter, body: CompletionRequest
    ) -> dict:
        echoed, echoed_logprobs = "", None
        if body.echo:
            echoed, echoed_logprobs = formatter.echo(output.prompt_token_ids, output.prompt_logprobs)
        logprobs = formatter.joined(echoed_logprobs, formatter.completion(output.logprobs))
        return header.completion_choice(index, output, logprobs, echoed)

    async def chat(self, request: Request, body: ChatCompletionRequest) -> Response:
        prepared = await self.on_worker(self._prepare_now, body, self._chat_prompts, request.state.body_bytes)
        streams = self._start(prepared)
        header = ResponseHeader(f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), self.model_name)
        formatter = LogprobsFormatter(self.engine.tokenizer)  # chat logprobs carry no offsets
        tools = prepared.tools if prepared.tools is not None and prepared.tools.offered else None
        if body.stream:
            def text_chunks(index: int, delta: RequestDelta) -> list[dict]:
                if not (delta.text or delta.logprobs or delta.finished):
                    return []
                content = {"content": delta.text} if delta.text or not delta.finished else {}
                return [header.chat_chunk(index, content, formatter.chat(delta.logprobs), delta.finish_reason)]

            chunks = text_chunks
            if tools is not None:  # replies read for calls as they stream
                chunks = ToolCallChunks(header, tools.stream, len(streams), formatter.chat)
            opening = [header.chat_chunk(i, {"role": "assistant", "content": ""}, None, None) for i in range(len(streams))]
            return self._sse(streams, prepared, opening, chunks, header, "chat.completion.chunk", request)
        outputs = await self._results(streams, request)
        if outputs is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        replies = [tools.parse(out.text) if tools else None for out in outputs]
        choices = [header.chat_choice(i, out, formatter.chat(out.logprobs), r) for i, (out, r) in enumerate(zip(outputs, replies))]
        return JSONResponse(header.chat(choices, usage(outputs, prepared.n)))

    async def responses(self, request: Request, body: ResponsesRequest) -> Response:
        """The Responses API over the chat path (responses_input/_output.py hold its shapes)."""
        prepared = await self.on_worker(self._prepare_now, body, self._responses_prompts, request.state.body_bytes)
        streams = self._start(prepared)
        shell = ResponseShell.of(body, prepared.params[0], self.model_name)
        formatter = LogprobsFormatter(self.engine.tokenizer)
        tools = prepared.tools if prepared.tools is not None and prepared.tools.offered else None
        if body.stream:
            events = ResponseEvents(shell, formatter, tools.stream() if tools is not None else None)
            return self._event_stream(streams, events, request)
        outputs = await self._results(streams, request)
        if outputs is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        (output,) = outputs
        if tools is None:
            return JSONResponse(shell.final(output, new_id("msg"), text_logprobs(formatter, output.logprobs)))
        # The message is the text around the calls; its tokens' logprobs would not line up with it.
        reply = tools.parse(output.text)
        calls = [call.as_openai() for call in reply.calls]
        return JSONResponse(shell.final(output, new_id("msg"), None, calls, text=reply.content or ""))

    def _prepare_now(
        self,
        body: Body,
        encode: Callable[[Body, ToolPlan | None], tuple[list[list[int]], str]],
        body_bytes: int,
    ) -> Prepared[Body]:
        """On the worker thread: check, tokenize, bound max_tokens, one SamplingParams per choice."""
        try:
            self._check(body)
            tools = self._tool_plan(body)
            prompts, prompt_field = encode(body, tools)
            field, requested = body.requested_max_tokens()
            # OpenAI's completions default (16); chat completions default to the room left.
            default = self.config.completions_max_tokens if isinstance(body, CompletionRequest) else None
            bound = TokenBound(self.engine.max_context, self.engine.max_request_tokens, self.config.clamp_max_tokens)
            ids, params = [], []
            for prompt_ids in prompts:
                max_new_tokens = bound.max_new_tokens(
                    len(prompt_ids), requested, field=field, prompt_field=prompt_field, default=default
                )
                base = body.to_sampling_params(self.engine.config.sampling, max_new_tokens)
                if tools is not None:
                    base = base.replace(structured=tools.with_constraint(base.structured))
                if base.structured is not None:
                    self.engine.prepare_grammar(base.structured)  # compiled here, not on the event loop
                for i in range(body.n):
                    ids.append(prompt_ids)
                    params.append(_choice_params(base, i))
            return Prepared(body, ids, params, tools)
        except InvalidRequestError as error:
            raise from_invalid_request(error) from None
        finally:
            _trim_after(body_bytes)

    def _check(self, body: Body) -> None:
        if body.model != self.model_name:
            raise model_not_found(body.model, self.model_name)
        if body.n > self.config.max_n:
            raise bad_request(f"n: at most {self.config.max_n} choices per prompt (server.max_n), got {body.n}", param="n")

    def _tool_plan(self, body: Body) -> ToolPlan | None:
        """A chat or Responses request's tools, checked: each function's parameters compiled (a bad
        schema is a 400 naming tools[i].function.parameters, or tools[i].parameters), the grammars
        cached for the engine."""
        if isinstance(body, ChatCompletionRequest):
            plan = ToolPlan.of(body, self.tool_prompt.format)
        elif isinstance(body, ResponsesRequest):
            plan = tool_plan(body, self.tool_prompt.format)
        else:
            return None
        for spec in plan.parameter_specs() if plan is not None else ():
            self.engine.prepare_grammar(spec)
        return plan

    def _completion_prompts(self, body: CompletionRequest, tools: None = None) -> tuple[list[list[int]], str]:
        prompts = body.prompts()
        limit = self.config.max_prompts_per_request
        if len(prompts) > limit:
            raise bad_request(
                f"prompt: at most {limit} prompts per request (server.max_prompts_per_request), got {len(prompts)}",
                param="prompt",
            )
        labels = ["prompt"] if len(prompts) == 1 else [f"prompt[{i}]" for i in range(len(prompts))]
        encode = self.engine.prompt_encoder.encode
        return [encode(p, chat=False, label=label) for p, label in zip(prompts, labels)], "prompt"

    def _chat_prompts(self, body: ChatCompletionRequest, tools: ToolPlan | None) -> tuple[list[list[int]], str]:
        messages, definitions = self.tool_prompt.render(body.chat_messages(), tools)
        return [self.engine.encode_chat(messages, tools=definitions)], "messages"

    def _responses_prompts(self, body: ResponsesRequest, tools: ToolPlan | None) -> tuple[list[list[int]], str]:
        messages, definitions = self.tool_prompt.render(chat_messages(body), tools)
        try:
            return [self.engine.prompt_encoder.encode_chat(messages, label="input", tools=definitions)], "input"
        except InvalidRequestError as error:
            raise InvalidRequestError(str(error), param="input") from None  # the encoder names "prompt"

    def _start(self, prepared: Prepared) -> list[AsyncRequestStream]:
        """On the loop: the queue limit, then the engine (astream must run on the consuming loop)."""
        self._admit(len(prepared.params))
        try:
            return self.engine.astream_batch(prepared.prompt_ids, prepared.params)
        except InvalidRequestError as error:
            raise from_invalid_request(error) from None
        except EngineClosedError as error:
            raise APIError(503, str(error), type="server_error", code="engine_closed") from None

    def _admit(self, count: int) -> None:
        """Requests beyond the running capacity queue; past the queue limit they get a 503."""
        capacity = self.engine.config.scheduler.max_running_requests
        if count > capacity + self.config.max_queued_requests:
            raise bad_request(
                f"n: this request needs {count} engine requests (prompts x n); this server runs {capacity} and "
                f"queues {self.config.max_queued_requests} (server.max_queued_requests) at most",
                param="n",
            )
        queued = self.engine.num_unfinished() - capacity
        if queued + count > self.config.max_queued_requests:
            raise APIError(
                503, f"server is at capacity: {capacity} requests running and {max(queued, 0)} queued "
                f"(server.max_queued_requests={self.config.max_queued_requests}); this request needs {count}; retry later",
                type="server_error", code="queue_full",
                headers={"Retry-After": str(self.config.queue_full_retry_after_s)},
            )

    async def _results(self, streams: list[AsyncRequestStream], request: Request) -> list[RequestOutput] | None:
        """Every choice's output, or None when the client disconnected first (all are aborted)."""
        try:
            outputs = await fanout.results(streams, request)
        except RequestFailedError as error:
            raise APIError(500, str(error), type="server_error") from error
        if outputs is None:
            _log.info("client %s went away; aborted request %s", client_address(request), _ids(streams))
            return None
        for output in outputs:
            self.metrics.observe(output)
        return outputs

    def _sse(
        self,
        streams: list[AsyncRequestStream],
        prepared: Prepared,
        opening: list[dict],
        chunks: Callable[[int, RequestDelta], list[dict]],
        header: ResponseHeader,
        object_name: str,
        request: Request,
    ) -> StreamingResponse:
        n, body = prepared.n, prepared.body
        # continuous_usage_stats: completion tokens per choice so far (a stop token counts at the end).
        completion_tokens = [0] * len(streams) if body.continuous_usage else None

        def with_usage(index: int, chunk: dict) -> dict:
            if completion_tokens is None:
                return chunk
            prompt_tokens = len(prepared.prompt_ids[index])
            used = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens[index]}
            return chunk | {"usage": used | {"total_tokens": prompt_tokens + completion_tokens[index]}}

        async def events() -> AsyncIterator[str]:
            outputs: list[RequestOutput | None] = [None] * len(streams)
            try:
                for chunk in opening:
                    yield sse(chunk)
                async with contextlib.aclosing(self._relay(streams, request)) as deltas:
                    async for index, delta in deltas:
                        if completion_tokens is not None and delta.finished:
                            completion_tokens[index] = delta.output.completion_tokens
                        elif completion_tokens is not None:
                            completion_tokens[index] += len(delta.token_ids)
                        for chunk in chunks(index, delta):
                            yield sse(with_usage(index, chunk))
                        if delta.finished:
                            outputs[index] = delta.output
                if body.include_usage:
                    yield sse(header.usage_chunk(usage(outputs, n), object_name))
            except RequestFailedError as error:
                yield sse({"error": {"message": str(error), "type": "server_error", "param": None, "code": None}})
            yield sse("[DONE]")

        return StreamingResponse(events(), media_type="text/event-stream", headers=_SSE_HEADERS)

    def _event_stream(
        self, streams: list[AsyncRequestStream], events: ResponseEvents, request: Request
    ) -> StreamingResponse:
        """A Responses API stream: named events, its last one the whole response."""

        async def sent() -> AsyncIterator[str]:
            for event in events.opening():
                yield sse_event(event)
            try:
                async with contextlib.aclosing(self._relay(streams, request)) as deltas:
                    async for _, delta in deltas:
                        for event in events.delta(delta):
                            yield sse_event(event)
            except RequestFailedError as error:
                for event in events.failed(str(error)):
                    yield sse_event(event)

        return StreamingResponse(sent(), media_type="text/event-stream", headers=_SSE_HEADERS)

    async def _relay(
        self, streams: list[AsyncRequestStream], request: Request
    ) -> AsyncIterator[tuple[int, RequestDelta]]:
        """(choice index, delta) of every stream as they come, each finished choice counted in the
        metrics.  Closed before the end (the client went away mid-stream, or the server is
        stopping), it aborts what is unfinished, with one INFO line; a failed request raises its
        RequestFailedError, its siblings aborted with it (fanout.merged)."""
        failed = False
        try:
            async with contextlib.aclosing(fanout.merged(streams)) as deltas:
                async for index, delta in deltas:
                    yield index, delta
                    if delta.finished:  # counted once its last chunk is sent
                        self.metrics.observe(delta.output)
        except RequestFailedError:
            failed = True
            raise
        finally:
            gone = [s for s in streams if not s.finished]
            if gone and not failed:
                _log.info("client %s went away mid-stream; aborted request %s", client_address(request), _ids(gone))
                fanout.cancel_unfinished(gone)


def _trim_after(body_bytes: int) -> None:
    if body_bytes >= _TRIM_AFTER_BYTES:
        give_back_free_heap()


def _choice_params(base: SamplingParams, i: int) -> SamplingParams:
    """Choice i of a prompt: seeded with seed + i when a seed is given (choice 0 keeps the seed)."""
    if base.seed is None or i == 0:
        return base
    return base.replace(seed=(base.seed + i) % _SEED_MODULUS)


def _ids(streams: Sequence[AsyncRequestStream]) -> str:
    return ", ".join(s.request_id for s in streams)
