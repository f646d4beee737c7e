"""Serve suite (`graphexec-bench bench=serve`): an OpenAI-compatible server measured from outside,
as vLLM's `bench serve` does (bench/README.md, serve).

Boundary: this module orchestrates: bench.* checked (errors name the option), the request set
(bench/serve_datasets.py), a server (`launched_server` below, or bench.url as it is), then per
request rate an emptied prefix cache and every request sent (bench/serve_client.py); the numbers
and the report are bench/serve_report.py's.  lm_eval_check and agent_check start their server here.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import httpx

from bench.serve_client import arrival_times, flush_prefix_cache, send_all, served_model, server_metrics
from bench.serve_datasets import BenchRequest, build, describe
from bench.serve_report import SLO_KEYS, rate_label, report, summarize
from bench.suites import checked_options
from graphexec.parallel.ports import free_port

__all__ = ["COMPARE_UNIT", "report", "run"]  # the suite interface (bench/suites.py)

COMPARE_UNIT = "tok/s"  # which summary numbers a multirun comparison plots
WARMUP_TOKENS = 4


def run(cfg, ctx) -> dict[str, Any]:
    # httpx logs every request at INFO, which Hydra's job logging shows: hundreds of lines per run.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    opts = options(cfg.bench)
    requests = build(opts["dataset"], model_tokenizer(cfg))
    overrides = (*ctx.overrides, *opts["server_overrides"])
    server = (contextlib.nullcontext(Target(opts["url"].rstrip("/"), False)) if opts["url"]  # as it is
              else launched_server(overrides, ctx.out_dir, opts["server_start_timeout_s"]))
    with server as target:
        model, model_source = served_model(target.url, opts["model"], cfg.model.name)
        send = opts | {"model": model}  # what serve_client needs: bench.* and the model requests name
        warmup = _warm_up(target.url, requests, send)
        runs = [_one_rate(target.url, requests, send, rate, i, ctx.say) for i, rate in enumerate(opts["request_rates"])]
    options_kept = {k: v for k, v in opts.items() if k not in ("dataset", "request_rates")}
    return {"target": dataclasses.asdict(target) | {"overrides": list(overrides) if target.launched else []},
            "model": model, "model_source": model_source,
            "options": options_kept | {"request_rates": [_rate(r) for r in opts["request_rates"]]},
            "dataset": opts["dataset"] | {"totals": describe(requests)}, "warmup": warmup, "runs": runs}


def options(bench_cfg) -> dict[str, Any]:
    """bench.* as plain values, checked; errors name the option."""
    o = checked_options(bench_cfg, ints={"warmup_requests": 0})
    try:
        o["request_rates"] = [float(r) for r in o["request_rates"]]
    except (TypeError, ValueError):
        raise ValueError(f"bench.request_rates={o['request_rates']} must be a list of numbers or inf") from None
    positive = ("burstiness", "request_timeout_s", "server_start_timeout_s")
    unknown_slos = sorted(set(o["slo"]) - set(SLO_KEYS))
    for bad, message in (
        (not o["request_rates"], "bench.request_rates is empty: give at least one rate (inf sends everything at once)"),
        *((not o[k] > 0, f"bench.{k}={o[k]} must be > 0") for k in positive),
        (o["max_concurrency"] is not None and o["max_concurrency"] < 1,
         f"bench.max_concurrency={o['max_concurrency']} must be at least 1 (or null: no limit)"),
        *((True, f"bench.slo.{k} is unknown; the SLOs are {', '.join(SLO_KEYS)}") for k in unknown_slos),
    ):
        if bad:
            raise ValueError(message)
    return o | {"extra_body": o.get("extra_body") or {}, "server_overrides": list(o.get("server_overrides") or [])}


def model_tokenizer(cfg):
    """The configured model's tokenizer, without its weights: prompts are measured in its tokens."""
    from bench.peer import gguf_path, tokenizer_of
    from graphexec.config import EngineConfig

    source = EngineConfig.from_dictconfig(cfg).model
    return tokenizer_of(source, gguf_path(source))


def _warm_up(url: str, requests: list[BenchRequest], opts: dict[str, Any]) -> list[dict[str, Any]]:
    """A few short requests before any timing: first-request costs (kernel builds) are not the run's."""
    short = [dataclasses.replace(r, index=-1 - i, output_tokens=min(WARMUP_TOKENS, r.output_tokens))
             for i, r in enumerate(requests[:opts["warmup_requests"]])]
    records, _ = asyncio.run(send_all(url, short, opts, [0.0] * len(short), 1))
    return [{"success": r.success, "error": r.error, "latency_s": r.latency_s} for r in records]


def _rate(rate: float) -> float | str:
    """"inf" for float inf, which json.dumps would write as Infinity (not JSON to strict readers)."""
    return "inf" if math.isinf(rate) else rate


def _load_average() -> float | None:
    with contextlib.suppress(OSError):
        return os.getloadavg()[0]
    return None


def _one_rate(url: str, requests: list[BenchRequest], opts: dict[str, Any], rate: float, index: int,
              say) -> dict[str, Any]:
    flushed = flush_prefix_cache(url) if opts["flush_cache"] else "not asked"
    schedule = arrival_times(len(requests), rate, opts["burstiness"], opts["seed"] + index)
    before, load_before = server_metrics(url), _load_average()
    label = rate_label(_rate(rate))
    say(f"serve suite: rate {label}: {len(requests)} requests ...")
    records, wall = asyncio.run(send_all(url, requests, opts, schedule, opts["max_concurrency"]))
    say(f"serve suite: rate {label}: done in {wall:.1f} s, {sum(not r.success for r in records)} failed")
    # Other work on the machine inflates every latency here; the report shows the load beside them.
    load = {"before": load_before, "after": _load_average(), "cpus": os.cpu_count()}
    return {"request_rate": _rate(rate), "flush_cache": flushed,
            "server_metrics": {"before": before, "after": server_metrics(url)}, "load_average_1min": load,
            "metrics": summarize(records, wall, opts["slo"]), "records": [dataclasses.asdict(r) for r in records]}


@dataclasses.dataclass(frozen=True)
class Target:
    """Where requests go: the base URL, and what the suite knows of the server."""

    url: str
    launched: bool
    command: tuple[str, ...] = ()
    pid: int | None = None
    start_seconds: float | None = None
    log_path: str | None = None


@contextlib.contextmanager
def launched_server(overrides: Sequence[str], log_dir: Path, start_timeout_s: float) -> Iterator[Target]:
    """graphexec-serve (this interpreter's: this checkout's graphexec) on a free loopback port, its
    output in log_dir/server.log, for the duration of the block; stopped however the block ends."""
    port = free_port()
    command = [sys.executable, "-m", "graphexec.entrypoints.serve", *overrides, "server.host=127.0.0.1",
               f"server.port={port}", "server.log_level=warning"]
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / "server.log"
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
    """Until GET /health answers 200; the server's exit or the deadline raise with its log's end."""
    deadline = time.monotonic() + timeout_s
    with httpx.Client(trust_env=False, timeout=5) as http:
        while (running := process.poll() is None) and time.monotonic() <= deadline:
            with contextlib.suppress(httpx.TransportError):
                if http.get(f"{url}/health").status_code == 200:
                    return
            time.sleep(0.25)
    why = (f"did not answer /health within bench.server_start_timeout_s={timeout_s:g}" if running
           else f"exited with code {process.returncode} before it was ready")
    try:
        tail = log_path.read_text(errors="replace")[-2000:].strip() or "(empty log)"
    except OSError as error:
        tail = f"(no log: {error})"
    raise RuntimeError(f"graphexec-serve {why}: {tail}")


def stop(process: subprocess.Popen) -> None:
    """SIGINT (graphexec-serve's clean shutdown), then SIGTERM, then SIGKILL."""
    for sig, grace in ((signal.SIGINT, 30.0), (signal.SIGTERM, 10.0), (signal.SIGKILL, None)):  # seconds it is given
        if process.poll() is not None:
            break
        process.send_signal(sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(grace)


def check_parser(doc: str, serve_args: Sequence[str]) -> argparse.ArgumentParser:
    """The options of a check run against a server: --url, --model and --serve-args (`against_server`)."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="a running OpenAI-compatible server (default: start graphexec-serve)")
    parser.add_argument("--model", default="smollm2-135m", help="the served model name")
    parser.add_argument("--serve-args", nargs="*", default=list(serve_args),
                        help="overrides for the graphexec-serve it starts")
    return parser


def against_server(args: argparse.Namespace, start_timeout_s: float, check: Callable[[str, str], Any]) -> Any:
    """`check(url, model)` against --url, else against a graphexec-serve started with --serve-args."""
    if args.url:
        return check(args.url, args.model)
    with tempfile.TemporaryDirectory() as logs, launched_server(args.serve_args, Path(logs), start_timeout_s) as target:
        return check(target.url, args.model)
