"""The serving benchmarks' one HTTP/SSE client (the serve suite's requests, overload's ordinary ones).

Boundary: HTTP only (httpx, asyncio); nothing here interprets the numbers (bench/serve_report.py
does).  `exchange` is one request, streamed or not, into a `RequestRecord`; `send_all` sends a
request set on its arrival schedule (`arrival_times`), at most `max_concurrency` in flight.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import httpx
import numpy as np

from bench.serve_datasets import BenchRequest

_ERROR_CHARS = 500  # of an error body kept in the record


@dataclass
class RequestRecord:
    """One request as the client saw it; times in seconds from the run's start."""

    index: int = 0
    expected_prompt_tokens: int = 0
    max_tokens: int = 0
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
    status: int | None = None  # the HTTP status (None: no answer)


def http_client(timeout: httpx.Timeout | float | None) -> httpx.AsyncClient:
    """No proxy from the environment and no connection limit: every request may be in flight at once."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    return httpx.AsyncClient(trust_env=False, timeout=timeout, limits=limits)


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


def request_body(req: BenchRequest, opts: Mapping[str, Any]) -> dict[str, Any]:
    """`opts`: the suite's bench.* (stream, ignore_eos, temperature, extra_body) and the `model` to name."""
    body = {"model": opts["model"], "max_tokens": req.output_tokens, "temperature": opts["temperature"],
            "stream": opts["stream"], **({"ignore_eos": True} if opts["ignore_eos"] else {}),
            **({"stream_options": {"include_usage": True}} if opts["stream"] else {}),
            **({"messages": req.messages} if req.endpoint == "chat" else {"prompt": req.prompt})}
    return body | opts["extra_body"]


async def exchange(client: httpx.AsyncClient, url: str, body: dict | bytes, record: RequestRecord,
                   timeout_s: float) -> Exception | None:
    """POST `body` (a dict as JSON, read as server-sent events when body["stream"]; bytes as they are)
    into `record`.  Returns, never raises, what ended it early: TimeoutError, a transport error, bad JSON."""
    sent = time.perf_counter()
    try:
        await asyncio.wait_for(_exchange(client, url, body, record, sent), timeout_s)
    except (asyncio.TimeoutError, httpx.HTTPError, OSError, ValueError) as error:
        return error
    finally:
        record.latency_s = time.perf_counter() - sent
    return None


async def _exchange(client: httpx.AsyncClient, url: str, body: dict | bytes, record: RequestRecord,
                    sent: float) -> None:
    data = ({"json": body} if isinstance(body, dict)
            else {"content": body, "headers": {"Content-Type": "application/json"}})
    async with client.stream("POST", url, **data) as response:
        record.status = response.status_code
        record.replica = response.headers.get("x-graphexec-replica")
        if response.status_code != 200:
            text = (await response.aread()).decode(errors="replace")
            record.error = f"HTTP {response.status_code}: {text[:_ERROR_CHARS]}"
        elif isinstance(body, dict) and body.get("stream"):
            await _read_events(response, record, sent)
        else:
            answer = json.loads(await response.aread())
            choice = (answer.get("choices") or [{}])[0]
            record.output_chars = len(_text(choice, "message") or "")
            record.finish_reason = choice.get("finish_reason")
            _usage(record, answer.get("usage"))


async def _read_events(response: httpx.Response, record: RequestRecord, sent: float) -> None:
    """Server-sent events up to `data: [DONE]`: a chunk with text is a token arrival; the usage
    chunk gives the counts."""
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue
        if (data := line[5:].strip()) == "[DONE]":
            return
        event = json.loads(data)
        if "error" in event:
            record.error = f"error event: {json.dumps(event['error'])[:_ERROR_CHARS]}"
            return
        now = time.perf_counter() - sent
        for choice in event.get("choices") or []:
            if text := _text(choice, "delta"):
                record.chunk_s.append(now)
                record.output_chars += len(text)
                if record.ttft_s is None:
                    record.ttft_s = now
            record.finish_reason = choice.get("finish_reason") or record.finish_reason
        _usage(record, event.get("usage"))


def _text(choice: dict, message_key: str) -> str | None:
    """A choice's text: `text` for /v1/completions, `<message_key>.content` for chat."""
    return choice.get("text") if "text" in choice else (choice.get(message_key) or {}).get("content")


def _usage(record: RequestRecord, usage: dict | None) -> None:
    if usage:
        record.prompt_tokens = usage.get("prompt_tokens")
        record.output_tokens = usage.get("completion_tokens")
        record.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")


async def send_one(client: httpx.AsyncClient, base: str, req: BenchRequest, opts: Mapping[str, Any],
                   record: RequestRecord, t0: float) -> None:
    """Send one request, filling `record`; a failure is recorded with its text, never raised."""
    record.sent_s = time.perf_counter() - t0
    url = f"{base}/v1/chat/completions" if req.endpoint == "chat" else f"{base}/v1/completions"
    error = await exchange(client, url, request_body(req, opts), record, opts["request_timeout_s"])
    if isinstance(error, asyncio.TimeoutError):
        record.error = f"no complete answer within bench.request_timeout_s={opts['request_timeout_s']:g}"
    elif isinstance(error, ValueError):  # a body or event that is not the JSON it should be
        record.error = f"bad response: {error}"
    elif error is not None:
        record.error = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
    elif record.error is None and record.output_tokens is None:
        record.error = "the answer has no usage.completion_tokens"
    record.success = record.error is None


async def send_all(base: str, requests: Sequence[BenchRequest], opts: Mapping[str, Any], schedule: Sequence[float],
                   max_concurrency: int | None) -> tuple[list[RequestRecord], float]:
    """Every request at its scheduled time (at most max_concurrency at once); records and wall seconds.
    `opts` as `request_body`'s, with request_timeout_s."""
    records = [RequestRecord(r.index, r.prompt_tokens, r.output_tokens, s) for r, s in zip(requests, schedule)]
    gate = asyncio.Semaphore(max_concurrency) if max_concurrency else contextlib.nullcontext()
    async with http_client(httpx.Timeout(opts["request_timeout_s"], connect=30.0)) as client:
        t0 = time.perf_counter()

        async def one(req: BenchRequest, record: RequestRecord) -> None:
            await asyncio.sleep(max(0.0, t0 + record.scheduled_s - time.perf_counter()))
            async with gate:
                await send_one(client, base, req, opts, record, t0)

        await asyncio.gather(*(one(r, rec) for r, rec in zip(requests, records)))
        return records, time.perf_counter() - t0


def served_model(url: str, configured: str | None, fallback: str) -> tuple[str, str]:
    """The `model` field requests carry: `configured`, else the server's first /v1/models entry,
    else `fallback` (and why the listing failed)."""
    if configured:
        return configured, "bench.model"
    try:
        with httpx.Client(trust_env=False, timeout=10) as http:
            return http.get(f"{url}/v1/models").raise_for_status().json()["data"][0]["id"], "/v1/models"
    except (httpx.HTTPError, ValueError, KeyError, IndexError) as error:
        return fallback, f"model.name (/v1/models failed: {type(error).__name__}: {error})"


def server_metrics(url: str) -> dict[str, Any] | None:
    """graphexec-serve's JSON snapshot (/metrics/json; /metrics on servers from before Prometheus),
    or None from a server without either."""
    with contextlib.suppress(httpx.HTTPError, ValueError), httpx.Client(trust_env=False, timeout=10) as http:
        for path in ("/metrics/json", "/metrics"):
            response = http.get(f"{url}{path}")
            if response.status_code == 200 and response.headers.get("content-type", "").startswith("application/json"):
                metrics = response.json()
                return metrics if isinstance(metrics, dict) else None
    return None


def flush_prefix_cache(url: str) -> str:
    """Empty graphexec-serve's prefix cache so a rate does not reuse the previous rate's prompts;
    other servers answer 404 (recorded, not an error)."""
    try:
        with httpx.Client(trust_env=False, timeout=30) as http:
            response = http.post(f"{url}/flush_cache")
        return "flushed" if response.status_code == 200 else f"HTTP {response.status_code}"
    except httpx.HTTPError as error:
        return type(error).__name__
