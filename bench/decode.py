"""Decode suite: per batch-size bucket, one decode step eager vs the plan's decode backend, paired
in one process (A B A B ...); capture cost in this process alongside (the capture suite measures
cold and warm starts in fresh processes)."""

from __future__ import annotations

from typing import Any

import torch
from tqdm import tqdm

from bench.report import Bars, Report, Table
from bench.tables import times
from bench.timing import device_sync, paired_ms
from graphexec.batch.forward_mode import ForwardMode
from graphexec.engine.threads import call_in_thread


def run(cfg, ctx) -> dict[str, Any]:
    from bench.suites import build_engine

    engine = build_engine(cfg)
    runner = engine.runner
    graph = runner.backends[ForwardMode.DECODE]
    buckets = list(getattr(graph, "buckets", [1, 8]))
    # Timed on a thread that ends, so the engine loop measured below is the only OpenMP master
    # (graphexec/engine/threads.py).
    rows = call_in_thread(lambda: _paired_buckets(engine, graph, buckets, cfg, ctx.progress))
    result = {"backend": graph.name, "context_len": cfg.bench.context_len, "buckets": rows}
    if cfg.bench.host_batch:
        result["host"] = _host_overhead(engine, cfg.bench.host_batch, cfg.bench.context_len, cfg.bench.host_steps)
    engine.shutdown()
    return result


def _paired_buckets(engine, graph, buckets: list[int], cfg, progress: bool) -> list[dict[str, Any]]:
    return [paired_bucket(engine, graph, bucket, cfg.bench.context_len, cfg.bench.rounds, cfg.bench.steps)
            for bucket in tqdm(buckets, desc="decode buckets", disable=not progress)]


def paired_bucket(engine, graph, bucket: int, context_len: int, rounds: int, steps: int) -> dict[str, Any]:
    """One decode step of `bucket` requests with `context_len` tokens of KV each: eager against
    `graph`, paired; the largest difference of their hidden rows (same batch, same slots); what
    capturing the bucket cost in this process.  (gpu_check's decode_graph part runs it too.)"""
    runner = engine.runner
    fb, release = decode_batch(engine, bucket, context_len)
    sides = {"eager": lambda: runner.execute(runner.eager, fb)}
    if graph is not runner.eager:  # capture=eager: nothing to pair against
        sides[graph.name] = lambda: runner.execute(graph, fb)
    try:
        with torch.inference_mode():
            hidden = [fn().float() for fn in (sides["eager"], sides.get(graph.name, sides["eager"]))]
            diff = float((hidden[0] - hidden[1]).abs().max())
            timings = paired_ms(sides, rounds, steps, device_sync(runner.device))
    finally:
        release()
    timings.setdefault(graph.name, timings["eager"])
    return {"bucket": bucket, "eager": timings["eager"], graph.name: timings[graph.name],
            "speedup": timings["eager"]["median_ms"] / timings[graph.name]["median_ms"],
            "max_abs_hidden_diff": diff,
            "capture_seconds": graph.stats.capture_seconds.get(bucket),
            "capture_mib": graph.stats.capture_bytes.get(bucket, 0) / 2**20}


def _host_overhead(engine, batch_size: int, context_len: int, new_tokens: int) -> dict[str, Any]:
    """`batch_size` requests decoding together through the whole engine, each step timed by part."""
    from bench.host_overhead import breakdown, step_timers
    from graphexec import SamplingParams

    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, engine.model_config.vocab_size, (context_len,), generator=gen).tolist()
               for _ in range(batch_size)]
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    engine.generate(prompts, SamplingParams(max_new_tokens=2, ignore_eos=True))  # warm-up
    with step_timers(engine) as records:
        engine.generate(prompts, params)
    return {"batch_size": batch_size} | breakdown(records, "decode")


def decode_batch(engine, batch_size: int, context_len: int):
    """`batch_size` requests whose KV holds `context_len` tokens, ready for one decode step."""
    from graphexec import SamplingParams
    from graphexec.batch.request import Req

    runner = engine.runner
    gen = torch.Generator().manual_seed(batch_size)
    vocab = engine.model_config.vocab_size
    reqs = [
        Req(f"bench{i}", torch.randint(3, vocab, (context_len,), generator=gen).tolist(),
            SamplingParams(max_new_tokens=2, ignore_eos=True), (), engine.max_context)
        for i in range(batch_size)
    ]
    prefill = engine.scheduler.plan_extend(reqs)
    runner.forward(runner.init_forward_batch(prefill))
    for req in reqs:
        req.num_computed_tokens = req.seq_len
        req.output_ids.append(5)
    decode = engine.scheduler.plan_decode(reqs)

    def release() -> None:
        for req in reqs:
            engine.scheduler.release(req, cache=False)

    # Re-running this batch rewrites the same slots, so every timed step sees the same state.
    return runner.init_forward_batch(decode), release


def report(result: dict[str, Any]) -> Report:
    name, rows, host = result["backend"], result["buckets"], result.get("host")
    columns = ["bucket", "eager ms", f"{name} ms", "speedup", "max |hidden − eager|", "capture s (this process)",
               "capture MiB"]
    out = Report([Table(columns, [[r["bucket"], r["eager"], r[name], times(r["speedup"]), r["max_abs_hidden_diff"],
                                   r["capture_seconds"], r["capture_mib"]] for r in rows])])
    latency = {side: [r[side]["median_ms"] for r in rows] for side in ("eager", name)}
    out.plots.append(Bars("decode_latency.png", f"decode step, KV {result['context_len']} tokens", "ms (median)",
                          [r["bucket"] for r in rows], latency, xlabel="batch-size bucket"))
    for r in rows:
        out.summary[f"B={r['bucket']} {name} ms"] = r[name]["median_ms"]
        out.summary[f"B={r['bucket']} speedup"] = r["speedup"]
    if host:
        parts = ("step_ms", "forward_ms", "logits_sample_ms", "scheduler_ms", "publish_ms")
        out.blocks += [f"Where a decode step of {host['batch_size']} requests goes, through the whole engine "
                       f"(mean of {host['steps']} steps):",
                       Table(["step ms", "model forward", "logits + sampling", "scheduler + batch building",
                              "publishing", "host overhead"],
                             [[*(host[k] for k in parts), f"{host['host_fraction']:.1%}"]])]
        out.summary[f"host overhead at B={host['batch_size']}"] = host["host_fraction"]
    return out
