"""Prefill suite: per token bucket, eager vs each piecewise variant, paired in one process, and
what capturing each variant costs (seconds and memory per bucket, in this process)."""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from bench.report import Bars, Report, Table
from bench.tables import times
from bench.timing import device_sync, paired_ms
from capture import create_backend


def run(cfg, ctx) -> dict[str, Any]:
    from bench.suites import build_engine

    engine = build_engine(cfg)
    runner = engine.runner
    buckets = list(cfg.bench.buckets)
    variants = {}
    for name in cfg.bench.variants:
        backend = create_backend(name, runner.capture_env, {"buckets": buckets, "progress": False}, "bench.variants")
        runner.capture_backend(backend)
        variants[name] = backend
    rows = []
    for bucket in tqdm(buckets, desc="prefill buckets", disable=not ctx.progress):
        fb, release = extend_batch(engine, bucket)
        sides = {"eager": lambda: runner.execute(runner.eager, fb)}
        sides |= {name: (lambda b=b: runner.execute(b, fb)) for name, b in variants.items()}
        with torch.inference_mode():
            timings = paired_ms(sides, cfg.bench.rounds, cfg.bench.steps, device_sync(runner.device))
        row = {"bucket": bucket, "eager": timings["eager"]}
        for name, backend in variants.items():
            row[name] = timings[name] | {
                "speedup": timings["eager"]["median_ms"] / timings[name]["median_ms"],
                "capture_seconds": backend.stats.capture_seconds.get(bucket),
                "capture_mib": backend.stats.capture_bytes.get(bucket, 0) / 2**20,
            }
        rows.append(row)
        release()
    loc = {name: _lines_of_code(type(b)) for name, b in variants.items()}
    return {"variants": list(variants), "buckets": rows, "lines_of_code": loc}


def extend_batch(engine, tokens: int):
    """One prefill batch of exactly `tokens` new tokens (two requests), and how to free it."""
    from graphexec import SamplingParams
    from graphexec.batch.request import Req

    runner = engine.runner
    gen = torch.Generator().manual_seed(tokens)
    sizes = [tokens // 2, tokens - tokens // 2] if tokens > 1 else [1]
    reqs = [
        Req(f"prefill{i}", torch.randint(3, engine.model_config.vocab_size, (n,), generator=gen).tolist(),
            SamplingParams(max_new_tokens=1), (), engine.max_context)
        for i, n in enumerate(sizes)
    ]
    batch = engine.scheduler.plan_extend(reqs)

    def release() -> None:
        for req in reqs:
            engine.scheduler.release(req, cache=False)

    return runner.init_forward_batch(batch), release


# What each variant is built from: its module, the shared piecewise base and the segmented-capture
# modules its CUDA path records with (the op tape is a test double for CUDA graphs, not counted).
_SHARED = ("capture.piecewise", "capture.break_points", "capture.segments", "capture.recorders")
_IMPLEMENTATION = {
    "breakable": ("capture.breakable", *_SHARED),
    "tc_piecewise": ("capture.tc_piecewise", "capture.graph_split", *_SHARED),
}


def _lines_of_code(cls) -> int:
    """Non-blank, non-comment lines of the modules a variant is built from."""
    modules = _IMPLEMENTATION.get(cls.name, (cls.__module__, *_SHARED))
    files = {Path(inspect.getfile(importlib.import_module(m))) for m in modules}
    return sum(
        1 for f in files for line in f.read_text().splitlines() if line.strip() and not line.strip().startswith("#")
    )


def report(result: dict[str, Any]) -> Report:
    names, rows = result["variants"], result["buckets"]
    groups = [r["bucket"] for r in rows]
    loc = ", ".join(f"{n} {c}" for n, c in result["lines_of_code"].items())
    out = Report([
        Table(["tokens", "eager ms", *(c for n in names for c in (f"{n} ms", f"{n} ×", f"{n} capture s"))],
              [[r["bucket"], r["eager"]["median_ms"],
                *(c for n in names for c in (r[n]["median_ms"], times(r[n]["speedup"]), r[n]["capture_seconds"]))]
               for r in rows]),
        f"lines of code (variant, piecewise base, segmented capture): {loc}",
    ])
    latency = {"eager": [r["eager"]["median_ms"] for r in rows]} | {n: [r[n]["median_ms"] for r in rows] for n in names}
    out.plots = [
        Bars("prefill_latency.png", "prefill forward", "ms (median)", groups, latency, "token bucket", log_y=True),
        Bars("prefill_capture.png", "capture cost (this process)", "seconds", groups,
             {n: [r[n]["capture_seconds"] for r in rows] for n in names}, "token bucket"),
    ]
    for r in rows:
        out.summary[f"{r['bucket']} tok eager ms"] = r["eager"]["median_ms"]
        out.summary |= {f"{r['bucket']} tok {n} ×": r[n]["speedup"] for n in names}
    return out
