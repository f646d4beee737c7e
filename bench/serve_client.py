"""Sending the serve suite's requests and timing each one as a client sees it.

Boundary: HTTP only (httpx, asyncio).  `send_all` dispatches the requests at their arrival times
(all at once for rate inf, else gaps drawn from a gamma distribution: Poisson at burstiness 1, as
vLLM's `bench serve`), at most `max_concurrency` in flight, and returns one `RequestRecord` per
request: success or the error's text, time to the first streamed token, the arrival time of every
later chunk, and the token counts the server reported in `usage`.  Nothing here interprets the
numbers (bench/serve_report.py does).  `sse_events` is the one reader of a streamed answer's
server-sent events (bench/overload.py reads through it too).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Sequence

import httpx
import numpy as np

from bench.serve_datasets import BenchRequest

_ERROR_CHARS = 500  # of an error body kept in the record


@dataclass(frozen=True)
class SendOptions:
    """How requests are sent (bench.* of the suite)."""

    model: str
    stream: bool = True
    ignore_eos: bool = True
    temperature: float = 0.0
    request_timeout_s: float = 600.0
    extra_body: dict = field(default_factory=dict)  # merged into every body (server-specific fields)


@dataclass
class RequestRecord:
    """One request as the client saw it; times in seconds from the run's start."""

    index: int
    expected_prompt_tokens: int
    max_tokens: int
    scheduled_s: float = 0.0  # its arrival time in the schedule
    sent_s: float | None = None  # when it was sent (later than scheduled when max_concurrency waits)
    ttft_s: float | None = None  # sent → first chunk with text (streaming only)
    latency_s: float | None = None  # sent → the end of the answer
    chunk_s: list[float] = field(default_factory=list)  # arrival of each chunk with text, from sent
    prompt_tokens: int | None = None  # usage.prompt_tokens
    output_tokens: int | None = None  # usage.completion_tokens
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, where reported
    output_chars: int = 0
    finish_reason: str | None = None
    replica: str | None = None  # x-graphexec-replica: which replica a data-parallel front chose
    success: bool = False
    error: str | None = None


def arrival_times(count: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Seconds from the start at which each request is due: 0 for all at rate inf; else the
    cumulative sum of gamma(shape=burstiness, mean 1/rate) gaps (exponential, i.e. Poisson, at 1)."""
    if math.isinf(rate):
        return [0.0] * count
    if rate <= 0:
        raise ValueError(f"bench.request_rates has {rate}; a rate must be > 0 (or inf)")
    if burstiness <= 0:
        raise ValueError(f"bench.burstiness={burstiness} must be > 0")
    gaps = np.random.default_rng(seed).gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=count)
    gaps[0] = 0.0  # the first request starts the run
    return np.cumsum(gaps).tolist()


def request_body(req: BenchRequest, opts: SendOptions) -> dict[str, Any]:
    body: dict[str, Any] = {"model": opts.model, "max_tokens": req.output_tokens, "temperature": opts.temperature,
                            "stream": opts.stream}
    if opts.ignore_eos:
        body["ignore_eos"] = True
    if opts.stream:
        body["stream_options"] = {"include_usage": True}
    if req.endpoint == "chat":
        body["messages"] = req.messages
    else:
        body["prompt"] = req.prompt
    return body | opts.extra_body


def endpoint_url(base: str, req: BenchRequest) -> str:
    return f"{base}/v1/chat/completions" if req.endpoint == "chat" else f"{base}/v1/completions"


async def send_one(client: httpx.AsyncClient, base: str, req: BenchRequest, opts: SendOptions,
                   record: RequestRecord, t0: float) -> None:
    """Send one request, filling `record`; a failure is recorded with its text, never raised."""
    sent = time.perf_counter()
    record.sent_s = sent - t0
    try:
        await asyncio.wait_for(_exchange(client, endpoint_url(base, req), request_body(req, opts), record, sent),
                               opts.request_timeout_s)
    except asyncio.TimeoutError:
        record.error = f"no complete answer within bench.request_timeout_s={opts.request_timeout_s:g}"
    except (httpx.HTTPError, OSError) as error:
        record.error = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
    except ValueError as error:  # a body or event that is not the JSON it should be
        record.error = f"bad response: {error}"
    record.latency_s = time.perf_counter() - sent
    if record.error is None and record.output_tokens is None:
        record.error = "the answer has no usage.completion_tokens"
    record.success = record.error is None


async def _exchange(client: httpx.AsyncClient, url: str, body: dict, record: RequestRecord, sent: float) -> None:
    async with client.stream("POST", url, json=body) as response:
        record.replica = response.headers.get("x-graphexec-replica")
        if response.status_code != 200:
            text = (await response.aread()).decode(errors="replace")
            record.error = f"HTTP {response.status_code}: {text[:_ERROR_CHARS]}"
            return
        if body["stream"]:
            await _read_events(response, record, sent)
        else:
            answer = json.loads(await response.aread())
            choice = (answer.get("choices") or [{}])[0]
            text = choice.get("text") if "text" in choice else (choice.get("message") or {}).get("content")
            record.output_chars = len(text or "")
            record.finish_reason = choice.get("finish_reason")
            _usage(record, answer.get("usage"))


async def sse_events(response: httpx.Response) -> AsyncIterator[dict[str, Any]]:
    """The JSON events of a server-sent-event stream, up to `data: [DONE]`."""
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        yield json.loads(data)


async def _read_events(response: httpx.Response, record: RequestRecord, sent: float) -> None:
    """Server-sent events: a chunk with text is a token arrival; the usage chunk gives the counts."""
    async for event in sse_events(response):
        if "error" in event:
            record.error = f"error event: {json.dumps(event['error'])[:_ERROR_CHARS]}"
            return
        now = time.perf_counter() - sent
        for choice in event.get("choices") or []:
            text = choice.get("text") if "text" in choice else (choice.get("delta") or {}).get("content")
            if text:
                record.chunk_s.append(now)
                record.output_chars += len(text)
                if record.ttft_s is None:
                    record.ttft_s = now
            if choice.get("finish_reason"):
                record.finish_reason = choice["finish_reason"]
        _usage(record, event.get("usage"))


def _usage(record: RequestRecord, usage: dict | None) -> None:
    if not usage:
        return
    record.prompt_tokens = usage.get("prompt_tokens")
    record.output_tokens = usage.get("completion_tokens")
    details = usage.get("prompt_tokens_details") or {}
    record.cached_tokens = details.get("cached_tokens")


async def send_all(base: str, requests: Sequence[BenchRequest], opts: SendOptions, schedule: Sequence[float],
                   max_concurrency: int | None) -> tuple[list[RequestRecord], float]:
    """Every request at its scheduled time (at most max_concurrency at once); records and wall seconds."""
    records = [RequestRecord(r.index, r.prompt_tokens, r.output_tokens, s) for r, s in zip(requests, schedule)]
    gate = asyncio.Semaphore(max_concurrency) if max_concurrency else contextlib.nullcontext()
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(opts.request_timeout_s, connect=30.0)
    async with httpx.AsyncClient(trust_env=False, timeout=timeout, limits=limits) as client:
        t0 = time.perf_counter()

        async def one(req: BenchRequest, record: RequestRecord) -> None:
            await asyncio.sleep(max(0.0, t0 + record.scheduled_s - time.perf_counter()))
            async with gate:
                await send_one(client, base, req, opts, record, t0)

        await asyncio.gather(*(one(r, rec) for r, rec in zip(requests, records)))
        wall = time.perf_counter() - t0
    return records, wall
