"""What a user waits for at start-up, per capture plan, each run a fresh process, plans alternated:

  engine s      Engine(...) returns (weights loaded; with capture.background=false, graphs too)
  first token s a 32-token prompt's first token, submitted right after
  all ready s   from Engine(...) until no bucket is pending (background capture; eager: engine + first token)
  B=1 ms/token  128 greedy tokens after that (prefix cache flushed), the plan's steady state
  probe s       with --probe-every S: a 16-token request every S seconds while buckets are pending,
                its wall time, median and worst (what a request meets during background capture;
                each probe also holds the capture back, so all ready s grows)

    graphexec-bench startup --plans eager auto --rounds 2                      # warm caches
    graphexec-bench startup --plans eager auto --rounds 1 --cold               # each run: empty inductor cache and plan dir
    graphexec-bench startup --plans eager auto_blocking auto_blocking_aot_compile auto_blocking_dynamo --capture-overrides capture.decode.keep=all
        # every decode graph live before the engine returns: AOTInductor packages (compile.aoti), against
        # aot_compile's artifacts (compile.aoti=false), against Dynamo over inductor's warm cache
        # (compile.aot=false), the same buckets on each side
    graphexec-bench startup --plans auto auto_in_loop --rounds 1 --cold --probe-every 5
        # requests during a cold background capture: compiled by the capture process against on
        # the engine loop (capture.compile_in_child=false)

Each run also reports what its process compiled: Dynamo graphs traced (torch's unique_graphs
counter) and decode layers loaded from artifacts / compiled ahead of time; `--json` has each
decode bucket's seconds from the runner's creation to ready and its capture (or load) seconds.

Warm runs share one inductor cache and plan directory, filled by an untimed run of each plan
first.  Prints a Markdown table (medians over rounds) and the machine's CPU; `--json` writes the runs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

from bench.report import machine
from bench.stats import median
from bench.tables import machine_line, table
from bench.workers import run_python

_WORKER = r"""
import json, sys, time
t0 = time.perf_counter()
from graphexec import Engine, SamplingParams
probe_every = float(sys.argv[1])
engine = Engine(overrides=sys.argv[2:])
engine_s = time.perf_counter() - t0
t1 = time.perf_counter()
engine.generate([list(range(1000, 1032))], SamplingParams(max_new_tokens=1, temperature=0.0))
first_s = time.perf_counter() - t1
probes = []
next_probe = time.perf_counter() + probe_every
while engine.runner.capture_pending():
    if probe_every and time.perf_counter() >= next_probe:
        tp = time.perf_counter()
        engine.generate([list(range(3000, 3008))], SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True))
        probes.append(time.perf_counter() - tp)
        next_probe = time.perf_counter() + probe_every
    time.sleep(0.05)
ready_s = time.perf_counter() - t0
engine.flush_cache()
t2 = time.perf_counter()
engine.generate([list(range(2000, 2032))], SamplingParams(max_new_tokens=128, temperature=0.0, ignore_eos=True))
ms = (time.perf_counter() - t2) / 128 * 1000
decode = engine.runner.backend_stats()["decode"]
kept = {b: s["state"] for b, s in decode.get("buckets", {}).items()}
ready_after = {b: s["ready_after_s"] for b, s in decode.get("buckets", {}).items()}
from torch._dynamo.utils import counters
compiled = {"dynamo_graphs": counters["stats"]["unique_graphs"], "artifacts_loaded": decode.get("artifacts_loaded", 0),
            "aot_compiles": decode.get("aot_compiles", 0)}
engine.shutdown()
print(json.dumps({"engine_s": engine_s, "first_token_s": first_s, "all_ready_s": ready_s, "b1_ms_per_token": ms,
                  "decode_buckets": kept, "ready_after_s": ready_after, "capture_s": decode.get("capture_seconds", {}),
                  "probes_s": probes} | compiled))
"""

_NO_AOT = ["capture.decode.compile.aot=false"]  # the decode layer traced by Dynamo on every start
_AOT_COMPILE = ["capture.decode.compile.aoti=false"]  # aot_compile's artifacts, not AOTInductor packages
_PLANS = {"eager": ["capture=eager"], "auto": ["capture=auto"], "auto_blocking": ["capture=auto", "capture.background=false"],
          "auto_in_loop": ["capture=auto", "capture.compile_in_child=false"],
          "auto_dynamo": ["capture=auto", *_NO_AOT], "auto_blocking_dynamo": ["capture=auto", "capture.background=false", *_NO_AOT],
          "auto_aot_compile": ["capture=auto", *_AOT_COMPILE],
          "auto_blocking_aot_compile": ["capture=auto", "capture.background=false", *_AOT_COMPILE],
          "graph_first": ["capture=graph_first"]}


def _run(plan: str, cache_dir: str, timeout_s: float, extra: list[str], capture_extra: list[str], probe_every: float = 0.0) -> dict:
    env = {"TORCHINDUCTOR_CACHE_DIR": os.path.join(cache_dir, "inductor")}
    # capture_extra for the capture plans only (eager has no decode buckets to keep or compile).
    extra = [*extra, *([] if plan == "eager" else capture_extra)]
    overrides = [*_PLANS[plan], *extra, f"++capture.cache_dir={os.path.join(cache_dir, 'plans')}"]
    result = {"plan": plan} | run_python(["-c", _WORKER, str(probe_every), *overrides], timeout_s, env=env, label="start-up run")
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
                _run(plan, shared, args.timeout, args.overrides, args.capture_overrides)
        for _ in range(args.rounds):
            for plan in args.plans:
                if args.cold:
                    with tempfile.TemporaryDirectory(prefix="graphexec-startup-cold-") as fresh:
                        runs.append(_run(plan, fresh, args.timeout, args.overrides, args.capture_overrides, args.probe_every))
                else:
                    runs.append(_run(plan, shared, args.timeout, args.overrides, args.capture_overrides, args.probe_every))
                print(json.dumps(runs[-1]), file=sys.stderr, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine(), "cold": args.cold, "runs": runs}, f, indent=1)
    print(f"{machine_line()}; {'cold' if args.cold else 'warm'} caches; medians of {args.rounds} round(s)\n")
    print(table(["plan", "engine s", "first token s", "all ready s", "B=1 ms/token", "decode buckets kept", "dynamo graphs",
                 "artifacts loaded", "probes", "probe median s", "probe worst s"], [_row(plan, runs) for plan in args.plans]))


def _row(plan: str, runs: list[dict]) -> list:
    ok = [r for r in runs if r["plan"] == plan and "error" not in r]
    if not ok:
        return [plan, f"failed: {[r.get('error') for r in runs if r['plan'] == plan][:1]}", *[""] * 9]
    med = {k: median(r[k] for r in ok) for k in ("engine_s", "first_token_s", "all_ready_s", "b1_ms_per_token")}
    kept = ",".join(b for b, s in ok[-1]["decode_buckets"].items() if s == "ready") or "—"
    return [plan, f"{med['engine_s']:.1f}", f"{med['first_token_s']:.2f}", f"{med['all_ready_s']:.1f}",
            f"{med['b1_ms_per_token']:.1f}", kept, ok[-1].get("dynamo_graphs", "—"), ok[-1].get("artifacts_loaded", "—"),
            *_probes([p for r in ok for p in r.get("probes_s", [])])]


def _probes(seconds: list[float]) -> list:
    if not seconds:
        return [0, "—", "—"]
    return [len(seconds), f"{median(seconds):.2f}", f"{max(seconds):.2f}"]
