"""Data-parallel replicas against one: `graphexec-serve` at each `parallel.dp_size`, the same load.

    python -m bench.dp [--models tiny smol] [--dp 1 2] [--requests 48] [--concurrency 8] [--json out.json]

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
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench.serve_server import launched_server
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


def _request(model: dict, index: int, max_tokens: int) -> tuple[str, dict]:
    question = f"{QUESTIONS[index % len(QUESTIONS)]} (customer {index})"
    common = {"model": model["name"], "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0, "stream": True}
    if model["chat"]:
        messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question}]
        return "/v1/chat/completions", common | {"messages": messages}
    return "/v1/completions", common | {"prompt": f"{SYSTEM_PROMPT}\nQ: {question}\nA:"}


async def _one(client: httpx.AsyncClient, path: str, body: dict) -> dict:
    """Time to the first streamed token and the chunks that carried text."""
    started = time.perf_counter()
    ttft, chunks = None, 0
    async with client.stream("POST", path, json=body) as answer:
        if answer.status_code != 200:
            return {"error": f"{answer.status_code}: {(await answer.aread())[:300]!r}"}
        async for line in answer.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            text = choice.get("text") or (choice.get("delta") or {}).get("content")
            if text:
                ttft = ttft if ttft is not None else time.perf_counter() - started
                chunks += 1
    return {"ttft": ttft, "chunks": chunks, "replica": answer.headers.get("x-graphexec-replica")}


async def _load(url: str, model: dict, requests: int, concurrency: int, max_tokens: int) -> dict[str, Any]:
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=600, trust_env=False) as client:

        async def bounded(i: int) -> dict:
            async with gate:
                return await _one(client, *_request(model, i, max_tokens))

        cached_before = _cache_hits((await client.get("/metrics")).text)
        started = time.perf_counter()
        results = await asyncio.gather(*(bounded(i) for i in range(requests)))
        wall = time.perf_counter() - started
        cached = _cache_hits((await client.get("/metrics")).text) - cached_before
    errors = [r["error"] for r in results if "error" in r]
    done = [r for r in results if "error" not in r]
    ttfts = [r["ttft"] for r in done if r["ttft"] is not None]
    replicas = sorted({r["replica"] for r in done if r["replica"] is not None})
    return {
        "requests": requests, "errors": errors, "wall_s": round(wall, 3),
        "req_per_s": round(len(done) / wall, 3),
        "output_tok_per_s": round(len(done) * max_tokens / wall, 1),  # ignore_eos: every request gives max_tokens
        "ttft_p50_s": round(statistics.median(ttfts), 4) if ttfts else None,
        "cached_tokens": int(cached),
        "replicas_used": replicas,
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
            print(f"bench.dp: {name} dp={dp} ...", file=sys.stderr, flush=True)
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


def table(rows: list[dict[str, Any]]) -> str:
    head = "| model | dp | threads each | req/s | output tok/s | TTFT p50 s | cached tokens | replicas used | errors | start s |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['dp']} | {r['threads_per_replica']} | {r['req_per_s']} | {r['output_tok_per_s']} | {r['ttft_p50_s']} | "
            f"{r['cached_tokens']} | {','.join(r['replicas_used']) or '-'} | {len(r['errors'])} | {r['start_s']} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.dp", description=__doc__.split("\n\n")[0])
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
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
