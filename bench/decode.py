"""Decode suite: per batch-size bucket, one decode step eager vs the plan's decode backend, paired in one
process (A B A B ...), with its capture cost in this process (the capture suite measures fresh ones)."""

from __future__ import annotations

from typing import Any, Sequence

import torch
from tqdm import tqdm

from bench.host_overhead import breakdown, step_timers
from bench.report import Bars, Report, Table
from bench.suites import build_engine
from bench.tables import times
from bench.timing import device_sync, paired_ms
from graphexec import SamplingParams
from graphexec.batch.forward_mode import ForwardMode
from graphexec.batch.request import Req
from graphexec.engine.threads import call_in_thread
from graphexec.scheduler.hand_batches import HandBatches

_HOST_PARTS = {"step_ms": "step ms", "forward_ms": "model forward", "logits_sample_ms": "logits + sampling",
               "scheduler_ms": "scheduler + batch building", "publish_ms": "publishing"}


def run(cfg, ctx) -> dict[str, Any]:
    b, engine = cfg.bench, build_engine(cfg)
    graph = engine.runner.backends[ForwardMode.DECODE]
    buckets = tqdm(list(getattr(graph, "buckets", [1, 8])), desc="decode buckets", disable=not ctx.progress)
    # Timed on a thread that ends, so the engine loop measured below is the only OpenMP master (graphexec/engine/threads.py).
    rows = call_in_thread(lambda: [paired_bucket(engine, graph, n, b.context_len, b.rounds, b.steps) for n in buckets])
    result = {"backend": graph.name, "context_len": b.context_len, "buckets": rows}
    if b.host_batch:  # that many requests decoding together through the whole engine, each step timed by part
        gen = torch.Generator().manual_seed(0)
        prompts = torch.randint(100, engine.model_config.vocab_size, (b.host_batch, b.context_len), generator=gen).tolist()
        engine.generate(prompts, SamplingParams(max_new_tokens=2, ignore_eos=True))  # warm-up
        with step_timers(engine) as records:
            engine.generate(prompts, SamplingParams(max_new_tokens=b.host_steps, ignore_eos=True))
        result["host"] = {"batch_size": b.host_batch} | breakdown(records, "decode")
    engine.shutdown()
    return result


def paired_bucket(engine, graph, bucket: int, context_len: int, rounds: int, steps: int) -> dict[str, Any]:
    """One decode step of `bucket` requests with `context_len` tokens of KV each: eager against
    `graph`, paired; the largest difference of their hidden rows (same batch, same slots); what
    capturing the bucket cost in this process.  (gpu_check's decode_graph part runs it too.)"""
    runner = engine.runner
    fb, release = decode_batch(engine, bucket, context_len)
    # Under capture=eager the graph is eager itself: one side, paired with nothing.
    sides = {"eager": lambda: runner.execute(runner.eager, fb), graph.name: lambda: runner.execute(graph, fb)}
    try:
        with torch.inference_mode():
            diff = float((sides["eager"]().float() - sides[graph.name]().float()).abs().max())
            t = paired_ms(sides, rounds, steps, device_sync(runner.device))
    finally:
        release()
    return {"bucket": bucket, "eager": t["eager"], graph.name: t[graph.name],
            "speedup": t["eager"]["median_ms"] / t[graph.name]["median_ms"], "max_abs_hidden_diff": diff,
            "capture_seconds": graph.stats.capture_seconds.get(bucket),
            "capture_mib": graph.stats.capture_bytes.get(bucket, 0) / 2**20}


def new_requests(engine, lengths: Sequence[int], seed: int, prefix: str = "bench", max_new_tokens: int = 2):
    """Unscheduled requests with seeded random prompts of `lengths` tokens, the hand batches that
    run them, and how to release them."""
    gen = torch.Generator().manual_seed(seed)
    reqs = [Req(f"{prefix}{i}", torch.randint(3, engine.model_config.vocab_size, (n,), generator=gen).tolist(),
                SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True), (), engine.max_context)
            for i, n in enumerate(lengths)]
    hand = HandBatches(engine.kv_cache)

    def release() -> None:
        for req in reqs:
            hand.release(req, cache=False)

    return reqs, hand, release


def decode_batch(engine, batch_size: int, context_len: int):
    """`batch_size` requests whose KV holds `context_len` tokens, ready for one decode step."""
    runner = engine.runner
    reqs, hand, release = new_requests(engine, [context_len] * batch_size, batch_size)
    prefill = hand.extend(reqs)
    runner.forward(runner.init_forward_batch(prefill))
    hand.ran(prefill, [5] * batch_size)
    # Re-running this batch rewrites the same slots, so every timed step sees the same state.
    return runner.init_forward_batch(hand.decode(reqs)), release


def report(result: dict[str, Any]) -> Report:
    name, rows, host = result["backend"], result["buckets"], result.get("host")
    out = Report([Table(["bucket", "eager ms", f"{name} ms", "speedup", "max |hidden − eager|", "capture s (this process)",
                         "capture MiB"], [[r["bucket"], r["eager"], r[name], times(r["speedup"]), r["max_abs_hidden_diff"],
                                           r["capture_seconds"], r["capture_mib"]] for r in rows])])
    latency = {side: [r[side]["median_ms"] for r in rows] for side in ("eager", name)}
    out.plots.append(Bars("decode_latency.png", f"decode step, KV {result['context_len']} tokens", "ms (median)",
                          [r["bucket"] for r in rows], latency, xlabel="batch-size bucket"))
    for r in rows:
        out.summary |= {f"B={r['bucket']} {name} ms": r[name]["median_ms"], f"B={r['bucket']} speedup": r["speedup"]}
    if host:
        out.blocks += [f"Where a decode step of {host['batch_size']} requests goes, through the whole engine "
                       f"(mean of {host['steps']} steps):",
                       Table([*_HOST_PARTS.values(), "host overhead"],
                             [[*(host[k] for k in _HOST_PARTS), f"{host['host_fraction']:.1%}"]])]
        out.summary[f"host overhead at B={host['batch_size']}"] = host["host_fraction"]
    return out
