"""Spec suite: output tokens/s with speculation against without, per prompt class and batch size;
each side a fresh process (`graphexec-bench spec_worker <json>`), sides alternated, every greedy
output checked against the first `none` run's.  What it runs and reports: bench/README.md, "spec"."""

from __future__ import annotations

import json
import time
from itertools import chain, cycle, islice, zip_longest
from typing import Any

from omegaconf import OmegaConf

from bench.report import Bars, Report, Table
from bench.stats import median
from bench.workers import alternate, emit, run_command
from graphexec import Engine, SamplingParams

_SPEC = ("speculative", "+speculative", "++speculative")
_HEADLINES = (("copy", 1), ("open", 1), ("mixed", 8))
_COLUMNS = ("tok_s_none", "tok_s_spec", "ratio", "decode_ratio", "acceptance_rate", "mean_accepted_length", "output_tokens")


def _cases(prompts: dict[str, list[str]], batch_sizes: list[int], mixed: bool) -> list[tuple[str, int, list[list[str]]]]:
    """(class, batch size, the calls' prompt lists) for every measured cell."""
    classes = dict(prompts)
    if mixed and len(classes) > 1:
        classes["mixed"] = [p for p in chain(*zip_longest(*prompts.values())) if p is not None]
    return [(name, b, [[p] for p in ps] if b == 1 else [list(islice(cycle(ps), b))])
            for b in batch_sizes for name, ps in classes.items() if b > 1 or name != "mixed"]


def _spec_delta(before: dict | None, after: dict | None) -> dict | None:
    if after is None:
        return None
    d = {k: after[k] - before[k] for k in ("verify_steps", "drafted_tokens", "accepted_tokens")}
    lengths = {int(k): n - before["accepted_lengths"].get(k, 0) for k, n in after["accepted_lengths"].items()}
    verified = sum(lengths.values())
    return d | {"acceptance_rate": d["accepted_tokens"] / d["drafted_tokens"] if d["drafted_tokens"] else None,
                "mean_accepted_length": sum(k * n for k, n in lengths.items()) / verified if verified else None}


def worker(spec: dict[str, Any]) -> dict[str, Any]:
    engine, chat = Engine(overrides=[*spec["overrides"], "++capture.background=false"]), spec["chat"]
    params = SamplingParams(max_new_tokens=spec["max_tokens"], temperature=0.0)
    every = [p for ps in spec["prompts"].values() for p in ps]
    for b in spec["batch_sizes"]:  # warm-up, untimed
        engine.generate(list(islice(cycle(every), b)), params.replace(max_new_tokens=min(32, spec["max_tokens"])), chat=chat)
    cells = {}
    for name, b, calls in _cases(spec["prompts"], spec["batch_sizes"], spec["mixed"]):
        before, seconds, decode_seconds, outputs = engine.metrics().speculation, 0.0, 0.0, []
        for prompts in calls:
            engine.flush_cache()
            t0 = time.perf_counter()
            done = engine.generate(prompts, params, chat=chat)
            seconds += time.perf_counter() - t0
            # After the first token: where speculation acts (the prefill is the same on both sides).
            decode_seconds += max(o.latency for o in done) - min(o.ttft or 0.0 for o in done)
            outputs += done
        tokens = [o.token_ids for o in outputs]
        n, after_first = sum(map(len, tokens)), sum(max(0, len(t) - 1) for t in tokens)
        cells[f"{name} B={b}"] = {
            "class": name, "batch": b, "seconds": seconds, "output_tokens": n, "tok_s": n / seconds, "tokens": tokens,
            "decode_tok_s": after_first / decode_seconds if decode_seconds > 0 else None,
            "speculation": _spec_delta(before, engine.metrics().speculation)}
    steps = (engine.metrics().speculation or {}).get("step_ms_by_rows")  # the cost model's step times
    engine.shutdown()
    return {"cells": cells, "step_ms_by_rows": steps}


def run(cfg, ctx) -> dict[str, Any]:
    b, base = cfg.bench, [o for o in ctx.overrides if not o.startswith(_SPEC)]
    sides = {"none": [*base, "speculative=none"],
             "spec": [*base, *b.speculative, *(o for o in ctx.overrides if o.startswith(_SPEC))]}
    prompts = {k: list(v)[: b.max_prompts] for k, v in OmegaConf.to_container(b.prompts).items()}
    spec = {"prompts": prompts, "max_tokens": int(b.max_tokens), "batch_sizes": list(b.batch_sizes),
            "mixed": bool(b.mixed), "chat": bool(b.chat)}

    def one(side: str, round_index: int) -> dict[str, Any]:
        return run_command("spec_worker", [json.dumps(spec | {"overrides": sides[side]})], float(b.worker_timeout_s),
                           label=f"{side} worker", option="bench.worker_timeout_s")

    runs, _ = alternate(list(sides), int(b.rounds), one, ctx.say, "spec suite")
    ok = {side: [x for x in rs if "error" not in x] for side, rs in runs.items()}
    mismatches, compared = _identity(ok)

    def medians(key: str, field: str) -> tuple[float | None, float | None, float | None]:
        """spec's and none's medians over their rounds, and their ratio."""
        on, off = (median(x["cells"][key][field] for x in ok[side]) for side in ("spec", "none"))
        return on, off, on / off if on and off else None

    rows = []
    for key, first in (ok["none"] or ok["spec"] or [{"cells": {}}])[0]["cells"].items():
        (on, off, ratio), decode_ratio = medians(key, "tok_s"), medians(key, "decode_tok_s")[2]
        stats = [x["cells"][key]["speculation"] or {} for x in ok["spec"]]
        rows.append({"key": key, "class": first["class"], "batch": first["batch"], "tok_s_none": off, "tok_s_spec": on,
                     "ratio": ratio, "decode_ratio": decode_ratio, "output_tokens": first["output_tokens"]}
                    | {k: median(s.get(k) for s in stats) for k in ("acceptance_rate", "mean_accepted_length",
                                                                      "drafted_tokens")})
    for cell in (c for rs in ok.values() for x in rs for c in x["cells"].values()):
        cell.pop("tokens")  # compared above; results.json keeps the numbers
    errors = [f"{side} round {i + 1}: {x['error']}" for side, rs in runs.items() for i, x in enumerate(rs) if "error" in x]
    return {"sides": sides, "prompts": prompts, "rows": rows, "identity": {"compared": compared, "mismatches": mismatches},
            "errors": errors, "runs": runs}


def _identity(ok: dict[str, list[dict]]) -> tuple[list[dict], int]:
    """Every output of every run against the first `none` run's, prompt by prompt."""
    if not ok["none"]:
        return [], 0
    reference = ok["none"][0]["cells"]
    runs = [(side, i + 1, x["cells"]) for side, rs in ok.items() for i, x in enumerate(rs) if (side, i) != ("none", 0)]
    pairs = [(side, r, key, j, want, got) for side, r, cells in runs for key, cell in cells.items()
             for j, (want, got) in enumerate(zip(reference[key]["tokens"], cell["tokens"]))]
    return [{"side": side, "round": r, "cell": key, "output": j,
             "first_diff_at": next((n for n, (a, c) in enumerate(zip(want, got)) if a != c), min(len(want), len(got))),
             "lengths": [len(want), len(got)]} for side, r, key, j, want, got in pairs if want != got], len(pairs)


def report(result: dict[str, Any]) -> Report:
    sides, ident, rows = result["sides"], result["identity"], result["rows"]
    out = Report([f"none: `{' '.join(sides['none'])}` · spec: `{' '.join(sides['spec'])}`; "
                  "output tokens/s (whole calls, prefill included), medians over rounds; decode ratio: output tokens "
                  "after the first per second after the first token; prefix cache flushed before each timed call."])
    listed = "\n".join(f"- {m['side']} round {m['round']}, {m['cell']}, output {m['output']}: first different token "
                       f"at {m['first_diff_at']} (lengths {m['lengths']})" for m in ident["mismatches"][:20])
    out.blocks.append(f"**GREEDY MISMATCH: {len(ident['mismatches'])} of {ident['compared']} outputs differ from the "
                      f"first `none` run's:**\n\n{listed}" if listed else
                      f"Greedy identity: all {ident['compared']} outputs equal the first `none` run's.")
    for steps in [x["step_ms_by_rows"] for x in result["runs"]["spec"] if x.get("step_ms_by_rows")][-1:]:
        out.blocks.append("Speculation's measured step ms by rows (last spec run): "
                          + ", ".join(f"{k}: {v:.1f}" for k, v in steps.items()))
    out.blocks += [f"**Worker failed**: {e}" for e in result["errors"]]
    batches = sorted({r["batch"] for r in rows})
    header = ["class", *(k.replace("tok_s", "tok/s").replace("_", " ") for k in _COLUMNS)]
    out.blocks += [Table(header, [[r["class"], *(r[k] for k in _COLUMNS)] for r in rows if r["batch"] == b], f"B={b}")
                   for b in batches]
    classes = list(dict.fromkeys(r["class"] for r in rows))
    ratio = {(r["class"], r["batch"]): r["ratio"] for r in rows}
    if any(ratio.values()):
        out.plots.append(Bars("spec_ratio.png", "speculation / none, output tokens/s", "ratio", classes,
                              {f"B={b}": [ratio.get((c, b)) for c in classes] for b in batches}, "prompt class", hline=1.0))
    headline = [r for r in rows if (r["class"], r["batch"]) in _HEADLINES]
    out.summary = {f"{r['key']} {k.replace('_', ' ')}": r[k] for k in ("ratio", "decode_ratio") for r in headline
                   if r[k] is not None}
    out.summary["greedy mismatches"] = float(len(ident["mismatches"]))
    return out


def main(argv: list[str]) -> None:
    """`graphexec-bench spec_worker JSON`: one side's run, its result as the last stdout line."""
    emit("spec worker", lambda: worker(json.loads(argv[0])))
