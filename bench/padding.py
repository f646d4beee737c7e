"""Padding suite: what a live decode batch costs when padded up to its bucket, per bucket set, against
eager at exactly that size (configs/bench/padding.yaml).  Each bucket a set picks is timed through one
full_graph backend's own `prepare` offered only that bucket, so the real padding path runs."""

from __future__ import annotations

import copy
from statistics import mean
from typing import Any, Sequence

import torch
from omegaconf import OmegaConf
from tqdm import tqdm

from bench.decode import decode_batch
from bench.report import Bars, Report, Table
from bench.suites import build_engine
from bench.tables import cell, times
from bench.timing import device_sync, paired_ms
from capture import create_backend
from capture.buckets import bucket_for, validate_buckets
from capture.full_graph import FullGraphBackend
from graphexec.batch.forward_mode import ForwardMode


def plan_set(buckets: Sequence[int], batch_sizes: Sequence[int]) -> list[dict[str, Any]]:
    """Per batch size: the bucket this set pads it to (None: runs eager) and the rows wasted."""
    picks = [(size, bucket_for(size, buckets)) for size in batch_sizes]
    return [{"batch_size": size, "bucket": b, "runs": "eager" if b is None else "graph",
             "wasted_rows": 0 if b is None else b - size, "wasted_fraction": 0.0 if b is None else (b - size) / b}
            for size, b in picks]


def set_label(buckets: Sequence[int]) -> str:
    return "[" + ",".join(map(str, buckets)) + "]"


def run(cfg, ctx) -> dict[str, Any]:
    bench = cfg.bench
    sets = [validate_buckets(list(s), f"bench.bucket_sets[{i}]") for i, s in enumerate(bench.bucket_sets)]
    batch_sizes = validate_buckets(sorted(set(bench.batch_sizes)), "bench.batch_sizes")
    if batch_sizes[-1] > (limit := cfg.scheduler.max_running_requests):
        raise ValueError(f"bench.batch_sizes go up to {batch_sizes[-1]}; scheduler.max_running_requests is {limit}")
    union, raw = sorted({b for s in sets for b in s}), OmegaConf.to_container(cfg, resolve=True)
    # The backend over the union: the plan's full_graph decode options (compile settings) if it has them.
    decode = raw["capture"]["decode"]
    options = {k: v for k, v in decode.items() if k != "backend"} if decode.get("backend") == "full_graph" else {}
    options |= {"buckets": union, "progress": False, "lazy": False} | ({"graph": bench.graph} if bench.get("graph") else {})
    # The engine only prefills the timed requests and provides eager, so it runs eager
    # everywhere rather than capturing graphs of the plan this suite never uses.
    raw["capture"] = {"name": "eager"} | {mode.config_key: {"backend": "eager"} for mode in ForwardMode}
    engine = build_engine(OmegaConf.create(raw))
    runner, plans = engine.runner, [plan_set(s, batch_sizes) for s in sets]
    backend = create_backend("full_graph", runner.capture_env, options, "bench.padding")
    runner.capture_backend(backend)
    policy, measured = runner.capture_env.padding, []
    for size in tqdm(batch_sizes, desc="live batch sizes", disable=not ctx.progress):
        buckets = sorted({row["bucket"] for plan in plans for row in plan if row["batch_size"] == size} - {None})
        fb, release = decode_batch(engine, size, bench.context_len)
        sides = {"eager": lambda: runner.execute(runner.eager, fb)}
        sides |= {f"bucket {b}": (lambda p=_pinned(backend, b): runner.execute(p, fb)) for b in buckets}
        with torch.inference_mode():
            t = paired_ms(sides, bench.rounds, bench.steps, device_sync(runner.device))
            # StaticInputs.load takes microseconds: 200 calls per timed round.
            pad = {b: paired_ms({"load": lambda b=b: backend.buffers.load(fb, b, policy)}, bench.rounds, 200)
                   for b in buckets}
        release()
        measured.append({"batch_size": size, "eager": t["eager"], "buckets": [
            t[f"bucket {b}"] | {"bucket": b, "pad_us": pad[b]["load"]["median_ms"] * 1e3} for b in buckets]})
    return {"backend": backend.name, "graph": backend.mechanism, "context_len": bench.context_len,
            "captured_buckets": union, "capture_seconds": [backend.stats.capture_seconds.get(b) for b in union],
            "batch_sizes": list(batch_sizes), "measured": measured, "sets": _per_set(sets, plans, measured)}


def _pinned(backend: FullGraphBackend, bucket: int) -> FullGraphBackend:
    """The backend offering only `bucket`: its own prepare() then pads every batch to it.
    A shallow copy shares the captured graphs and static buffers; the counters are its own."""
    view = copy.copy(backend)
    view.buckets, view.stats = (bucket,), type(backend.stats)()
    return view


def _per_set(sets, plans, measured) -> list[dict[str, Any]]:
    by_size, out = {m["batch_size"]: m for m in measured}, []
    for buckets, plan in zip(sets, plans):
        rows = []
        for row in plan:
            m = by_size[row["batch_size"]]
            t = m["eager"] if row["bucket"] is None else next(t for t in m["buckets"] if t["bucket"] == row["bucket"])
            rows.append(row | {"ms": t["median_ms"], "min_ms": t["min_ms"], "max_ms": t["max_ms"],
                               "pad_us": t.get("pad_us"), "vs_eager": t["median_ms"] / m["eager"]["median_ms"]})
        out.append({"buckets": list(buckets), "label": set_label(buckets), "rows": rows,
                    "mean_wasted_fraction": mean(r["wasted_fraction"] for r in rows), "mean_ms": mean(r["ms"] for r in rows),
                    "eager_at": [r["batch_size"] for r in rows if r["runs"] == "eager"]})
    # The finest set wastes least (ties: the one listed first); the others are priced against it.
    finest = min(out, key=lambda s: s["mean_wasted_fraction"])
    for s in out:
        s |= {"vs_finest": mean(r["ms"] / f["ms"] for r, f in zip(s["rows"], finest["rows"])), "finest": finest["label"]}
    return out


def report(result: dict[str, Any]) -> Report:
    sizes, sets = result["batch_sizes"], result["sets"]
    caps = ", ".join(f"{b}: {cell(s)}" for b, s in zip(result["captured_buckets"], result["capture_seconds"]))
    out = Report([f"Decode step, KV {result['context_len']} tokens per request; {result['backend']} ({result['graph']}) "
                  f"captured once over buckets {result['captured_buckets']} (capture s per bucket: {caps}). "
                  "Times are medians of paired rounds; `eager` rows are batches above the set's largest bucket."])
    for s in sets:
        rows = [[r["batch_size"], r["bucket"] or "eager", r["wasted_rows"], f"{r['ms']:.2f} ({r['min_ms']:.2f}–"
                 f"{r['max_ms']:.2f})", times(r["vs_eager"]), r["pad_us"]] for r in s["rows"]]
        out.blocks.append(Table(["B", "bucket", "wasted rows", "ms (min–max)", "× vs eager exact", "pad µs"], rows,
                                f"bucket set {s['label']}"))
        out.summary |= {f"{s['label']} mean wasted fraction": s["mean_wasted_fraction"],
                        f"{s['label']} mean ms": s["mean_ms"], f"{s['label']} × vs finest": s["vs_finest"]}
    out.blocks += [f"### across sets\n\nOver B = {sizes}; × vs finest is the mean per-B latency ratio against "
                   f"{sets[0]['finest']}.",
                   Table(["bucket set", "mean wasted fraction", "mean ms", "× vs finest", "eager at B"],
                         [[s["label"], f"{s['mean_wasted_fraction']:.1%}", s["mean_ms"], times(s["vs_finest"]),
                           ", ".join(map(str, s["eager_at"])) or None] for s in sets])]
    latency = {"eager (exact B)": [m["eager"]["median_ms"] for m in result["measured"]]}
    latency |= {s["label"]: [r["ms"] for r in s["rows"]] for s in sets}
    out.plots = [Bars("padding_latency.png", f"decode step padded to its bucket, KV {result['context_len']} tokens",
                      "ms (median)", sizes, latency, "live batch size"),
                 Bars("padding_waste.png", "padded rows per step", "% of rows computed that are padding", sizes,
                      {s["label"]: [100 * r["wasted_fraction"] for r in s["rows"]] for s in sets}, "live batch size")]
    return out
