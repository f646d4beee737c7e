"""Decode suite: per bucket, eager vs the plan's decode backend, and what capturing it costs."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from typing import Any

import torch

from graphexec.forward_mode import ForwardMode


def run(engine, cfg, overrides: list[str]) -> dict[str, Any]:
    runner = engine.runner
    graph = runner.backends[ForwardMode.DECODE]
    buckets = list(getattr(graph, "buckets", [1, 8]))
    rows = []
    for bucket in buckets:
        fb, release = _decode_batch(engine, bucket, cfg.bench.context_len)
        sides = {
            "eager": lambda: runner.eager.execute(fb),
            graph.name: lambda: graph.execute(fb),
        }
        with torch.inference_mode():
            timings = _paired(sides, cfg.bench.rounds, cfg.bench.steps)
        eager_ms, graph_ms = timings["eager"]["median_ms"], timings[graph.name]["median_ms"]
        rows.append(
            {
                "bucket": bucket,
                "eager": timings["eager"],
                graph.name: timings[graph.name],
                "speedup": eager_ms / graph_ms,
                "capture_seconds": graph.stats.capture_seconds.get(bucket),
                "capture_mib": graph.stats.capture_bytes.get(bucket, 0) / 2**20,
            }
        )
        release()
    result: dict[str, Any] = {"backend": graph.name, "buckets": rows}
    if cfg.bench.cold_warm:
        result["start"] = _cold_then_warm(overrides)
    return result


def _paired(sides, rounds, steps):
    from bench.timing import paired_ms

    return paired_ms(sides, rounds, steps)


def _decode_batch(engine, batch_size: int, context_len: int):
    """`batch_size` requests whose KV holds `context_len` tokens, ready for one decode step."""
    from graphexec import SamplingParams
    from graphexec.request import Req
    from graphexec.schedule_batch import ScheduleBatch

    runner = engine.runner
    gen = torch.Generator().manual_seed(batch_size)
    vocab = engine.model_config.vocab_size
    reqs = [
        Req(f"bench{i}", torch.randint(3, vocab, (context_len,), generator=gen).tolist(),
            SamplingParams(max_new_tokens=2, ignore_eos=True), (), engine.max_context)
        for i in range(batch_size)
    ]
    prefill = ScheduleBatch.prepare_for_extend(reqs, runner.req_to_token_pool, runner.kv_pool)
    runner.forward(runner.init_forward_batch(prefill))
    for req in reqs:
        req.num_cached_tokens = req.seq_len
        req.output_ids.append(5)
    decode = ScheduleBatch.prepare_for_decode(reqs, runner.req_to_token_pool, runner.kv_pool)

    def release() -> None:
        for req in reqs:
            engine.scheduler._release(req)

    # Re-running this batch rewrites the same slots, so every timed step sees the same state.
    return runner.init_forward_batch(decode), release


def _cold_then_warm(overrides: list[str]) -> dict[str, Any]:
    """Two fresh processes sharing a new, empty compile cache: the first compiles, the second reuses."""
    out = {}
    with tempfile.TemporaryDirectory(prefix="graphexec-inductor-") as cache:
        for phase in ("cold", "warm"):
            cmd = [sys.executable, "-m", "bench.capture_probe", *overrides, f"capture.decode.compile.cache_dir={cache}"]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                out[phase] = {"error": proc.stderr.strip().splitlines()[-1] if proc.stderr else "failed"}
                continue
            out[phase] = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


def markdown(result: dict[str, Any]) -> str:
    name = result["backend"]
    lines = [
        f"| bucket | eager ms | {name} ms | speedup | capture s (this process) | capture MiB |",
        "|---|---|---|---|---|---|",
    ]
    for row in result["buckets"]:
        e, g = row["eager"], row[name]
        cap = row["capture_seconds"]
        lines.append(
            f"| {row['bucket']} | {e['median_ms']:.1f} ({e['min_ms']:.1f}–{e['max_ms']:.1f}) "
            f"| {g['median_ms']:.1f} ({g['min_ms']:.1f}–{g['max_ms']:.1f}) | {row['speedup']:.2f}× "
            f"| {'—' if cap is None else f'{cap:.1f}'} | {row['capture_mib']:.0f} |"
        )
    if "start" in result:
        lines += ["", "| start | engine start s | capture s per bucket |", "|---|---|---|"]
        for phase, probe in result["start"].items():
            if "error" in probe:
                lines.append(f"| {phase} | failed: {probe['error']} | |")
                continue
            per = ", ".join(f"{b}: {s:.1f}" for b, s in sorted(probe["capture_seconds"].items(), key=lambda kv: int(kv[0])))
            lines.append(f"| {phase} | {probe['start_seconds']:.1f} | {per} |")
    return "\n".join(lines) + "\n"
