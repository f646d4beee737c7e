"""End-to-end suite: one seeded offline workload through the Engine (the configured plan) and through Hugging
Face `generate` on the same weights, in one process: throughput, TTFT, TPOT and greedy-token agreement."""

from __future__ import annotations

import time
from typing import Any, Sequence

from omegaconf import OmegaConf
from tqdm import tqdm

from bench.capture import distinct_backends
from bench.hf_baseline import generate_grouped, hf_model_for_engine
from bench.report import Bars, Report, Table
from bench.stats import PERCENTILES, median, percentiles
from bench.suites import build_engine
from bench.tables import cell, times
from bench.workload import WorkItem, WorkloadSpec, make_workload, ordinary_token_range
from graphexec import SamplingParams
from graphexec.engine.threads import call_in_thread

COMPARE_UNIT = "tok/s"  # which summary numbers a multirun comparison plots
_LABELS = {"graphexec": "graphexec", "hf_grouped": "HF generate, groups", "hf_single": "HF generate, one at a time"}


def run(cfg, ctx) -> dict[str, Any]:
    rounds, hf_cfg = cfg.bench.rounds, cfg.bench.hf
    workload = OmegaConf.to_container(cfg.bench.workload, resolve=True)
    spec = WorkloadSpec(**{k: tuple(v) if isinstance(v, list) else v for k, v in workload.items()})
    engine = build_engine(cfg)
    items = make_workload(spec, ordinary_token_range(engine.model_config.vocab_size))
    sides: dict[str, list[tuple[list, float]]] = {"graphexec": []}  # per round: per-request results, wall s
    # Each side runs while its thread is the process's only OpenMP master (graphexec/engine/threads.py): HF on
    # threads that end, before the engine loop's thread starts and after it stops; so sides take turns by block.
    try:
        if hf_cfg.enabled:
            hf = call_in_thread(lambda: hf_model_for_engine(engine), "hf-baseline")
            sides["hf_grouped"] = [_hf_round(hf, items, hf_cfg.group_size, ctx.progress) for _ in range(rounds)]
        # First calls pay one-off costs (allocator growth, lazy init): not the workload's.
        engine.generate([items[0].prompt_ids[:16]], SamplingParams(max_new_tokens=4, ignore_eos=True))
        engine.flush_cache()  # the workload finds only what it caches itself
        sides["graphexec"] = [_engine_round(engine, items, ctx.progress) for _ in range(rounds)]
        backends = distinct_backends(engine.runner)
    finally:
        engine.shutdown()
    if hf_cfg.enabled and hf_cfg.single_requests:
        sides["hf_single"] = [_hf_round(hf, items[: hf_cfg.single_requests], 1, ctx.progress)]
    ours = [r.token_ids for r in sides["graphexec"][-1][0]]
    out = {name: _side(results, None if name == "graphexec" else ours) for name, results in sides.items()}
    base = out["graphexec"]["tokens_per_s"]
    return {"workload": {"spec": vars(spec), "prompt_tokens": sum(len(w.prompt_ids) for w in items),
                         "useful_output_tokens": sum(w.output_len for w in items),
                         "shared_prefix_requests": sum(w.shared_prefix for w in items)},
            "hf_group_size": hf_cfg.group_size, "sides": out,
            "ratios": {f"graphexec / {n}": base / s["tokens_per_s"] for n, s in out.items() if n != "graphexec"},
            "engine_backends": [{k: v for k, v in b.items() if k != "buckets"} for b in backends]}


def _engine_round(engine, items: Sequence[WorkItem], progress: bool) -> tuple[list, float]:
    t0 = time.perf_counter()
    streams = [engine.stream(w.prompt_ids, SamplingParams(max_new_tokens=w.output_len, ignore_eos=True)) for w in items]
    with tqdm(total=len(items), desc="graphexec requests", disable=not progress) as bar:
        while (unfinished := engine.num_unfinished()) > 0:  # requests finish in any order
            bar.update(len(items) - unfinished - bar.n)
            time.sleep(0.05)
        bar.update(len(items) - bar.n)
    return [s.result() for s in streams], time.perf_counter() - t0


def _hf_round(hf: tuple, items: Sequence[WorkItem], group_size: int, progress: bool) -> tuple[list, float]:
    """One HF round over `items`, `group_size` left-padded requests at a time (1: one by one), on a thread that ends."""
    (model, pad_id), desc = hf, f"HF generate, groups of {group_size}" if group_size > 1 else _LABELS["hf_single"]

    def generate() -> tuple[list, float]:
        with tqdm(total=len(items), desc=desc, disable=not progress) as bar:
            return generate_grouped(model, [w.prompt_ids for w in items], [w.output_len for w in items], pad_id,
                                    group_size, on_group=bar.update)
    return call_in_thread(generate, "hf-baseline")


def _side(rounds: list[tuple[list, float]], reference: list[list[int]] | None) -> dict[str, Any]:
    """One side's numbers from its rounds' per-request results (token_ids, ttft, tpot), against `reference`."""
    (first, _), (last, _) = rounds[0], rounds[-1]
    every = [r for results, _ in rounds for r in results]
    rates = [sum(len(r.token_ids) for r in results) / wall for results, wall in rounds]
    side = {"requests": len(first), "tokens_per_s": median(rates), "tokens_per_s_rounds": rates,
            "wall_s": median(wall for _, wall in rounds), "output_tokens": sum(len(r.token_ids) for r in first),
            "ttft_s": percentiles([r.ttft for r in every if r.ttft is not None]),
            "tpot_ms": percentiles([r.tpot * 1e3 for r in every if r.tpot is not None])}
    if reference is None:  # graphexec's side, the others' reference: what its prefix cache supplied
        side["cached_prompt_tokens"] = sum(r.cached_tokens for r in last)
    else:
        side["agreement"] = agreement(reference, [r.token_ids for r in last])
    return side


def agreement(ours: Sequence[list[int]], theirs: Sequence[list[int]]) -> dict[str, float]:
    """Identical requests, and the mean share of each request's tokens before the first difference."""
    prefix = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b))) / max(len(a), len(b), 1)
              for a, b in zip(ours, theirs)]
    return {"identical_requests": sum(a == b for a, b in zip(ours, theirs)), "compared": len(prefix),
            "mean_prefix_fraction": sum(prefix) / len(prefix) if prefix else 0.0}


def report(result: dict[str, Any]) -> Report:
    w, spec, sides = result["workload"], result["workload"]["spec"], result["sides"]
    ours, labels = sides["graphexec"], [_LABELS.get(n, n) for n in sides]
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
              [[label, s["requests"], s["tokens_per_s"], times(ours["tokens_per_s"] / s["tokens_per_s"]), s["wall_s"],
                " / ".join(map(cell, s["ttft_s"].values())), " / ".join(map(cell, s["tpot_ms"].values())),
                None if (a := s.get("agreement")) is None
                else f"{a['identical_requests']}/{a['compared']} requests, {a['mean_prefix_fraction']:.0%} of tokens"]
               for label, s in zip(labels, sides.values())]),
        f"× is graphexec's useful tokens/s over that side's. Engine forwards per backend: {backends}. Prompt tokens "
        f"reused from the prefix cache: {ours.get('cached_prompt_tokens', 0)}.",
    ])
    out.plots = [Bars("e2e_throughput.png", "useful output tokens per second", "tokens/s",
                      [x.replace(", ", ",\n") for x in labels], {"tokens/s": [s["tokens_per_s"] for s in sides.values()]}),
                 Bars("e2e_ttft.png", "time to first token", "seconds", [f"p{p}" for p in PERCENTILES],
                      {label: list(s["ttft_s"].values()) for label, s in zip(labels, sides.values())})]
    out.summary = {f"{n} tok/s": s["tokens_per_s"] for n, s in sides.items()}
    out.summary |= {f"{k} ×": v for k, v in result["ratios"].items()}
    out.summary |= {"graphexec TTFT p50 s": ours["ttft_s"]["p50"], "graphexec TPOT p50 ms": ours["tpot_ms"]["p50"]}
    return out

