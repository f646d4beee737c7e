"""Parallel suite: the same requests at several `parallel.tp_size` values, side by side.

Boundary: orchestration and report.  Each tensor-parallel size runs as a fresh process per round
(`graphexec-bench peer_worker --side graphexec` with `parallel.tp_size=N`, which starts its own
N-1 worker ranks), alternated (tp=1, tp=N, tp=1, ...) so machine noise lands on every side alike.
The prompts, shapes and per-round numbers are the peer suite's (bench/peer.py): B=1 decode
ms/token, prompt tok/s, batched decode tok/s, start-up, rank 0's peak RSS.

What 2 cores can show: with tp ranks pinned to one thread each, tp=N spreads one step's GEMMs
over N cores, so it can only win where tp=1 could not use the cores itself; on 2 cores tp=3
oversubscribes.  The all-reduce's share of a step is measured separately (bench/tp_step.py).
"""

from __future__ import annotations

import json
from typing import Any

from bench import peer
from bench.report import Bars, Report, Table
from bench.stats import spread
from bench.workers import alternate

COMPARE_UNIT = "tok/s"

_ROWS = (
    ("decode_ms", "B=1 decode ms/token ↓"),
    ("decode_tok_s", "B=1 decode tok/s ↑"),
    ("decode_ttft_s", "B=1 time to first token s ↓"),
    ("batch_tok_s", "batched decode tok/s ↑"),
    ("pp_tok_s", "prompt processing tok/s ↑"),
    ("start_s", "start-up s (all ranks load and capture) ↓"),
    ("peak_rss_mib", "rank 0 peak RSS MiB ↓"),
)


def options(bench_cfg) -> dict[str, Any]:
    from bench.suites import checked_options

    ints = ("rounds", "threads", "worker_timeout_s", "decode_new_tokens", "prompt_len", "batch_size", "prefill_len")
    return checked_options(bench_cfg, dict.fromkeys(ints, 1), {"tp_sizes": 1})


def _peer_options(o: dict[str, Any]) -> dict[str, Any]:
    """The peer suite's spec options for this suite's shapes (llama.cpp never runs here)."""
    return {
        "threads": o["threads"], "warmup": True, "repeats": 1,
        "decode": {"prompt_len": o["prompt_len"], "new_tokens": o["decode_new_tokens"]},
        "prefill": {"lengths": [o["prefill_len"]]},
        "batch": {"sizes": [o["batch_size"]], "prompt_len": o["prompt_len"], "new_tokens": o["decode_new_tokens"]},
        "agreement": {"prompts": 0, "new_tokens": 1, "near_tie_nats": 0.0},  # a peer-only check
        "llamacpp": {"enabled": False, "n_ctx": 1, "n_batch": 1, "flash_attn": False},
    }


def run(cfg, ctx) -> dict[str, Any]:
    from graphexec.config import EngineConfig

    opts = options(cfg.bench)
    source = EngineConfig.from_dictconfig(cfg).model
    gguf = peer.gguf_path(source)
    spec = peer.build_spec(peer.tokenizer_of(source, gguf), _peer_options(opts), gguf)
    ctx.out_dir.mkdir(parents=True, exist_ok=True)
    spec_path = ctx.out_dir / "parallel_spec.json"
    spec_path.write_text(json.dumps(spec))
    base = [o for o in ctx.overrides if not o.startswith("parallel.tp_size=")]
    sides = [f"tp={n}" for n in opts["tp_sizes"]]

    def one(side: str, round_index: int) -> dict[str, Any]:
        overrides = [*base, f"parallel.tp_size={side.removeprefix('tp=')}"]
        return peer.run_worker("graphexec", spec_path, overrides, opts["threads"], opts["worker_timeout_s"])

    raw, sequence = alternate(sides, opts["rounds"], one, ctx.say, "parallel suite")
    per_side = {side: [_metrics(peer.round_metrics(w), opts) for w in rounds] for side, rounds in raw.items()}
    rows = []
    for key, label in _ROWS:
        cells = {side: spread([m[key] for m in per_side[side] if key in m]) for side in sides}
        rows.append({"key": key, "label": label, "sides": cells})
    errors = {side: [w["error"] for w in rounds if w.get("error")] for side, rounds in raw.items()}
    tokens = {side: [w["decode"][0]["token_ids"] for w in rounds if not w.get("error")] for side, rounds in raw.items()}
    same = [tokens[s][0] == tokens[sides[0]][0] for s in sides if tokens[s] and tokens[sides[0]]]
    return {
        "options": opts, "model": source.name, "overrides": list(base), "sides": sides, "sequence": sequence,
        "rows": rows, "errors": errors, "greedy_tokens_equal": all(same) if same else None,
    }


def _metrics(m: dict[str, float], o: dict[str, Any]) -> dict[str, float]:
    renamed = dict(m)
    if f"batch_tok_s@{o['batch_size']}" in m:
        renamed["batch_tok_s"] = m[f"batch_tok_s@{o['batch_size']}"]
    if f"pp_tok_s@{o['prefill_len']}" in m:
        renamed["pp_tok_s"] = m[f"pp_tok_s@{o['prefill_len']}"]
    return renamed


def report(result: dict[str, Any]) -> Report:
    o, sides, rows = result["options"], result["sides"], result["rows"]
    out = Report([
        f"# Parallel suite: {result['model']}, tensor-parallel sizes {', '.join(sides)}",
        f"{o['rounds']} fresh process(es) per size, alternated; B=1 decode of {o['decode_new_tokens']} tokens after a "
        f"{o['prompt_len']}-token prompt; batch of {o['batch_size']}; a {o['prefill_len']}-token prompt for prefill. "
        f"Cells: median (min-max) over rounds. Greedy tokens equal across sizes: {result['greedy_tokens_equal']}.",
        Table(["", *sides], [[row["label"], *(row["sides"][s] for s in sides)] for row in rows]),
        *(f"{side} failed a round: {error}" for side, errors in result["errors"].items() for error in errors),
    ])
    keys = ["decode_tok_s", "batch_tok_s", "pp_tok_s"]
    medians = {side: [(row["sides"][side] or {}).get("median") or 0.0 for row in rows if row["key"] in keys]
               for side in sides}
    out.plots.append(Bars("parallel_throughput.png", f"{result['model']}: throughput by tensor-parallel size", "tok/s",
                          keys, medians))
    out.summary = {f"{row['key']} {side}": cell["median"] for row in rows for side, cell in row["sides"].items() if cell}
    return out
