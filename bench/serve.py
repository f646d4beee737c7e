"""Serve suite (`graphexec-bench bench=serve`): an OpenAI-compatible server measured from outside,
as vLLM's `bench serve` does.

    graphexec-bench bench=serve                                   # starts graphexec-serve itself
    graphexec-bench bench=serve capture=eager 'bench.request_rates=[inf,2,8]' bench.max_concurrency=16
    graphexec-bench bench=serve bench.dataset.name=chat bench.slo.ttft_ms=2000
    graphexec-bench bench=serve bench.url=http://127.0.0.1:8080     # any server: llama.cpp, vLLM, ...

Boundary: this module orchestrates.  It reads bench.* (checked, errors name the option), builds the
seeded request set with the configured model's tokenizer (bench/serve_datasets.py), gets a server
(below: started on a free port, or bench.url), then for each request rate empties
the server's prefix cache where it can (POST /flush_cache) and sends every request
(bench/serve_client.py), and summarises each run; the numbers and the report are bench/serve_report.py's.

The server: `launched_server` starts `python -m graphexec.entrypoints.serve` with the run's engine
overrides on a free loopback port, its output going to a log file in the run directory, waits until
/health answers 200, and on the way out (normally or on any error) stops it with SIGINT, then
SIGTERM, then SIGKILL.  With bench.url set nothing is started and that server is used as it is, so
other OpenAI-compatible servers (llama.cpp's, vLLM's) are measured unmodified.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

import httpx
from omegaconf import OmegaConf

from bench.serve_client import SendOptions, arrival_times, send_all
from bench.serve_datasets import BenchRequest, build, describe
from bench.serve_report import COMPARE_UNIT, SLO_KEYS, report, summarize  # noqa: F401  (report: the suite interface)
from graphexec.parallel.ports import free_port

WARMUP_TOKENS = 4


def run(cfg, ctx) -> dict[str, Any]:
    # httpx logs every request at INFO, which Hydra's job logging shows: hundreds of lines per run.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    opts = options(cfg.bench)
    requests = build(opts["dataset"], model_tokenizer(cfg))
    overrides = (*ctx.overrides, *opts["server_overrides"])
    server = (given_server(opts["url"]) if opts["url"]
              else launched_server(overrides, ctx.out_dir, opts["server_start_timeout_s"]))
    with server as target:
        model, model_source = served_model(target.url, opts["model"], cfg.model.name)
        send = SendOptions(model, opts["stream"], opts["ignore_eos"], opts["temperature"], opts["request_timeout_s"],
                           opts["extra_body"])
        warmup = _warm_up(target.url, requests, send, opts["warmup_requests"])
        runs = [_one_rate(target.url, requests, send, opts, rate, i, ctx.say) for i, rate in enumerate(opts["request_rates"])]
    return {
        "target": dataclasses.asdict(target) | {"overrides": list(overrides) if target.launched else []},
        "model": model,
        "model_source": model_source,
        "options": {k: v for k, v in opts.items() if k not in ("dataset", "request_rates")}
        | {"request_rates": [_rate(r) for r in opts["request_rates"]]},
        "dataset": opts["dataset"] | {"totals": describe(requests)},
        "warmup": warmup,
        "runs": runs,
    }


def options(bench_cfg) -> dict[str, Any]:
    """bench.* as plain values, checked; errors name the option."""
    o = OmegaConf.to_container(bench_cfg, resolve=True)
    try:
        o["request_rates"] = [float(r) for r in o["request_rates"]]
    except (TypeError, ValueError):
        raise ValueError(f"bench.request_rates={o['request_rates']} must be a list of numbers or inf") from None
    if not o["request_rates"]:
        raise ValueError("bench.request_rates is empty: give at least one rate (inf sends everything at once)")
    for key in ("burstiness", "request_timeout_s", "server_start_timeout_s"):
        if not o[key] > 0:
            raise ValueError(f"bench.{key}={o[key]} must be > 0")
    if o["warmup_requests"] < 0:
        raise ValueError(f"bench.warmup_requests={o['warmup_requests']} must be at least 0")
    if o["max_concurrency"] is not None and o["max_concurrency"] < 1:
        raise ValueError(f"bench.max_concurrency={o['max_concurrency']} must be at least 1 (or null: no limit)")
    unknown = set(o["slo"]) - set(SLO_KEYS)
    if unknown:
        raise ValueError(f"bench.slo.{sorted(unknown)[0]} is unknown; the SLOs are {', '.join(SLO_KEYS)}")
    o["extra_body"] = o.get("extra_body") or {}
    o["server_overrides"] = list(o.get("server_overrides") or [])
    return o


def model_tokenizer(cfg):
    """The configured model's tokenizer, without its weights: prompts are measured in its tokens."""
    from bench.peer import gguf_path, tokenizer_of
    from graphexec.config import EngineConfig

    source = EngineConfig.from_dictconfig(cfg).model
    return tokenizer_of(source, gguf_path(source))


def served_model(url: str, configured: str | None, fallback: str) -> tuple[str, str]:
    """The `model` field requests carry: bench.model, else the server's first /v1/models entry,
    else the configured model's name (and why the listing failed)."""
    if configured:
        return configured, "bench.model"
    try:
        with httpx.Client(trust_env=False, timeout=10) as http:
            return http.get(f"{url}/v1/models").raise_for_status().json()["data"][0]["id"], "/v1/models"
    except (httpx.HTTPError, ValueError, KeyError, IndexError) as error:
        return fallback, f"model.name (/v1/models failed: {type(error).__name__}: {error})"


def _warm_up(url: str, requests: list[BenchRequest], send: SendOptions, count: int) -> list[dict[str, Any]]:
    """A few short requests before any timing: first-request costs (kernel builds) are not the run's."""
    short = [dataclasses.replace(r, index=-1 - i, output_tokens=min(WARMUP_TOKENS, r.output_tokens))
             for i, r in enumerate(requests[:count])]
    if not short:
        return []
    records, _ = asyncio.run(send_all(url, short, send, [0.0] * len(short), 1))
    return [{"success": r.success, "error": r.error, "latency_s": r.latency_s} for r in records]


def flush_prefix_cache(url: str) -> str:
    """Empty graphexec-serve's prefix cache so a rate does not reuse the previous rate's prompts;
    other servers answer 404 (recorded, not an error)."""
    try:
        with httpx.Client(trust_env=False, timeout=30) as http:
            response = http.post(f"{url}/flush_cache")
        return "flushed" if response.status_code == 200 else f"HTTP {response.status_code}"
    except httpx.HTTPError as error:
        return f"{type(error).__name__}"


def server_metrics(url: str) -> dict[str, Any] | None:
    """graphexec-serve's JSON snapshot (/metrics/json; /metrics on servers from before Prometheus),
    or None from a server without either."""
    try:
        with httpx.Client(trust_env=False, timeout=10) as http:
            for path in ("/metrics/json", "/metrics"):
                response = http.get(f"{url}{path}")
                if response.status_code == 200 and response.headers.get("content-type", "").startswith("application/json"):
                    metrics = response.json()
                    return metrics if isinstance(metrics, dict) else None
    except (httpx.HTTPError, ValueError):
        return None
    return None


def _rate(rate: float) -> float | str:
    """"inf" for float inf, which json.dumps would write as Infinity (not JSON to strict readers)."""
    return "inf" if math.isinf(rate) else rate


def _load_average() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def _one_rate(url: str, requests: list[BenchRequest], send: SendOptions, opts: dict[str, Any], rate: float,
              index: int, say) -> dict[str, Any]:
    flushed = flush_prefix_cache(url) if opts["flush_cache"] else "not asked"
    schedule = arrival_times(len(requests), rate, opts["burstiness"], opts["seed"] + index)
    before, load_before = server_metrics(url), _load_average()
    label = "inf" if math.isinf(rate) else f"{rate:g}/s"
    say(f"serve suite: rate {label}: {len(requests)} requests ...")
    records, wall = asyncio.run(send_all(url, requests, send, schedule, opts["max_concurrency"]))
    say(f"serve suite: rate {label}: done in {wall:.1f} s, {sum(not r.success for r in records)} failed")
    return {
        "request_rate": _rate(rate),
        "flush_cache": flushed,
        "server_metrics": {"before": before, "after": server_metrics(url)},
        # Other work on the machine inflates every latency here; the report shows this beside them.
        "load_average_1min": {"before": load_before, "after": _load_average(), "cpus": os.cpu_count()},
        "metrics": summarize(records, wall, opts["slo"]),
        "records": [dataclasses.asdict(r) for r in records],
    }


# ---------------------------------------------------------------------------------------------
# the server


LOG_FILE = "server.log"
_STOP_GRACE_S = (30.0, 10.0)  # after SIGINT, then after SIGTERM, before SIGKILL


@dataclass(frozen=True)
class Target:
    """Where requests go: the base URL, and what the suite knows of the server."""

    url: str
    launched: bool
    command: tuple[str, ...] = ()
    pid: int | None = None
    start_seconds: float | None = None
    log_path: str | None = None


def serve_command(overrides: Sequence[str], port: int) -> list[str]:
    """graphexec-serve as a module of this interpreter (so it is this checkout's graphexec)."""
    return [sys.executable, "-m", "graphexec.entrypoints.serve", *overrides, "server.host=127.0.0.1",
            f"server.port={port}", "server.log_level=warning"]


@contextlib.contextmanager
def launched_server(overrides: Sequence[str], log_dir: Path, start_timeout_s: float) -> Iterator[Target]:
    """graphexec-serve on a free port for the duration of the block; stopped however it ends."""
    port = free_port()
    command = serve_command(overrides, port)
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / LOG_FILE
    started = time.perf_counter()
    with open(log_path, "wb") as log:
        # No preexec_fn (unsafe once torch's threads exist): a benchmark killed by SIGKILL leaves
        # the server running; every other way out stops it below.
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, process, log_path, start_timeout_s)
        yield Target(url, True, tuple(command), process.pid, time.perf_counter() - started, str(log_path))
    finally:
        stop(process)


def wait_healthy(url: str, process: subprocess.Popen, log_path: Path, timeout_s: float) -> None:
    """Until GET /health answers 200; the server's exit or the deadline raise with its log's tail."""
    deadline = time.monotonic() + timeout_s
    with httpx.Client(trust_env=False, timeout=5) as http:
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"graphexec-serve exited with code {process.returncode} before it was ready: "
                                   f"{log_tail(log_path)}")
            with contextlib.suppress(httpx.TransportError):
                if http.get(f"{url}/health").status_code == 200:
                    return
            if time.monotonic() > deadline:
                raise RuntimeError(f"graphexec-serve did not answer /health within bench.server_start_timeout_s="
                                   f"{timeout_s:g}: {log_tail(log_path)}")
            time.sleep(0.25)


def stop(process: subprocess.Popen) -> int | None:
    """SIGINT (graphexec-serve's clean shutdown), then SIGTERM, then SIGKILL; the exit code."""
    for sig, grace in ((signal.SIGINT, _STOP_GRACE_S[0]), (signal.SIGTERM, _STOP_GRACE_S[1]), (signal.SIGKILL, None)):
        if process.poll() is not None:
            break
        process.send_signal(sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(grace)
    return process.returncode


def log_tail(path: Path, chars: int = 2000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:].strip() or "(empty log)"
    except OSError as error:
        return f"(no log: {error})"


@contextlib.contextmanager
def given_server(url: str) -> Iterator[Target]:
    """A server someone else runs: nothing to start or stop."""
    yield Target(url.rstrip("/"), False)
