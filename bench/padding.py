"""Padding suite: what a live decode batch costs when padded up to its bucket, per bucket set.

One full_graph backend is captured over the union of all bucket sets (a bucket's graph is the
same whichever set lists it).  For each live batch size B, each distinct bucket some set would
pick is timed through the backend's own `prepare` with only that bucket offered, so the real
padding path runs; eager at exactly B is the unpadded reference, all paired in one process.
A B above a set's largest bucket runs eager under that set, as the engine would run it.
"""

from __future__ import annotations

import copy
from typing import Any, Sequence

import torch
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from bench.report import Bars, Report, Table
from bench.tables import cell, times
from bench.timing import device_sync, paired_ms
from capture.buckets import bucket_for, validate_buckets
from capture.full_graph import FullGraphBackend
from graphexec.batch.forward_mode import ForwardMode

PAD_CALLS = 200  # StaticInputs.load takes microseconds: average many calls per timed round


def plan_set(buckets: Sequence[int], batch_sizes: Sequence[int]) -> list[dict[str, Any]]:
    """Per batch size: the bucket this set pads it to (None: runs eager) and the rows wasted."""
    rows = []
    for size in batch_sizes:
        bucket = bucket_for(size, buckets)
        wasted = 0 if bucket is None else bucket - size
        rows.append({
            "batch_size": size, "bucket": bucket, "runs": "eager" if bucket is None else "graph",
            "wasted_rows": wasted, "wasted_fraction": 0.0 if bucket is None else wasted / bucket,
        })
    return rows


def set_label(buckets: Sequence[int]) -> str:
    return "[" + ",".join(str(b) for b in buckets) + "]"


def run(cfg, ctx) -> dict[str, Any]:
    from bench.decode import decode_batch
    from bench.suites import build_engine
    from capture import create_backend

    bench = cfg.bench
    sets = [validate_buckets(list(s), f"bench.bucket_sets[{i}]") for i, s in enumerate(bench.bucket_sets)]
    batch_sizes = validate_buckets(sorted(set(bench.batch_sizes)), "bench.batch_sizes")
    limit = cfg.scheduler.max_running_requests
    if batch_sizes[-1] > limit:
        raise ValueError(f"bench.batch_sizes go up to {batch_sizes[-1]}; scheduler.max_running_requests is {limit}")
    union = sorted({b for s in sets for b in s})
    # The engine only prefills the timed requests and provides eager, so it runs eager
    # everywhere rather than capturing graphs of the plan this suite never uses.
    engine = build_engine(_eager_plan(cfg))
    runner = engine.runner
    backend = create_backend("full_graph", runner.capture_env, _backend_options(cfg, union), "bench.padding")
    runner.capture_backend(backend)
    policy = runner.capture_env.padding
    plans = [plan_set(s, batch_sizes) for s in sets]
    measured = []
    for size in tqdm(batch_sizes, desc="live batch sizes", disable=not ctx.progress):
        buckets = sorted({row["bucket"] for plan in plans for row in plan if row["batch_size"] == size} - {None})
        fb, release = decode_batch(engine, size, bench.context_len)
        sides = {"eager": lambda: runner.execute(runner.eager, fb)}
        sides |= {f"bucket {b}": (lambda p=_pinned(backend, b): runner.execute(p, fb)) for b in buckets}
        with torch.inference_mode():
            timings = paired_ms(sides, bench.rounds, bench.steps, device_sync(runner.device))
            pad = {b: paired_ms({"load": lambda b=b: backend.buffers.load(fb, b, policy)}, bench.rounds, PAD_CALLS)
                   for b in buckets}
        release()
        measured.append({
            "batch_size": size, "eager": timings["eager"],
            "buckets": [timings[f"bucket {b}"] | {"bucket": b, "pad_us": pad[b]["load"]["median_ms"] * 1e3}
                        for b in buckets],
        })
    return {
        "backend": backend.name, "graph": backend.mechanism, "context_len": bench.context_len,
        "captured_buckets": union, "capture_seconds": [backend.stats.capture_seconds.get(b) for b in union],
        "batch_sizes": list(batch_sizes), "measured": measured, "sets": _per_set(sets, plans, measured),
    }


def _eager_plan(cfg: DictConfig) -> DictConfig:
    raw = OmegaConf.to_container(cfg, resolve=True)
    raw["capture"] = {"name": "eager"} | {mode.config_key: {"backend": "eager"} for mode in ForwardMode}
    return OmegaConf.create(raw)


def _backend_options(cfg: DictConfig, buckets: list[int]) -> dict[str, Any]:
    """The plan's full_graph decode options (compile settings) if it has them, over `buckets`."""
    decode = OmegaConf.to_container(cfg.capture.decode, resolve=True)
    options = {k: v for k, v in decode.items() if k != "backend"} if decode.get("backend") == "full_graph" else {}
    options |= {"buckets": buckets, "progress": False, "lazy": False}
    if cfg.bench.get("graph"):
        options["graph"] = cfg.bench.graph
    return options


def _pinned(backend: FullGraphBackend, bucket: int) -> FullGraphBackend:
    """The backend offering only `bucket`: its own prepare() then pads every batch to it.
    A shallow copy shares the captured graphs and static buffers; the counters are its own."""
    view = copy.copy(backend)
    view.buckets, view.stats = (bucket,), type(backend.stats)()
    return view


def _per_set(sets, plans, measured) -> list[dict[str, Any]]:
    by_size = {m["batch_size"]: m for m in measured}
    out = []
    for buckets, plan in zip(sets, plans):
        rows = []
        for row in plan:
            m = by_size[row["batch_size"]]
            timing = m["eager"] if row["bucket"] is None else next(t for t in m["buckets"] if t["bucket"] == row["bucket"])
            rows.append(row | {"ms": timing["median_ms"], "min_ms": timing["min_ms"], "max_ms": timing["max_ms"],
                               "pad_us": timing.get("pad_us"),
                               "vs_eager": timing["median_ms"] / m["eager"]["median_ms"]})
        out.append({"buckets": list(buckets), "label": set_label(buckets), "rows": rows,
                    "mean_wasted_fraction": sum(r["wasted_fraction"] for r in rows) / len(rows),
                    "mean_ms": sum(r["ms"] for r in rows) / len(rows),
                    "eager_at": [r["batch_size"] for r in rows if r["runs"] == "eager"]})
    # The finest set wastes least (ties: the one listed first); the others are priced against it.
    finest = min(out, key=lambda s: s["mean_wasted_fraction"])
    for s in out:
        ratios = [r["ms"] / f["ms"] for r, f in zip(s["rows"], finest["rows"])]
        s["vs_finest"], s["finest"] = sum(ratios) / len(ratios), finest["label"]
    return out


def report(result: dict[str, Any]) -> Report:
    sizes, sets = result["batch_sizes"], result["sets"]
    caps = ", ".join(f"{b}: {cell(s)}" for b, s in zip(result["captured_buckets"], result["capture_seconds"]))
    out = Report([f"Decode step, KV {result['context_len']} tokens per request; {result['backend']} "
                  f"({result['graph']}) "
                  f"captured once over buckets {result['captured_buckets']} (capture s per bucket: {caps}). "
                  "Times are medians of paired rounds; `eager` rows are batches above the set's largest bucket."])
    for s in sets:
        out.blocks.append(Table(["B", "bucket", "wasted rows", "ms (min–max)", "× vs eager exact", "pad µs"],
                                [[r["batch_size"], r["bucket"] or "eager", r["wasted_rows"],
                                  f"{r['ms']:.2f} ({r['min_ms']:.2f}–{r['max_ms']:.2f})", times(r["vs_eager"]),
                                  r["pad_us"]]
                                 for r in s["rows"]], f"bucket set {s['label']}"))
        out.summary |= {f"{s['label']} mean wasted fraction": s["mean_wasted_fraction"],
                        f"{s['label']} mean ms": s["mean_ms"], f"{s['label']} × vs finest": s["vs_finest"]}
    out.blocks += [f"### across sets\n\nOver B = {sizes}; × vs finest is the mean per-B latency ratio against "
                   f"{sets[0]['finest']}.",
                   Table(["bucket set", "mean wasted fraction", "mean ms", "× vs finest", "eager at B"],
                         [[s["label"], f"{s['mean_wasted_fraction']:.1%}", s["mean_ms"], times(s["vs_finest"]),
                           ", ".join(map(str, s["eager_at"])) or None] for s in sets])]
    latency = {"eager (exact B)": [m["eager"]["median_ms"] for m in result["measured"]]}
    latency |= {s["label"]: [r["ms"] for r in s["rows"]] for s in sets}
    out.plots = [
        Bars("padding_latency.png", f"decode step padded to its bucket, KV {result['context_len']} tokens",
             "ms (median)", sizes, latency, "live batch size"),
        Bars("padding_waste.png", "padded rows per step", "% of rows computed that are padding", sizes,
             {s["label"]: [100 * r["wasted_fraction"] for r in s["rows"]] for s in sets}, "live batch size"),
    ]
    return out
