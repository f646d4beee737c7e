"""Spec suite: output tokens/s with speculation against without, per prompt class and batch size.

Each side is a fresh process (`graphexec-bench spec_worker <json>`): speculative=none, or the
suite's `speculative` overrides plus any speculative.* on the command line; the engine captures
before it returns (capture.background=false).  A worker warms up once per batch size, then per class and batch
size generates greedily with the prefix cache flushed before each timed call: B=1 one prompt per
call, B>1 that many requests in one call (prompts cycled).  Sides alternate A B A B for `rounds`;
tables show medians.  Every output is compared with the first `none` run's: greedy speculation
must produce the same tokens, and the report says loudly when it does not.
"""

from __future__ import annotations

import json
import time
from itertools import chain, cycle, islice, zip_longest
from typing import Any

from omegaconf import OmegaConf

from bench.report import Bars, Report, Table
from bench.stats import median
from bench.workers import alternate, emit, run_command

_SPEC = ("speculative", "+speculative", "++speculative")
_HEADLINES = (("copy", 1), ("open", 1), ("mixed", 8))


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
    drafted = after["drafted_tokens"] - before["drafted_tokens"]
    accepted = after["accepted_tokens"] - before["accepted_tokens"]
    lengths = {int(k): n - before["accepted_lengths"].get(k, 0) for k, n in after["accepted_lengths"].items()}
    verified = sum(lengths.values())
    return {"verify_steps": after["verify_steps"] - before["verify_steps"], "drafted_tokens": drafted,
            "accepted_tokens": accepted, "acceptance_rate": accepted / drafted if drafted else None,
            "mean_accepted_length": sum(k * n for k, n in lengths.items()) / verified if verified else None}


def worker(spec: dict[str, Any]) -> dict[str, Any]:
    from graphexec import Engine, SamplingParams

    engine = Engine(overrides=[*spec["overrides"], "++capture.background=false"])
    params = SamplingParams(max_new_tokens=spec["max_tokens"], temperature=0.0)
    cases = _cases(spec["prompts"], spec["batch_sizes"], spec["mixed"])
    every = [p for ps in spec["prompts"].values() for p in ps]
    warm = SamplingParams(max_new_tokens=min(32, spec["max_tokens"]), temperature=0.0)
    for b in spec["batch_sizes"]:  # warm-up, untimed
        engine.generate(list(islice(cycle(every), b)), warm, chat=spec["chat"])
    cells = {}
    for name, b, calls in cases:
        before, seconds, decode_seconds, outputs = engine.metrics().speculation, 0.0, 0.0, []
        for prompts in calls:
            engine.flush_cache()
            t0 = time.perf_counter()
            done = engine.generate(prompts, params, chat=spec["chat"])
            seconds += time.perf_counter() - t0
            # After the first token: where speculation acts (the prefill is the same on both sides).
            decode_seconds += max(o.latency for o in done) - min(o.ttft or 0.0 for o in done)
            outputs += done
        tokens = [o.token_ids for o in outputs]
        after_first = sum(max(0, len(t) - 1) for t in tokens)
        cells[f"{name} B={b}"] = {"class": name, "batch": b, "seconds": seconds, "output_tokens": sum(map(len, tokens)),
                                  "tok_s": sum(map(len, tokens)) / seconds, "tokens": tokens,
                                  "decode_tok_s": after_first / decode_seconds if decode_seconds > 0 else None,
                                  "speculation": _spec_delta(before, engine.metrics().speculation)}
    steps = (engine.metrics().speculation or {}).get("step_ms_by_rows")  # the cost model's step times
    engine.shutdown()
    return {"cells": cells, "step_ms_by_rows": steps}


def run(cfg, ctx) -> dict[str, Any]:
    b = cfg.bench
    base = [o for o in ctx.overrides if not o.startswith(_SPEC)]
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
    rows = []
    for key, first in (ok["none"] or ok["spec"] or [{"cells": {}}])[0]["cells"].items():
        off = median(x["cells"][key]["tok_s"] for x in ok["none"])
        on = median(x["cells"][key]["tok_s"] for x in ok["spec"])
        stats = [x["cells"][key]["speculation"] or {} for x in ok["spec"]]
        decode_off = median(x["cells"][key]["decode_tok_s"] for x in ok["none"])
        decode_on = median(x["cells"][key]["decode_tok_s"] for x in ok["spec"])
        rows.append({"key": key, "class": first["class"], "batch": first["batch"], "tok_s_none": off, "tok_s_spec": on,
                     "ratio": on / off if on and off else None,
                     "decode_ratio": decode_on / decode_off if decode_on and decode_off else None,
                     "output_tokens": first["output_tokens"],
                     "acceptance_rate": median(s.get("acceptance_rate") for s in stats),
                     "mean_accepted_length": median(s.get("mean_accepted_length") for s in stats),
                     "drafted_tokens": median(s.get("drafted_tokens") for s in stats)})
    for rs in ok.values():
        for x in rs:
            for cell in x["cells"].values():
                cell.pop("tokens")
    errors = [f"{side} round {i + 1}: {x['error']}" for side, rs in runs.items() for i, x in enumerate(rs) if "error" in x]
    return {"sides": sides, "prompts": prompts, "rows": rows, "identity": {"compared": compared, "mismatches": mismatches},
            "errors": errors, "runs": runs}


def _identity(ok: dict[str, list[dict]]) -> tuple[list[dict], int]:
    """Every output of every run against the first `none` run's, prompt by prompt."""
    if not ok["none"]:
        return [], 0
    reference, mismatches, compared = ok["none"][0]["cells"], [], 0
    for side, rs in ok.items():
        for i, x in enumerate(rs):
            if side == "none" and i == 0:
                continue
            for key, cell in x["cells"].items():
                for j, (want, got) in enumerate(zip(reference[key]["tokens"], cell["tokens"])):
                    compared += 1
                    if want != got:
                        at = next((n for n, (a, c) in enumerate(zip(want, got)) if a != c), min(len(want), len(got)))
                        mismatches.append({"side": side, "round": i + 1, "cell": key, "output": j, "first_diff_at": at,
                                           "lengths": [len(want), len(got)]})
    return mismatches, compared


def report(result: dict[str, Any]) -> Report:
    sides, ident, rows = result["sides"], result["identity"], result["rows"]
    out = Report([f"none: `{' '.join(sides['none'])}` · spec: `{' '.join(sides['spec'])}`; "
                  "output tokens/s (whole calls, prefill included), medians over rounds; decode ratio: output tokens "
                  "after the first per second after the first token; prefix cache flushed before each timed call."])
    if ident["mismatches"]:
        out.blocks.append(f"**GREEDY MISMATCH: {len(ident['mismatches'])} of {ident['compared']} outputs differ from "
                          "the first `none` run's:**\n\n" + "\n".join(
                              f"- {m['side']} round {m['round']}, {m['cell']}, output {m['output']}: first different "
                              f"token at {m['first_diff_at']} (lengths {m['lengths']})"
                              for m in ident["mismatches"][:20]))
    else:
        out.blocks.append(f"Greedy identity: all {ident['compared']} outputs equal the first `none` run's.")
    steps = [x.get("step_ms_by_rows") for x in result["runs"]["spec"] if x.get("step_ms_by_rows")]
    if steps:
        out.blocks.append("Speculation's measured step ms by rows (last spec run): "
                          + ", ".join(f"{k}: {v:.1f}" for k, v in steps[-1].items()))
    out.blocks += [f"**Worker failed**: {e}" for e in result["errors"]]
    batches = sorted({r["batch"] for r in rows})
    keys = ("tok_s_none", "tok_s_spec", "ratio", "decode_ratio", "acceptance_rate", "mean_accepted_length",
            "output_tokens")
    out.blocks += [Table(["class", "tok/s none", "tok/s spec", "ratio", "decode ratio", "acceptance rate",
                          "mean accepted length", "output tokens"],
                         [[r["class"], *(r[k] for k in keys)] for r in rows if r["batch"] == b], f"B={b}")
                   for b in batches]
    classes = list(dict.fromkeys(r["class"] for r in rows))
    if any(r["ratio"] for r in rows):
        ratio = {(r["class"], r["batch"]): r["ratio"] for r in rows}
        series = {f"B={b}": [ratio.get((c, b)) for c in classes] for b in batches}
        out.plots.append(Bars("spec_ratio.png", "speculation / none, output tokens/s", "ratio", classes, series,
                              xlabel="prompt class", hline=1.0))
    headline = [r for r in rows if (r["class"], r["batch"]) in _HEADLINES]
    out.summary = {f"{r['key']} ratio": r["ratio"] for r in headline if r["ratio"] is not None}
    out.summary |= {f"{r['key']} decode ratio": r["decode_ratio"] for r in headline if r["decode_ratio"] is not None}
    out.summary["greedy mismatches"] = float(len(ident["mismatches"]))
    return out


def main(argv: list[str]) -> None:
    """`graphexec-bench spec_worker JSON`: one side's run, its result as the last stdout line."""
    emit("spec worker", lambda: worker(json.loads(argv[0])))
