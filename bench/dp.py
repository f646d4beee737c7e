"""Data-parallel replicas against one: `graphexec-serve` at each `parallel.dp_size`, the same load.

    graphexec-bench dp [--models tiny smol] [--dp 1 2] [--requests 48] [--concurrency 8] [--json out.json]

Boundary: orchestration, one concurrent load, a markdown table.  For every model and dp size a
fresh graphexec-serve is started (bench/serve_server.py: free port, /health, stopped after), and
the same requests are sent with `--concurrency` in flight: a shared system prompt (longer than
the router's prefix key, so affinity applies) plus a varied user turn, streamed, `max_tokens`
tokens each with ignore_eos.  Chat for models with a chat template (smol); tiny-llama has none,
so it gets the same text as a completion prompt.  Reported per run: requests/s, output tokens/s,
time to first token p50, and the prefix-cache hit tokens the server counted during the load.

What a machine can show: each replica gets cores / dp_size threads (graphexec/parallel/
replicas.py), so on 2 cores dp=2 gains only where one process leaves a core idle (the engine
loop's Python between steps, HTTP and detokenization on a tiny model); compute-bound steps of a
larger model split the same two cores either way.  On a GPU both replicas share one device.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx

from bench.serve_client import SendOptions, send_all
from bench.serve_datasets import BenchRequest
from bench.serve_server import launched_server
from bench.stats import median
from bench.tables import machine_line, table
from graphexec.parallel.replicas import threads_per_replica_rank

MODELS = {
    "tiny": {"overrides": ["model=tiny-llama", "cache.num_slots=8192"], "name": "tiny-llama", "chat": False},
    "smol": {"overrides": ["model=smollm2-135m", "cache.num_slots=16384"], "name": "smollm2-135m", "chat": True},
}
SYSTEM_PROMPT = (
    "You are a concise assistant for a hardware store. Answer in one or two sentences, name the "
    "aisle when you can, never invent prices, and suggest a safer tool when a question sounds risky. "
) * 2
QUESTIONS = ("Where are the hammers?", "Do you sell rope?", "What glue holds wood?", "Is there a key cutter?",
             "Which drill for concrete?", "Do you have ladders?", "Where is the paint?", "Can I rent a saw?")


def _requests(model: dict, count: int, max_tokens: int) -> list[BenchRequest]:
    """The shared system prompt and a varied question: chat, or the same text as a completion.
    Their prompt lengths are not known here (0): the server's usage reports them."""
    requests = []
    for index in range(count):
        question = f"{QUESTIONS[index % len(QUESTIONS)]} (customer {index})"
        if model["chat"]:
            messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question}]
            requests.append(BenchRequest(index, "chat", None, messages, 0, max_tokens))
        else:
            requests.append(BenchRequest(index, "completions", f"{SYSTEM_PROMPT}\nQ: {question}\nA:", None, 0, max_tokens))
    return requests


async def _load(url: str, model: dict, requests: int, concurrency: int, max_tokens: int) -> dict[str, Any]:
    """All requests at once, `concurrency` in flight (bench/serve_client.py sends and times them)."""
    async with httpx.AsyncClient(base_url=url, timeout=60, trust_env=False) as client:
        cached_before = _cache_hits((await client.get("/metrics")).text)
        records, wall = await send_all(
            url, _requests(model, requests, max_tokens), SendOptions(model=model["name"]), [0.0] * requests, concurrency
        )
        cached = _cache_hits((await client.get("/metrics")).text) - cached_before
    done = [r for r in records if r.success]
    ttfts = [r.ttft_s for r in done if r.ttft_s is not None]
    return {
        "requests": requests, "errors": [r.error for r in records if not r.success], "wall_s": round(wall, 3),
        "req_per_s": round(len(done) / wall, 3),
        "output_tok_per_s": round(sum(r.output_tokens for r in done) / wall, 1),
        "ttft_p50_s": round(median(ttfts), 4) if ttfts else None,
        "cached_tokens": int(cached),
        "replicas_used": sorted({r.replica for r in done if r.replica is not None}),
    }


def _cache_hits(prometheus_text: str) -> float:
    """graphexec_prefix_cache_hit_tokens_total: the server's own (dp=1) or the replicas' total (dp>1)."""
    total = 0.0
    for line in prometheus_text.splitlines():
        if line.startswith("graphexec_prefix_cache_hit_tokens_total"):
            labels = line.partition("{")[2].partition("}")[0]
            if not labels or 'replica="total"' in labels:
                total += float(line.rsplit(" ", 1)[1])
    return total


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    for name in args.models:
        model = MODELS[name]
        for dp in args.dp:
            overrides = [*model["overrides"], f"capture={args.capture}", f"parallel.dp_size={dp}"]
            print(f"graphexec-bench dp: {name} dp={dp} ...", file=sys.stderr, flush=True)
            with tempfile.TemporaryDirectory(prefix="bench-dp-") as logs:
                with launched_server(overrides, Path(logs), args.start_timeout_s) as target:
                    # One untimed request per replica: first-call costs stay out of the load.
                    asyncio.run(_load(target.url, model, dp, dp, 2))
                    result = _load(target.url, model, args.requests, args.concurrency, args.max_tokens)
                    threads = threads_per_replica_rank(dp, 1, None)
                    row = {"model": name, "dp": dp, "threads_per_replica": threads, "start_s": round(target.start_seconds, 1),
                           **asyncio.run(result)}
            rows.append(row)
    return rows


def report(rows: list[dict[str, Any]]) -> str:
    return machine_line() + "\n\n" + table(
        ["model", "dp", "threads each", "req/s", "output tok/s", "TTFT p50 s", "cached tokens", "replicas used", "errors",
         "start s"],
        [[r["model"], r["dp"], r["threads_per_replica"], r["req_per_s"], r["output_tok_per_s"], r["ttft_p50_s"],
          r["cached_tokens"], ",".join(r["replicas_used"]) or "-", len(r["errors"]), r["start_s"]] for r in rows])


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=["tiny"])
    parser.add_argument("--dp", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--capture", default="eager", help="capture plan of every replica (eager starts fastest)")
    parser.add_argument("--start-timeout-s", type=float, default=900.0)
    parser.add_argument("--json", type=Path, help="write the rows here too")
    args = parser.parse_args(argv)
    if any(dp < 1 for dp in args.dp) or args.requests < 1 or args.concurrency < 1 or args.max_tokens < 1:
        parser.error("--dp, --requests, --concurrency and --max-tokens must be >= 1")
    rows = run(args)
    print(report(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
