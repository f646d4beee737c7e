"""graphexec-serve under overload and hostile clients (issue 13), as a client sees it, before/after.

    graphexec-bench overload --url http://127.0.0.1:8000 --pid <server pid> [--scenario NAME ...]

Boundary: this module only talks HTTP (and raw TCP for clients no HTTP library imitates) to a
server someone else started, and reads that server's RSS through psutil when given its pid.  It
works against any graphexec-serve, old or new: whatever the server answers is recorded, never
asserted.  A request the old server accepts and runs forever (max_tokens=1e9) is cancelled at the
scenario's deadline, and a socket it never closes is closed at the end of the run.

Scenarios (default: all, in this order):
  fairness  2 streams with max_tokens=1e9 and ignore_eos, then 30 normal streams: the normal ones'
            TTFT p50/p99, how many finished within the deadline, the huge ones' statuses.
  big-body  one JSON body with a 50 MB prompt: status, seconds, server RSS before/peak/after.
  health    /health latency (p50/p99/max) while a 10 MB prompt is in flight; server RSS around it.
  load      N users for T seconds: 95 % normal streams, 5 % hostile (huge max_tokens, an
            oversized body, a client that drops mid-body, a client stalled in its headers):
            counts and outcomes by type, normal latency percentiles, the running batch over time.

Prints a Markdown report; `--json PATH` also writes every number.  Only asyncio, httpx, psutil and
the serve suite's SSE reader (bench/serve_client.py); no torch.
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
from dataclasses import asdict, dataclass, field
from urllib.parse import urlsplit

import httpx

from bench.serve_client import sse_events
from bench.stats import nearest_rank_ms as percentiles
from bench.report import Report, Table
from bench.tables import machine_line

SCENARIOS = ("fairness", "big-body", "health", "load")
HUGE_MAX_TOKENS = 1_000_000_000
MB = 1_000_000
PROMPTS = (
    "The capital of France is",
    "Write a short poem about the sea.",
    "List three uses of a paperclip:",
    "Explain what a KV cache is in one sentence.",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "Translate 'good morning' into Spanish:",
    "A haiku about autumn leaves:",
)


# --- one request --------------------------------------------------------------------------------


@dataclass
class Outcome:
    """What one request got: its status (None: no answer), timings, or the exception's class."""

    kind: str
    status: int | None = None
    ttft_s: float | None = None  # to the first chunk with text
    latency_s: float | None = None  # to the end of the answer
    finished: bool = False  # the whole answer arrived
    error: str | None = None  # "deadline" or an exception class name
    chunks: int = 0

    @property
    def label(self) -> str:
        """How the failure table counts it: the status code, else the exception."""
        if self.status is not None and self.error is None:
            return str(self.status)
        return f"{self.status or ''} {self.error}".strip()


async def stream_completion(client: httpx.AsyncClient, url: str, body: dict, deadline_s: float, kind: str) -> Outcome:
    """POST a streaming completion and read it until the end or `deadline_s` (then cancelled)."""
    outcome = Outcome(kind)
    start = time.perf_counter()

    async def read() -> None:
        async with client.stream("POST", f"{url}/v1/completions", json=body | {"stream": True}) as response:
            outcome.status = response.status_code
            if response.status_code != 200:
                await response.aread()
                return
            async for event in sse_events(response):
                outcome.chunks += 1
                choices = event.get("choices") or [{}]
                if outcome.ttft_s is None and choices[0].get("text"):
                    outcome.ttft_s = time.perf_counter() - start
            outcome.finished = True

    try:
        await asyncio.wait_for(read(), deadline_s)
    except asyncio.TimeoutError:
        outcome.error = "deadline"
    except httpx.HTTPError as error:
        outcome.error = type(error).__name__
    outcome.latency_s = time.perf_counter() - start
    return outcome


async def post_body(client: httpx.AsyncClient, url: str, content: bytes, timeout_s: float, kind: str) -> Outcome:
    """POST a prepared (large) JSON body; the answer's status and time."""
    outcome = Outcome(kind)
    start = time.perf_counter()
    try:
        response = await client.post(
            f"{url}/v1/completions", content=content, headers={"Content-Type": "application/json"}, timeout=timeout_s
        )
        outcome.status, outcome.finished = response.status_code, True
    except httpx.TimeoutException:
        outcome.error = "deadline"
    except httpx.HTTPError as error:
        outcome.error = type(error).__name__
    outcome.latency_s = time.perf_counter() - start
    return outcome


def normal_body(model: str, index: int, max_tokens: int) -> dict:
    return {"model": model, "prompt": f"{index}: {PROMPTS[index % len(PROMPTS)]}", "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True}


def prompt_body(model: str, megabytes: float) -> bytes:
    """A completion body whose prompt is `megabytes` of plain words (what a tokenizer chews on)."""
    words = "the quick brown fox jumps over the lazy dog and keeps running "
    text = (words * (int(megabytes * MB) // len(words) + 1))[: int(megabytes * MB)]
    return json.dumps({"model": model, "prompt": text, "max_tokens": 1}).encode()


# --- server probes ------------------------------------------------------------------------------


class RssProbe:
    """The server's RSS (bytes) through psutil, sampled in the background for a peak."""

    def __init__(self, pid: int | None, interval_s: float = 0.1):
        self._process = None
        if pid is not None:
            import psutil

            self._process = psutil.Process(pid)
        self._interval_s = interval_s
        self.peak: int | None = None

    def now(self) -> int | None:
        if self._process is None:
            return None
        rss = self._process.memory_info().rss
        self.peak = max(self.peak or 0, rss)
        return rss

    async def sample(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            self.now()
            await asyncio.sleep(self._interval_s)


class MetricsProbe:
    """/metrics every `interval_s`: the running batch and the waiting queue over time."""

    def __init__(self, client: httpx.AsyncClient, url: str, interval_s: float = 0.5):
        self._client, self._url, self._interval_s = client, url, interval_s
        self.running: list[int] = []
        self.waiting: list[int] = []

    async def sample(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            with contextlib.suppress(httpx.HTTPError, ValueError):
                metrics = await self._snapshot()
                self.running.append(metrics.get("running", -1))
                self.waiting.append(metrics.get("waiting", -1))
            await asyncio.sleep(self._interval_s)

    async def _snapshot(self) -> dict:
        # The JSON snapshot is at /metrics/json since /metrics became Prometheus text; older servers
        # answer 404 there and serve it at /metrics.
        answer = await self._client.get(f"{self._url}/metrics/json", timeout=5)
        if answer.status_code == 404:
            answer = await self._client.get(f"{self._url}/metrics", timeout=5)
        return answer.json()

    def summary(self) -> dict:
        if not self.running:
            return {}
        return {"running_min": min(self.running), "running_mean": round(statistics.mean(self.running), 1),
                "waiting_max": max(self.waiting), "samples": len(self.running)}


@contextlib.asynccontextmanager
async def sampling(*probes):
    """Run the probes' `sample` loops for the duration of the block."""
    stop = asyncio.Event()
    tasks = [asyncio.create_task(probe.sample(stop)) for probe in probes]
    try:
        yield
    finally:
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)


# --- scenarios ----------------------------------------------------------------------------------


async def fairness(client: httpx.AsyncClient, args: argparse.Namespace) -> dict:
    """2 huge streams get a head start, then 30 normal ones; huge ones are cancelled at the deadline."""
    huge = [asyncio.create_task(stream_completion(
        client, args.url, normal_body(args.model, i, args.huge_max_tokens), args.deadline_s + args.head_start_s, "huge",
    )) for i in range(args.huge)]
    await asyncio.sleep(args.head_start_s)  # as in issue 13: the huge ones hold the KV first
    probe = MetricsProbe(client, args.url)
    async with sampling(probe):
        normal = await asyncio.gather(*(
            stream_completion(client, args.url, normal_body(args.model, i, args.max_tokens), args.deadline_s, "normal")
            for i in range(args.normal)
        ))
    huge_done = await asyncio.gather(*huge)
    return {
        "huge_outcomes": dict(Counter(o.label for o in huge_done)),
        "normal_finished": sum(o.finished for o in normal),
        "normal_total": len(normal),
        "normal_ttft": percentiles([o.ttft_s for o in normal if o.ttft_s is not None]),
        "normal_latency": percentiles([o.latency_s for o in normal if o.finished]),
        "normal_outcomes": dict(Counter(o.label for o in normal)),
        "metrics": probe.summary(),
    }


async def big_body(client: httpx.AsyncClient, args: argparse.Namespace) -> dict:
    """One body with a prompt of `--big-body-mb` MB; the server's RSS before, at peak and after."""
    content = prompt_body(args.model, args.big_body_mb)
    rss = RssProbe(args.pid)
    before = rss.now()
    async with sampling(rss):
        outcome = await post_body(client, args.url, content, args.big_body_timeout_s, "big-body")
    await asyncio.sleep(args.settle_s)  # let the server return what it freed
    return {"body_bytes": len(content), "status": outcome.label, "seconds": round(outcome.latency_s, 2),
            "rss_before_mb": _mb(before), "rss_peak_mb": _mb(rss.peak), "rss_after_mb": _mb(rss.now())}


async def health(client: httpx.AsyncClient, args: argparse.Namespace) -> dict:
    """/health every `--health-interval-s` while a `--health-prompt-mb` MB prompt is in flight."""
    content = prompt_body(args.model, args.health_prompt_mb)
    rss = RssProbe(args.pid)
    before = rss.now()
    big = asyncio.create_task(post_body(client, args.url, content, args.big_body_timeout_s, "big-prompt"))
    latencies, errors = [], Counter()
    while not big.done():
        rss.now()
        start = time.perf_counter()
        try:
            await client.get(f"{args.url}/health", timeout=args.big_body_timeout_s)
            latencies.append(time.perf_counter() - start)
        except httpx.HTTPError as error:
            errors[type(error).__name__] += 1
        await asyncio.sleep(args.health_interval_s)
    outcome = big.result()
    await asyncio.sleep(args.settle_s)
    return {"prompt_bytes": len(content), "prompt_status": outcome.label, "prompt_seconds": round(outcome.latency_s, 2),
            "health": percentiles(latencies), "health_errors": dict(errors),
            "rss_before_mb": _mb(before), "rss_peak_mb": _mb(rss.peak), "rss_after_mb": _mb(rss.now())}


# --- the load scenario --------------------------------------------------------------------------


@dataclass
class LoadRun:
    """Everything a load run records; the users append to it."""

    outcomes: list[Outcome] = field(default_factory=list)
    background: list[asyncio.Task] = field(default_factory=list)  # huge streams, stalled sockets


HOSTILE = ("huge", "oversized-body", "drop-mid-body", "stalled-headers")
# A held hostile request sent just before the end of a run still gets this long for its answer.
_MIN_HOLD_S = 5.0


async def load(client: httpx.AsyncClient, args: argparse.Namespace) -> dict:
    run = LoadRun()
    oversized = prompt_body(args.model, args.oversize_mb)  # built once, sent by every such request
    end = time.monotonic() + args.duration_s
    probe = MetricsProbe(client, args.url, interval_s=1.0)
    async with sampling(probe):
        await asyncio.gather(*(user(client, args, run, oversized, end, seed) for seed in range(args.users)))
        run.outcomes += await asyncio.gather(*run.background)
    normal = [o for o in run.outcomes if o.kind == "normal"]
    return {
        "users": args.users, "duration_s": args.duration_s,
        "requests": dict(Counter(o.kind for o in run.outcomes)),
        "outcomes": {kind: dict(Counter(o.label for o in run.outcomes if o.kind == kind))
                     for kind in ("normal", *HOSTILE)},
        "normal_per_s": round(sum(o.finished for o in normal) / args.duration_s, 2),
        "normal_ttft": percentiles([o.ttft_s for o in normal if o.ttft_s is not None]),
        "normal_latency": percentiles([o.latency_s for o in normal if o.finished]),
        "metrics": probe.summary(),
    }


async def user(
    client: httpx.AsyncClient, args: argparse.Namespace, run: LoadRun, oversized: bytes, end: float, seed: int
) -> None:
    """One simulated user: a request, a think time, again, until the end of the run."""
    rng = random.Random(seed)
    index = seed * 100_000
    while time.monotonic() < end:
        index += 1
        if rng.random() >= args.hostile_fraction:
            body = normal_body(args.model, index, rng.randint(args.max_tokens // 2, args.max_tokens * 2))
            run.outcomes.append(await stream_completion(client, args.url, body, args.request_timeout_s, "normal"))
        else:
            await hostile(rng.choice(HOSTILE), client, args, run, oversized, index, end - time.monotonic())
        await asyncio.sleep(rng.uniform(0, args.think_s))


async def hostile(
    kind: str, client: httpx.AsyncClient, args: argparse.Namespace, run: LoadRun, oversized: bytes, index: int,
    left: float,
) -> None:
    """Send one hostile request.  Those a real attacker would hold (a huge stream, a stalled
    socket) keep going in the background until the server ends them or the run ends."""
    hold_s = max(left, _MIN_HOLD_S)
    if kind == "huge":
        body = normal_body(args.model, index, args.huge_max_tokens)
        run.background.append(asyncio.create_task(stream_completion(client, args.url, body, hold_s, kind)))
    elif kind == "oversized-body":
        run.outcomes.append(await post_body(client, args.url, oversized, args.request_timeout_s * 4, kind))
    elif kind == "drop-mid-body":
        run.outcomes.append(await drop_mid_body(args.url, args.model))
    else:
        run.background.append(asyncio.create_task(stalled_headers(args.url, hold_s)))


async def drop_mid_body(url: str, model: str) -> Outcome:
    """Headers announcing a body, half of it, then the connection closes."""
    outcome = Outcome("drop-mid-body")
    body = json.dumps({"model": model, "prompt": "never finished " * 100, "max_tokens": 8}).encode()
    try:
        _, writer = await _open(url)
        writer.write(_headers(url, f"Content-Length: {len(body)}") + body[: len(body) // 2])
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.close()
        outcome.error = "dropped"
    except OSError as error:
        outcome.error = type(error).__name__
    return outcome


async def stalled_headers(url: str, hold_s: float) -> Outcome:
    """Half a request line and headers, then nothing: held until the server closes it or `hold_s`."""
    outcome = Outcome("stalled-headers")
    start = time.perf_counter()
    try:
        reader, writer = await _open(url)
        writer.write(_headers(url, "Content-Length: 10")[:-20])
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(200), hold_s)
        outcome.status = int(answer.split()[1]) if answer.startswith(b"HTTP/") else None
        outcome.error = "closed by server"
        writer.close()
    except asyncio.TimeoutError:
        outcome.error = "still open at end"
        writer.close()
    except OSError as error:
        outcome.error = type(error).__name__
    outcome.latency_s = time.perf_counter() - start
    return outcome


async def _open(url: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    parts = urlsplit(url)
    return await asyncio.open_connection(parts.hostname, parts.port or 80)


def _headers(url: str, extra: str) -> bytes:
    head = f"POST /v1/completions HTTP/1.1\r\nHost: {urlsplit(url).netloc}\r\nContent-Type: application/json\r\n"
    return f"{head}{extra}\r\n\r\n".encode()


# --- report -------------------------------------------------------------------------------------


def _mb(value: int | None) -> float | None:
    return None if value is None else round(value / 2**20, 1)


def markdown(results: dict) -> str:
    report = Report([f"## graphexec-serve overload: {results['url']} (model {results['model']})",
                     machine_line(torch_facts=False)])
    renderers = {"fairness": _fairness_md, "big-body": _big_body_md, "health": _health_md, "load": _load_md}
    for name, render in renderers.items():
        if name in results:
            report.blocks += render(results[name], results["args"])
    return report.markdown()


def _fairness_md(r: dict, args: dict) -> list:
    ttft, latency, metrics = r["normal_ttft"], r["normal_latency"], r["metrics"]
    return [Table(["normal finished", "TTFT p50 ms", "TTFT p99 ms", "latency p50 ms", "latency p99 ms", "huge outcomes",
                   "running min/mean"],
                  [[f"{r['normal_finished']}/{r['normal_total']}", ttft.get("p50_ms"), ttft.get("p99_ms"),
                    latency.get("p50_ms"), latency.get("p99_ms"), r["huge_outcomes"],
                    f"{metrics.get('running_min')}/{metrics.get('running_mean')}"]],
                  f"fairness: {args['huge']} huge (max_tokens={args['huge_max_tokens']}) + {r['normal_total']} normal "
                  f"(max_tokens={args['max_tokens']}), deadline {args['deadline_s']} s")]


def _big_body_md(r: dict, args: dict) -> list:
    return [Table(["status", "seconds", "server RSS before MiB", "peak MiB", "after MiB"],
                  [[r["status"], r["seconds"], r["rss_before_mb"], r["rss_peak_mb"], r["rss_after_mb"]]],
                  f"big body: {r['body_bytes'] / MB:.0f} MB JSON prompt")]


def _health_md(r: dict, args: dict) -> list:
    health = r["health"]
    return [Table(["prompt status", "prompt seconds", "/health n", "p50 ms", "p99 ms", "max ms", "errors",
                   "server RSS before/peak/after MiB"],
                  [[r["prompt_status"], r["prompt_seconds"], health["n"], health.get("p50_ms"), health.get("p99_ms"),
                    health.get("max_ms"), r["health_errors"] or None,
                    f"{r['rss_before_mb']}/{r['rss_peak_mb']}/{r['rss_after_mb']}"]],
                  f"/health while a {r['prompt_bytes'] / MB:.0f} MB prompt is in flight")]


def _load_md(r: dict, args: dict) -> list:
    kinds = [[kind, r["requests"].get(kind, 0), ", ".join(f"{k}: {v}" for k, v in sorted(counts.items())) or None]
             for kind, counts in r["outcomes"].items()]
    ttft, latency, metrics = r["normal_ttft"], r["normal_latency"], r["metrics"]
    return [Table(["request type", "sent", "outcomes (status or exception: count)"], kinds,
                  f"load: {r['users']} users, {r['duration_s']} s, {args['hostile_fraction']:.0%} hostile"),
            Table(["normal finished/s", "TTFT p50 ms", "p90 ms", "p99 ms", "latency p50 ms", "p99 ms",
                   "running min/mean", "waiting max"],
                  [[r["normal_per_s"], ttft.get("p50_ms"), ttft.get("p90_ms"), ttft.get("p99_ms"),
                    latency.get("p50_ms"), latency.get("p99_ms"),
                    f"{metrics.get('running_min')}/{metrics.get('running_mean')}", metrics.get("waiting_max")]])]


def _jsonable(value):
    if isinstance(value, Outcome):
        return asdict(value)
    raise TypeError(type(value).__name__)


# --- command line -------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--url", default="http://127.0.0.1:8000", help="the running graphexec-serve")
    add("--pid", type=int, help="the server's process id, for its RSS (big-body)")
    add("--model", help="model name for the requests (default: the server's /v1/models)")
    add("--scenario", action="append", choices=SCENARIOS, help="run only these (repeatable; default: all)")
    add("--json", help="also write the results here")
    add("--max-tokens", type=int, default=32, help="normal requests' max_tokens (load: between half and twice it)")
    add("--huge-max-tokens", type=int, default=HUGE_MAX_TOKENS)
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
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(trust_env=False, timeout=args.request_timeout_s, limits=limits) as client:
        if args.model is None:
            args.model = (await client.get(f"{args.url}/v1/models")).json()["data"][0]["id"]
        # The first request may build kernels or warm caches; no scenario should pay for it.
        warmup = await stream_completion(client, args.url, normal_body(args.model, 0, args.max_tokens), 600, "warm-up")
        results: dict = {"url": args.url, "model": args.model, "args": vars(args).copy(),
                         "warmup": {"status": warmup.label, "seconds": round(warmup.latency_s, 2)}}
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
        with open(args.json, "w") as out:
            json.dump(results, out, indent=2, default=_jsonable)
