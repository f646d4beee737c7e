"""End-to-end suite: one seeded offline workload through the Engine (the configured plan) and
through Hugging Face `generate` on the same weights, in the same process: throughput, time to
first token, time per output token, and greedy-token agreement."""

from __future__ import annotations

import time
from typing import Any, Sequence

from omegaconf import OmegaConf
from tqdm import tqdm

from bench.report import Bars, Report, Table
from bench.stats import PERCENTILES, median, percentiles
from bench.tables import cell, times
from bench.workload import WorkItem, WorkloadSpec, make_workload, ordinary_token_range
from graphexec.engine.threads import call_in_thread

COMPARE_UNIT = "tok/s"  # which summary numbers a multirun comparison plots


def run(cfg, ctx) -> dict[str, Any]:
    from bench.capture import distinct_backends
    from bench.suites import build_engine
    from graphexec import SamplingParams

    workload_cfg = OmegaConf.to_container(cfg.bench.workload, resolve=True)
    spec = WorkloadSpec(**{k: tuple(v) if isinstance(v, list) else v for k, v in workload_cfg.items()})
    engine = build_engine(cfg)
    items = make_workload(spec, ordinary_token_range(engine.model_config.vocab_size))
    sides: dict[str, list[dict[str, Any]]] = {"graphexec": []}
    hf_cfg = cfg.bench.hf
    single = items[: hf_cfg.single_requests] if hf_cfg.enabled else []
    # Each side runs while its thread is the process's only OpenMP master (graphexec/engine/threads.py):
    # HF on threads that end, before the engine loop's thread exists and after it has stopped.
    # So the sides take turns by block, HF groups first, rather than alternating round by round.
    try:
        if hf_cfg.enabled:
            hf = call_in_thread(lambda: _hf_model(engine), "hf-baseline")
            sides["hf_grouped"] = [call_in_thread(lambda: _hf_round(hf, items, hf_cfg.group_size, ctx.progress), "hf-baseline")
                                   for _ in range(cfg.bench.rounds)]
        # First calls pay one-off costs (allocator growth, lazy init): not the workload's.
        engine.generate([items[0].prompt_ids[:16]], SamplingParams(max_new_tokens=4, ignore_eos=True))
        engine.flush_cache()  # the workload finds only what it caches itself
        for _ in range(cfg.bench.rounds):
            sides["graphexec"].append(_engine_round(engine, items, ctx.progress))
        backends = distinct_backends(engine.runner)
    finally:
        engine.shutdown()
    if single:
        sides["hf_single"] = [call_in_thread(lambda: _hf_round(hf, single, 1, ctx.progress), "hf-baseline")]
    return _result(spec, items, sides, cfg, backends)


def _engine_round(engine, items: Sequence[WorkItem], progress: bool) -> dict[str, Any]:
    from graphexec import SamplingParams

    t0 = time.perf_counter()
    streams = [engine.stream(w.prompt_ids, SamplingParams(max_new_tokens=w.output_len, ignore_eos=True)) for w in items]
    with tqdm(total=len(items), desc="graphexec requests", disable=not progress) as bar:
        while (unfinished := engine.num_unfinished()) > 0:  # requests finish in any order
            bar.update(len(items) - unfinished - bar.n)
            time.sleep(0.05)
        bar.update(len(items) - bar.n)
    outputs = [s.result() for s in streams]
    wall = time.perf_counter() - t0
    return _side_round(wall, outputs) | {"cached_prompt_tokens": sum(o.cached_tokens for o in outputs)}


def _hf_round(hf: tuple, items: Sequence[WorkItem], group_size: int, progress: bool) -> dict[str, Any]:
    """One HF round over `items`, `group_size` left-padded requests at a time (1: one by one)."""
    from bench.hf_baseline import generate_grouped

    (model, pad_id), desc = hf, f"HF generate, groups of {group_size}" if group_size > 1 else "HF generate, one at a time"
    with tqdm(total=len(items), desc=desc, disable=not progress) as bar:
        results, wall = generate_grouped(model, [w.prompt_ids for w in items], [w.output_len for w in items], pad_id,
                                         group_size, on_group=bar.update)
    return _side_round(wall, results)


def _hf_model(engine) -> tuple:
    """The reference model and its pad id, warmed up as the engine is."""
    from bench.hf_baseline import generate_group, hf_model_for_engine

    model, pad_id = hf_model_for_engine(engine), engine.model_config.eos_token_ids[0]
    generate_group(model, [[pad_id + 1] * 8], [4], pad_id, time.perf_counter())
    return model, pad_id


def _side_round(wall: float, results: Sequence) -> dict[str, Any]:
    """One side's round from its per-request results (RequestOutput or HFRequestResult: both have
    token_ids, ttft and tpot)."""
    useful = sum(len(r.token_ids) for r in results)
    return {
        "requests": len(results),
        "wall_s": wall,
        "output_tokens": useful,
        "tokens_per_s": useful / wall,
        "ttft_s": [r.ttft for r in results if r.ttft is not None],
        "tpot_s": [r.tpot for r in results if r.tpot is not None],
        "token_ids": [r.token_ids for r in results],
    }


def agreement(ours: Sequence[list[int]], theirs: Sequence[list[int]]) -> dict[str, float]:
    """Identical requests, and the mean share of each request's tokens before the first difference."""
    prefix = []
    for a, b in zip(ours, theirs):
        same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        prefix.append(same / max(len(a), len(b), 1))
    return {
        "identical_requests": sum(a == b for a, b in zip(ours, theirs)),
        "compared": len(prefix),
        "mean_prefix_fraction": sum(prefix) / len(prefix) if prefix else 0.0,
    }


def _result(spec: WorkloadSpec, items: Sequence[WorkItem], sides: dict, cfg, backends) -> dict[str, Any]:
    ours = sides["graphexec"][-1]["token_ids"]
    out_sides = {}
    for name, rounds in sides.items():
        rates = [r["tokens_per_s"] for r in rounds]
        out_sides[name] = {
            "requests": rounds[0]["requests"],
            "tokens_per_s": median(rates),
            "tokens_per_s_rounds": rates,
            "wall_s": median(r["wall_s"] for r in rounds),
            "output_tokens": rounds[0]["output_tokens"],
            "ttft_s": percentiles([t for r in rounds for t in r["ttft_s"]]),
            "tpot_ms": {k: None if v is None else v * 1e3 for k, v in percentiles([t for r in rounds for t in r["tpot_s"]]).items()},
        }
        if "cached_prompt_tokens" in rounds[-1]:
            out_sides[name]["cached_prompt_tokens"] = rounds[-1]["cached_prompt_tokens"]
        if name != "graphexec":
            out_sides[name]["agreement"] = agreement(ours, rounds[-1]["token_ids"])
    base = out_sides["graphexec"]["tokens_per_s"]
    ratios = {f"graphexec / {n}": base / s["tokens_per_s"] for n, s in out_sides.items() if n != "graphexec"}
    return {
        "workload": {
            "spec": {k: list(v) if isinstance(v, tuple) else v for k, v in vars(spec).items()},
            "prompt_tokens": sum(len(w.prompt_ids) for w in items),
            "useful_output_tokens": sum(w.output_len for w in items),
            "shared_prefix_requests": sum(w.shared_prefix for w in items),
        },
        "hf_group_size": cfg.bench.hf.group_size,
        "sides": out_sides,
        "ratios": ratios,
        "engine_backends": [{k: v for k, v in b.items() if k != "buckets"} for b in backends],
    }


_LABELS = {"graphexec": "graphexec", "hf_grouped": "HF generate, groups", "hf_single": "HF generate, one at a time"}


def report(result: dict[str, Any]) -> Report:
    w, spec, sides = result["workload"], result["workload"]["spec"], result["sides"]
    base = sides["graphexec"]["tokens_per_s"]
    backends = "; ".join(f"{'/'.join(b['modes'])} → {b['backend']}: {b['executions']} (eager fallbacks "
                         f"{b['fallbacks']}, padded rows {b['padded_rows']})" for b in result["engine_backends"])
    out = Report([
        f"Workload: {spec['num_requests']} requests (seed {spec['seed']}), prompts {spec['prompt_len'][0]}–"
        f"{spec['prompt_len'][1]} tokens ({w['prompt_tokens']} in all; {w['shared_prefix_requests']} start with the "
        f"same {spec['shared_prefix_len']}-token prefix), outputs {spec['output_len'][0]}–{spec['output_len'][1]} "
        f"tokens ({w['useful_output_tokens']} in all), EOS ignored, greedy. HF groups of {result['hf_group_size']}, "
        "left-padded, each to its longest output.",
        Table(["side", "requests", "useful tok/s", "×", "wall s", "TTFT p50 / p90 / p99 s", "TPOT p50 / p90 / p99 ms",
               "same tokens as graphexec"],
              [[_LABELS.get(name, name), s["requests"], s["tokens_per_s"], times(base / s["tokens_per_s"]),
                s["wall_s"], _triple(s["ttft_s"]), _triple(s["tpot_ms"]), _agreement_cell(s.get("agreement"))]
               for name, s in sides.items()]),
        f"× is graphexec's useful tokens/s over that side's. Engine forwards per backend: {backends}. Prompt tokens "
        f"reused from the prefix cache: {sides['graphexec'].get('cached_prompt_tokens', 0)}.",
    ])
    out.plots = [
        Bars("e2e_throughput.png", "useful output tokens per second", "tokens/s",
             [_LABELS.get(n, n).replace(", ", ",\n") for n in sides],
             {"tokens/s": [s["tokens_per_s"] for s in sides.values()]}),
        Bars("e2e_ttft.png", "time to first token", "seconds", [f"p{p}" for p in PERCENTILES],
             {_LABELS.get(n, n): list(s["ttft_s"].values()) for n, s in sides.items()}),
    ]
    out.summary = {f"{n} tok/s": s["tokens_per_s"] for n, s in sides.items()}
    out.summary |= {f"{k} ×": v for k, v in result["ratios"].items()}
    out.summary |= {"graphexec TTFT p50 s": sides["graphexec"]["ttft_s"]["p50"],
                    "graphexec TPOT p50 ms": sides["graphexec"]["tpot_ms"]["p50"]}
    return out


def _agreement_cell(agree: dict[str, float] | None) -> str | None:
    if agree is None:
        return None
    return f"{agree['identical_requests']}/{agree['compared']} requests, {agree['mean_prefix_fraction']:.0%} of tokens"


def _triple(p: dict[str, float | None]) -> str:
    return " / ".join(map(cell, p.values()))
