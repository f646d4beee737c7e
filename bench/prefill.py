"""Prefill suite: per token bucket, eager vs each piecewise variant, paired in one process, and
what capturing each variant costs (seconds and memory per bucket, in this process)."""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from bench.decode import new_requests
from bench.report import Bars, Report, Table
from bench.suites import build_engine
from bench.tables import times
from bench.timing import device_sync, paired_ms
from capture import create_backend


def run(cfg, ctx) -> dict[str, Any]:
    engine = build_engine(cfg)
    runner, buckets, variants = engine.runner, list(cfg.bench.buckets), {}
    for name in cfg.bench.variants:
        variants[name] = create_backend(name, runner.capture_env, {"buckets": buckets, "progress": False}, "bench.variants")
        runner.capture_backend(variants[name])
    rows = []
    for bucket in tqdm(buckets, desc="prefill buckets", disable=not ctx.progress):
        fb, release = extend_batch(engine, bucket)
        sides = {name: (lambda b=b: runner.execute(b, fb)) for name, b in {"eager": runner.eager, **variants}.items()}
        with torch.inference_mode():
            t = paired_ms(sides, cfg.bench.rounds, cfg.bench.steps, device_sync(runner.device))
        release()
        rows.append({"bucket": bucket, "eager": t["eager"]} | {
            name: t[name] | {"speedup": t["eager"]["median_ms"] / t[name]["median_ms"],
                             "capture_seconds": b.stats.capture_seconds.get(bucket),
                             "capture_mib": b.stats.capture_bytes.get(bucket, 0) / 2**20}
            for name, b in variants.items()})
    return {"variants": list(variants), "buckets": rows,
            "lines_of_code": {name: _lines_of_code(type(b)) for name, b in variants.items()}}


def extend_batch(engine, tokens: int):
    """One prefill batch of exactly `tokens` new tokens (two requests), and how to free it."""
    reqs, hand, release = new_requests(engine, [tokens // 2, tokens - tokens // 2] if tokens > 1 else [1], tokens, "prefill", 1)
    return engine.runner.init_forward_batch(hand.extend(reqs)), release


# What each variant is built from: its module, the shared piecewise base and the segmented-capture
# modules its CUDA path records with (the op tape is a test double for CUDA graphs, not counted).
_SHARED = ("capture.piecewise", "capture.break_points", "capture.segments", "capture.recorders")
_IMPLEMENTATION = {"breakable": ("capture.breakable", *_SHARED),
                   "tc_piecewise": ("capture.tc_piecewise", "capture.graph_split", *_SHARED)}


def _lines_of_code(cls) -> int:
    """Non-blank, non-comment lines of the modules a variant is built from."""
    modules = _IMPLEMENTATION.get(cls.name, (cls.__module__, *_SHARED))
    files = {Path(inspect.getfile(importlib.import_module(m))) for m in modules}
    return sum(1 for f in files for line in f.read_text().splitlines() if line.strip() and not line.strip().startswith("#"))


def report(result: dict[str, Any]) -> Report:
    names, rows = result["variants"], result["buckets"]
    groups = [r["bucket"] for r in rows]
    loc = ", ".join(f"{n} {c}" for n, c in result["lines_of_code"].items())
    table = Table(["tokens", "eager ms", *(c for n in names for c in (f"{n} ms", f"{n} ×", f"{n} capture s"))],
                  [[r["bucket"], r["eager"]["median_ms"],
                    *(c for n in names for c in (r[n]["median_ms"], times(r[n]["speedup"]), r[n]["capture_seconds"]))]
                   for r in rows])
    out = Report([table, f"lines of code (variant, piecewise base, segmented capture): {loc}"])
    latency = {n: [r[n]["median_ms"] for r in rows] for n in ["eager", *names]}
    out.plots = [Bars("prefill_latency.png", "prefill forward", "ms (median)", groups, latency, "token bucket", log_y=True),
                 Bars("prefill_capture.png", "capture cost (this process)", "seconds", groups,
                      {n: [r[n]["capture_seconds"] for r in rows] for n in names}, "token bucket")]
    for r in rows:
        out.summary[f"{r['bucket']} tok eager ms"] = r["eager"]["median_ms"]
        out.summary |= {f"{r['bucket']} tok {n} ×": r[n]["speedup"] for n in names}
    return out
