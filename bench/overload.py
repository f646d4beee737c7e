"""graphexec-serve under overload and hostile clients (issue 13), as a client sees it, before/after.

    graphexec-bench overload --url http://127.0.0.1:8000 --pid <server pid> [--scenario NAME ...] [--json PATH]

Boundary: HTTP through bench/serve_client.py (raw TCP for the clients no HTTP library imitates)
to a server someone else started, and its RSS through psutil; no torch.  Whatever any server, old
or new, answers is recorded, never asserted; what it would run or hold forever is cut at the
scenario's deadline or the end of the run.  The scenarios and their numbers: bench/README.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable
from urllib.parse import urlsplit

import httpx

from bench.report import Report, Table
from bench.serve_client import RequestRecord, exchange, http_client, served_model, server_metrics
from bench.stats import nearest_rank_ms as percentiles
from bench.tables import machine_line

SCENARIOS = ("fairness", "big-body", "health", "load")
HOSTILE = ("huge", "oversized-body", "drop-mid-body", "stalled-headers")
HELD = ("huge", "stalled-headers")  # what an attacker keeps open: run on until the server or the run ends them
_MIN_HOLD_S = 5.0  # a held request sent just before the end of a run still gets this long for its answer
MB = 1_000_000
PROMPTS = ("The capital of France is", "Write a short poem about the sea.", "List three uses of a paperclip:",
           "Explain what a KV cache is in one sentence.", "Once upon a time, in a small village,",
           "The three primary colors are", "Translate 'good morning' into Spanish:", "A haiku about autumn leaves:")


async def post(client: httpx.AsyncClient, url: str, body: dict | bytes, deadline_s: float) -> RequestRecord:
    """POST a completion (streamed when the body asks) and read it until its end or `deadline_s`.
    `error` is "deadline" or an exception's class name; `success`, a 200 whose whole answer arrived."""
    record = RequestRecord()
    error = await exchange(client, f"{url}/v1/completions", body, record, deadline_s)
    record.error = error and ("deadline" if isinstance(error, asyncio.TimeoutError) else type(error).__name__)
    record.success = error is None and record.status == 200
    return record


def label(record: RequestRecord) -> str:
    """How the outcome tables count a request: its status (None: no answer), and what ended it early."""
    return f"{record.status or ''} {record.error}".strip() if record.error else str(record.status)


def normal_body(model: str, index: int, max_tokens: int) -> dict:
    return {"model": model, "prompt": f"{index}: {PROMPTS[index % len(PROMPTS)]}", "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True}


def prompt_body(model: str, megabytes: float) -> bytes:
    """A completion body whose prompt is `megabytes` of plain words (what a tokenizer chews on)."""
    words = "the quick brown fox jumps over the lazy dog and keeps running "
    text = (words * (int(megabytes * MB) // len(words) + 1))[: int(megabytes * MB)]
    return json.dumps({"model": model, "prompt": text, "max_tokens": 1}).encode()


def _normal(records: list[RequestRecord]) -> dict:
    return {"normal_ttft": percentiles([r.ttft_s for r in records if r.ttft_s is not None]),
            "normal_latency": percentiles([r.latency_s for r in records if r.success])}


@contextlib.asynccontextmanager
async def sampling(interval_s: float, read: Callable[..., Any], *args: Any):
    """`read(*args)`, in a thread (it may block), every `interval_s` while the block runs: the
    readings, in a list that grows with them."""
    readings: list = []

    async def loop() -> None:
        while True:
            readings.append(await asyncio.to_thread(read, *args))
            await asyncio.sleep(interval_s)

    task = asyncio.create_task(loop())
    try:
        yield readings
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


@contextlib.asynccontextmanager
async def rss_watch(pid: int | None, interval_s: float, settle_s: float):
    """The server's RSS (psutil; None without a pid) before the block, at its peak during it and
    `settle_s` after it (time to return what it freed), in MiB, into the dict yielded."""
    import psutil

    process = None if pid is None else psutil.Process(pid)

    def read() -> int | None:
        return None if process is None else process.memory_info().rss

    fields, before = {}, read()
    async with sampling(interval_s, read) as readings:
        yield fields
    await asyncio.sleep(settle_s)
    peak = max((r for r in (before, *readings) if r is not None), default=None)
    fields |= {f"rss_{name}_mb": None if rss is None else round(rss / 2**20, 1)
               for name, rss in (("before", before), ("peak", peak), ("after", read()))}


def _queue(snapshots: list[dict | None]) -> dict:
    """The running batch and the waiting queue over the /metrics snapshots that answered."""
    running = [m.get("running", -1) for m in snapshots if m]
    if not running:
        return {}
    return {"running_min": min(running), "running_mean": round(statistics.mean(running), 1),
            "waiting_max": max(m.get("waiting", -1) for m in snapshots if m), "samples": len(running)}


async def fairness(client: httpx.AsyncClient, args: argparse.Namespace) -> dict:
    """2 huge streams get a head start, then 30 normal ones; huge ones are cancelled at the deadline."""
    huge = [asyncio.create_task(post(client, args.url, normal_body(args.model, i, args.huge_max_tokens),
                                     args.deadline_s + args.head_start_s)) for i in range(args.huge)]
    await asyncio.sleep(args.head_start_s)  # as in issue 13: the huge ones hold the KV first
    async with sampling(0.5, server_metrics, args.url) as snapshots:
        normal = await asyncio.gather(*(post(client, args.url, normal_body(args.model, i, args.max_tokens),
                                             args.deadline_s) for i in range(args.normal)))
    return {"huge_outcomes": dict(Counter(map(label, await asyncio.gather(*huge)))),
            "normal_finished": sum(r.success for r in normal), "normal_total": len(normal), **_normal(normal),
            "normal_outcomes": dict(Counter(map(label, normal))), "metrics": _queue(snapshots)}


async def big_body(client: httpx.AsyncClient, args: argparse.Namespace) -> dict:
    """One body with a prompt of `--big-body-mb` MB; the server's RSS before, at peak and after."""
    content = prompt_body(args.model, args.big_body_mb)
    async with rss_watch(args.pid, 0.1, args.settle_s) as rss:
        answer = await post(client, args.url, content, args.big_body_timeout_s)
    return {"body_bytes": len(content), "status": label(answer), "seconds": round(answer.latency_s, 2), **rss}


async def health(client: httpx.AsyncClient, args: argparse.Namespace) -> dict:
    """/health every `--health-interval-s` while a `--health-prompt-mb` MB prompt is in flight."""
    content = prompt_body(args.model, args.health_prompt_mb)
    latencies, errors = [], Counter()
    async with rss_watch(args.pid, args.health_interval_s, args.settle_s) as rss:
        big = asyncio.create_task(post(client, args.url, content, args.big_body_timeout_s))
        while not big.done():
            start = time.perf_counter()
            try:
                await client.get(f"{args.url}/health", timeout=args.big_body_timeout_s)
                latencies.append(time.perf_counter() - start)
            except httpx.HTTPError as error:
                errors[type(error).__name__] += 1
            await asyncio.sleep(args.health_interval_s)
    return {"prompt_bytes": len(content), "prompt_status": label(big.result()),
            "prompt_seconds": round(big.result().latency_s, 2),
            "health": percentiles(latencies), "health_errors": dict(errors), **rss}


async def load(client: httpx.AsyncClient, args: argparse.Namespace) -> dict:
    """`--users` users for `--duration-s`, `--hostile-fraction` of their requests hostile."""
    sent: dict[str, list[RequestRecord]] = {kind: [] for kind in ("normal", *HOSTILE)}
    held: list[tuple[str, asyncio.Task]] = []
    oversized = prompt_body(args.model, args.oversize_mb)  # built once, sent by every such request
    end = time.monotonic() + args.duration_s

    async def user(seed: int) -> None:  # a request, a think time, again, until the end of the run
        rng, index = random.Random(seed), seed * 100_000
        while time.monotonic() < end:
            index += 1
            kind = "normal" if rng.random() >= args.hostile_fraction else rng.choice(HOSTILE)
            hold_s = max(end - time.monotonic(), _MIN_HOLD_S)
            if kind == "normal":
                body = normal_body(args.model, index, rng.randint(args.max_tokens // 2, args.max_tokens * 2))
                request = post(client, args.url, body, args.request_timeout_s)
            elif kind == "huge":
                request = post(client, args.url, normal_body(args.model, index, args.huge_max_tokens), hold_s)
            elif kind == "oversized-body":
                request = post(client, args.url, oversized, args.request_timeout_s * 4)
            else:
                request = raw_client(kind, args.url, args.model, hold_s)
            if kind in HELD:
                held.append((kind, asyncio.create_task(request)))
            else:
                sent[kind].append(await request)
            await asyncio.sleep(rng.uniform(0, args.think_s))

    async with sampling(1.0, server_metrics, args.url) as snapshots:
        await asyncio.gather(*map(user, range(args.users)))
        for kind, task in held:
            sent[kind].append(await task)
    return {"users": args.users, "duration_s": args.duration_s,
            "requests": {kind: len(records) for kind, records in sent.items() if records},
            "outcomes": {kind: dict(Counter(map(label, records))) for kind, records in sent.items()},
            "normal_per_s": round(sum(r.success for r in sent["normal"]) / args.duration_s, 2),
            **_normal(sent["normal"]), "metrics": _queue(snapshots)}


async def raw_client(kind: str, url: str, model: str, hold_s: float) -> RequestRecord:
    """What no HTTP library sends.  drop-mid-body: headers announcing a body, half of it, then the
    connection closes.  stalled-headers: half the headers, then nothing, held until the server
    closes it or `hold_s`."""
    record, start, writer = RequestRecord(), time.perf_counter(), None
    body = json.dumps({"model": model, "prompt": "never finished " * 100, "max_tokens": 8}).encode()
    head = f"POST /v1/completions HTTP/1.1\r\nHost: {urlsplit(url).netloc}\r\nContent-Type: application/json\r\n"
    sent = (f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body[: len(body) // 2] if kind == "drop-mid-body"
            else f"{head}Content-Length: 10\r\n\r\n".encode()[:-20])
    try:
        reader, writer = await asyncio.open_connection(urlsplit(url).hostname, urlsplit(url).port or 80)
        writer.write(sent)
        await writer.drain()
        if kind == "drop-mid-body":
            await asyncio.sleep(0.05)
            record.error = "dropped"
        else:
            answer = await asyncio.wait_for(reader.read(200), hold_s)
            record.status = int(answer.split()[1]) if answer.startswith(b"HTTP/") else None
            record.error = "closed by server"
    except asyncio.TimeoutError:
        record.error = "still open at end"
    except OSError as error:
        record.error = type(error).__name__
    finally:
        if writer is not None:
            writer.close()
    record.latency_s = time.perf_counter() - start
    return record


def markdown(results: dict) -> str:
    """The report: a table for each scenario that ran, in the order of SCENARIOS."""
    a = results["args"]
    blocks = [f"## graphexec-serve overload: {results['url']} (model {results['model']})",
              machine_line(torch_facts=False)]
    if r := results.get("fairness"):
        blocks.append(Table(
            ["normal finished", "TTFT p50 ms", "TTFT p99 ms", "latency p50 ms", "latency p99 ms", "huge outcomes",
             "running min/mean"],
            [[f"{r['normal_finished']}/{r['normal_total']}", *_ms(r["normal_ttft"], "p50", "p99"),
              *_ms(r["normal_latency"], "p50", "p99"), r["huge_outcomes"], _running(r["metrics"])]],
            f"fairness: {a['huge']} huge (max_tokens={a['huge_max_tokens']}) + {r['normal_total']} normal "
            f"(max_tokens={a['max_tokens']}), deadline {a['deadline_s']} s"))
    if r := results.get("big-body"):
        blocks.append(Table(["status", "seconds", "server RSS before MiB", "peak MiB", "after MiB"],
                            [[r["status"], r["seconds"], r["rss_before_mb"], r["rss_peak_mb"], r["rss_after_mb"]]],
                            f"big body: {r['body_bytes'] / MB:.0f} MB JSON prompt"))
    if r := results.get("health"):
        blocks.append(Table(
            ["prompt status", "prompt seconds", "/health n", "p50 ms", "p99 ms", "max ms", "errors",
             "server RSS before/peak/after MiB"],
            [[r["prompt_status"], r["prompt_seconds"], r["health"]["n"], *_ms(r["health"], "p50", "p99", "max"),
              r["health_errors"] or None, f"{r['rss_before_mb']}/{r['rss_peak_mb']}/{r['rss_after_mb']}"]],
            f"/health while a {r['prompt_bytes'] / MB:.0f} MB prompt is in flight"))
    if r := results.get("load"):
        blocks.append(Table(
            ["request type", "sent", "outcomes (status or exception: count)"],
            [[kind, r["requests"].get(kind, 0), ", ".join(f"{k}: {v}" for k, v in sorted(counts.items())) or None]
             for kind, counts in r["outcomes"].items()],
            f"load: {r['users']} users, {r['duration_s']} s, {a['hostile_fraction']:.0%} hostile"))
        blocks.append(Table(
            ["normal finished/s", "TTFT p50 ms", "p90 ms", "p99 ms", "latency p50 ms", "p99 ms", "running min/mean",
             "waiting max"],
            [[r["normal_per_s"], *_ms(r["normal_ttft"], "p50", "p90", "p99"), *_ms(r["normal_latency"], "p50", "p99"),
              _running(r["metrics"]), r["metrics"].get("waiting_max")]]))
    return Report(blocks).markdown()


def _ms(percentiles_ms: dict, *names: str) -> list:
    return [percentiles_ms.get(f"{name}_ms") for name in names]


def _running(metrics: dict) -> str:
    return f"{metrics.get('running_min')}/{metrics.get('running_mean')}"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--url", default="http://127.0.0.1:8000", help="the running graphexec-serve")
    add("--pid", type=int, help="the server's process id, for its RSS (big-body)")
    add("--model", help="model name for the requests (default: the server's /v1/models)")
    add("--scenario", action="append", choices=SCENARIOS, help="run only these (repeatable; default: all)")
    add("--json", help="also write the results here")
    add("--max-tokens", type=int, default=32, help="normal requests' max_tokens (load: between half and twice it)")
    add("--huge-max-tokens", type=int, default=1_000_000_000)
    add("--huge", type=int, default=2, help="fairness: huge requests")
    add("--normal", type=int, default=30, help="fairness: normal requests")
    add("--head-start-s", type=float, default=1.0, help="fairness: the huge requests go first by this much")
    add("--deadline-s", type=float, default=60.0, help="fairness: normal requests not done by then count as unfinished")
    add("--big-body-mb", type=float, default=50.0)
    add("--big-body-timeout-s", type=float, default=600.0, help="the old server took 92 s for 50 MB")
    add("--settle-s", type=float, default=2.0, help="big-body: wait before the RSS 'after'")
    add("--health-prompt-mb", type=float, default=10.0)
    add("--health-interval-s", type=float, default=0.05)
    add("--users", type=int, default=64)
    add("--duration-s", type=float, default=120.0)
    add("--hostile-fraction", type=float, default=0.05)
    add("--oversize-mb", type=float, default=20.0, help="load: the oversized-body request's size")
    add("--request-timeout-s", type=float, default=30.0, help="load: a normal request not done by then fails")
    add("--think-s", type=float, default=0.5, help="load: each user waits up to this between requests")
    return parser.parse_args(argv)


async def run(args: argparse.Namespace) -> dict:
    args.model, source = served_model(args.url, args.model, "")
    if not args.model:
        raise SystemExit(f"overload: no model name: {source}; give --model")
    # Every request has its own deadline (asyncio's), so the client sets none of its own.
    async with http_client(None) as client:
        # The first request may build kernels or warm caches; no scenario should pay for it.
        warmup = await post(client, args.url, normal_body(args.model, 0, args.max_tokens), 600)
        results: dict = {"url": args.url, "model": args.model, "args": vars(args).copy(),
                         "warmup": {"status": label(warmup), "seconds": round(warmup.latency_s, 2)}}
        scenarios = {"fairness": fairness, "big-body": big_body, "health": health, "load": load}
        for name in args.scenario or SCENARIOS:
            print(f"[overload] {name} ...", file=sys.stderr, flush=True)
            results[name] = await scenarios[name](client, args)
        return results


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    results = asyncio.run(run(args))
    print(markdown(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
