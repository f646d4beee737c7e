"""What a user waits for at start-up, per capture plan, each run a fresh process, plans alternated: a
Markdown table of medians over rounds (`--json` writes every run, with each decode bucket's seconds to
ready and its capture or load seconds):

  engine s      Engine(...) returns (weights loaded; with capture.background=false, graphs too)
  first token s a 32-token prompt's first token, submitted right after
  B=1 live s    from Engine(...) until decode B=1 serves a graph or its stand-in (`compile.interim_buckets`)
  all live s    ... until every decode bucket serves a graph or a stand-in, or was dropped
  all ready s   ... until no bucket is pending (background capture; eager: engine + first token)
  B=1 ms/token  128 greedy tokens after that (prefix cache flushed), the plan's steady state
  probe s       with --probe-every S: a 16-token request every S s while buckets are pending, median and worst
                (each probe also holds the capture back, so all ready s grows)
  compiled      Dynamo graphs traced, decode layers loaded from artifacts / compiled ahead of time

    graphexec-bench startup --plans eager auto --rounds 2           # warm: caches filled by an untimed run
    graphexec-bench startup --plans eager auto --rounds 1 --cold    # each run: empty inductor cache and plan dir
    graphexec-bench startup --plans eager auto_blocking auto_blocking_aot_compile auto_blocking_dynamo --capture-overrides capture.decode.keep=all
        # every decode graph live before the engine returns: AOTInductor packages, aot_compile's artifacts, Dynamo
    graphexec-bench startup --plans auto auto_in_loop --rounds 1 --cold --probe-every 5
        # requests during a cold background capture: compiled in the capture process / on the engine loop
    graphexec-bench startup --plans auto auto_no_interim --rounds 2 --cold
        # a cold start with and without stand-ins (compile.interim_buckets) while the package compiles
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from contextlib import nullcontext

from bench.report import machine
from bench.stats import median
from bench.tables import machine_line, table
from bench.workers import cache_env, run_python

_WORKER = r"""
import json, sys, time
t0 = time.perf_counter()
from graphexec import Engine, SamplingParams
probe_every = float(sys.argv[1])
engine = Engine(overrides=sys.argv[2:])
engine_s = time.perf_counter() - t0
def timed(ids, tokens, **params):  # seconds for one greedy request; the ids folded into a small vocabulary
    prompt = [i % engine.model_config.vocab_size for i in ids]
    t = time.perf_counter()
    engine.generate([prompt], SamplingParams(max_new_tokens=tokens, temperature=0.0, **params))
    return time.perf_counter() - t
first_s, probes, next_probe = timed(range(1000, 1032), 1), [], time.perf_counter() + probe_every
live = {}  # B=1 / all -> seconds from t0 until live (serving a graph or a stand-in, or dropped)
while engine.runner.capture_pending():
    states = [s["state"] for s in engine.runner.backend_stats()["decode"].get("buckets", {}).values()]
    for name, which in (("b1", states[:1]), ("all", states)):
        if name not in live and all(s in ("interim", "ready", "dropped") for s in which):
            live[name] = time.perf_counter() - t0
    if probe_every and time.perf_counter() >= next_probe:
        probes.append(timed(range(3000, 3008), 16, ignore_eos=True))
        next_probe = time.perf_counter() + probe_every
    time.sleep(0.05)
ready_s = time.perf_counter() - t0
engine.flush_cache()
ms = timed(range(2000, 2032), 128, ignore_eos=True) / 128 * 1000
decode = engine.runner.backend_stats()["decode"]
buckets = decode.get("buckets", {})
from torch._dynamo.utils import counters
result = {"engine_s": engine_s, "first_token_s": first_s, "b1_live_s": live.get("b1", ready_s),
          "all_live_s": live.get("all", ready_s), "all_ready_s": ready_s, "b1_ms_per_token": ms,
          "decode_buckets": {b: s["state"] for b, s in buckets.items()},
          "ready_after_s": {b: s["ready_after_s"] for b, s in buckets.items()},
          "interim_after_s": {b: s["interim_after_s"] for b, s in buckets.items()},
          "capture_s": decode.get("capture_seconds", {}), "probes_s": probes,
          "dynamo_graphs": counters["stats"]["unique_graphs"], "artifacts_loaded": decode.get("artifacts_loaded", 0),
          "aot_compiles": decode.get("aot_compiles", 0)}
engine.shutdown()
print(json.dumps(result))
"""

# auto[_blocking][_dynamo | _aot_compile]: captured before Engine() returns; the decode layer traced by Dynamo on
# every start / aot_compile's artifacts rather than AOTInductor packages.
_PLANS = {"eager": ["capture=eager"], "graph_first": ["capture=graph_first"],
          "auto_in_loop": ["capture=auto", "capture.compile_in_child=false"],
          "auto_no_interim": ["capture=auto", "capture.decode.compile.interim_buckets=[]"]} | {
    f"auto{blocking}{kind}": ["capture=auto", *(["capture.background=false"] if blocking else []), *extra]
    for blocking in ("", "_blocking") for kind, extra in (("", []), ("_dynamo", ["capture.decode.compile.aot=false"]),
                                                         ("_aot_compile", ["capture.decode.compile.aoti=false"]))}


def _run(plan: str, args, shared: str | None, probe_every: float = 0.0) -> dict:
    """One start-up in a fresh process, its compile caches and plan dir in `shared` (None: new, empty)."""
    with nullcontext(shared) if shared else tempfile.TemporaryDirectory(prefix="graphexec-startup-cold-") as cache_dir:
        # --capture-overrides for the capture plans only (eager has no decode buckets to keep or compile).
        overrides = [*_PLANS[plan], *args.overrides, *([] if plan == "eager" else args.capture_overrides),
                     f"++capture.cache_dir={os.path.join(cache_dir, 'plans')}"]
        result = {"plan": plan} | run_python(["-c", _WORKER, str(probe_every), *overrides], args.timeout,
                                             env=cache_env(cache_dir), label="start-up run")
    return result if "error" in result or result["exit_code"] == 0 else result | {"error": result["exit_error"]}


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--plans", nargs="+", default=["eager", "auto"], choices=sorted(_PLANS))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--cold", action="store_true", help="every run starts from an empty inductor cache and plan dir")
    parser.add_argument("--timeout", type=float, default=1200)
    parser.add_argument("--probe-every", type=float, default=0.0, help="seconds between requests while buckets are pending (0: none)")
    parser.add_argument("--json", help="write every run here")
    parser.add_argument("--overrides", nargs="*", default=[], help="more engine overrides for every plan")
    parser.add_argument("--capture-overrides", nargs="*", default=[], help="more engine overrides for every plan but eager")
    args = parser.parse_args(argv)
    runs = []
    with tempfile.TemporaryDirectory(prefix="graphexec-startup-") as shared:
        if not args.cold:
            for plan in args.plans:  # fill the shared caches, untimed
                _run(plan, args, shared)
        for plan in [plan for _ in range(args.rounds) for plan in args.plans]:
            runs.append(_run(plan, args, None if args.cold else shared, args.probe_every))
            print(json.dumps(runs[-1]), file=sys.stderr, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine(), "cold": args.cold, "runs": runs}, f, indent=1)
    print(f"{machine_line()}; {'cold' if args.cold else 'warm'} caches; medians of {args.rounds} round(s)\n")
    print(table(["plan", "engine s", "first token s", "B=1 live s", "all live s", "all ready s", "B=1 ms/token", "decode buckets kept", "dynamo graphs",
                 "artifacts loaded", "probes", "probe median s", "probe worst s"], [_row(plan, runs) for plan in args.plans]))


def _row(plan: str, runs: list[dict]) -> list:
    ok = [r for r in runs if r["plan"] == plan and "error" not in r]
    if not ok:
        return [plan, f"failed: {[r.get('error') for r in runs if r['plan'] == plan][:1]}", *[""] * 11]
    probes, last = [p for r in ok for p in r.get("probes_s", [])], ok[-1]
    keys = ("engine_s", "first_token_s", "b1_live_s", "all_live_s", "all_ready_s", "b1_ms_per_token")
    return [plan, *(median(r[k] for r in ok) for k in keys),
            ",".join(b for b, s in last["decode_buckets"].items() if s == "ready") or None, last.get("dynamo_graphs"),
            last.get("artifacts_loaded"), len(probes), median(probes), max(probes, default=None)]
