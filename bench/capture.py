"""Capture suite: what starting an engine costs, per capture backend and bucket, cold and warm.

Each phase is a fresh `graphexec-bench capture_probe OVERRIDES` process (nothing compiled in
memory) with the run's engine overrides: `probe` below starts an engine there and prints, as one
JSON line, its start seconds, peak RSS and, per distinct capture backend, seconds and bytes per
bucket.  The phases share one inductor cache directory, new and empty for this run: the cold
phase compiles everything into it, the warm phase reuses what it left (with `compile.aot`,
loading each kept decode bucket's artifact from the plan directory: its seconds then read
"(artifact)").  A probe that fails is that phase's error, not raised, so the other phase still
counts.
"""

from __future__ import annotations

import os
import resource
import tempfile
import time
from typing import Any

from omegaconf import DictConfig, OmegaConf

from bench.report import Bars, Report, Table
from bench.tables import cell
from bench.workers import cache_env, emit, run_command
from graphexec.batch.forward_mode import ForwardMode

_ALLOWED_PHASES = (["cold"], ["cold", "warm"])


def run(cfg, ctx) -> dict[str, Any]:
    phases = list(cfg.bench.phases)
    if phases not in _ALLOWED_PHASES:
        raise ValueError(f"bench.phases={phases} must be one of {list(_ALLOWED_PHASES)} (cold runs first, on an empty cache)")
    # A cache_dir in the config wins over the environment (full_graph sets TORCHINDUCTOR_CACHE_DIR
    # from it), so every phase reads that directory as it was.
    configured = (OmegaConf.select(cfg, f"capture.{mode.config_key}.compile.cache_dir", default=None)
                  for mode in ForwardMode)
    explicit_cache_dirs = sorted({str(d) for d in configured if d})
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="graphexec-capture-cache-") as cache_dir:
        # Captured before the probe's engine returns, and the plan (which buckets keep their graphs)
        # stored in this run's directory: cold measures and stores it, warm loads it.
        overrides = [*ctx.overrides, "++capture.background=false", f"++capture.cache_dir={os.path.join(cache_dir, 'plans')}"]
        for phase in phases:
            ctx.say(f"capture suite: {phase} phase (fresh process, inductor cache {cache_dir}) ...")
            results[phase] = {"error": None} | run_command("capture_probe", overrides, float(cfg.bench.probe_timeout_s),
                                                           env=cache_env(cache_dir), label="probe",
                                                           option="bench.probe_timeout_s")
            outcome = results[phase]["error"] or f"engine started in {results[phase]['start_seconds']:.1f} s"
            ctx.say(f"capture suite: {phase} phase done: {outcome}")
    return {"phases": results, "backends": _merge_backends(results), "explicit_cache_dirs": explicit_cache_dirs,
            "cold_is_cold": not explicit_cache_dirs}


def _merge_backends(results: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per distinct backend (named by the first mode using it), each bucket's seconds
    and MiB side by side per phase; None where a phase failed or lacks that bucket."""
    merged: dict[str, dict[str, Any]] = {}
    for phase, result in results.items():
        for backend in result.get("backends", []):
            name = backend["modes"][0]
            entry = merged.setdefault(name, {"name": name, "modes": backend["modes"], "backend": backend["backend"], "buckets": {}})
            for row in backend["buckets"]:
                both = entry["buckets"].setdefault(row["bucket"], {"bucket": row["bucket"]})
                both |= {f"{phase}_seconds": row["seconds"], f"{phase}_mib": row["bytes"] / 2**20,
                         f"{phase}_state": row.get("state"), f"{phase}_origin": row.get("origin")}
                for key in ("eager_ms", "graph_ms", "speedup", "reason"):
                    if row.get(key) is not None:
                        both.setdefault(key, row[key])  # measured once (cold); warm loads the decision
    for entry in merged.values():
        entry["buckets"] = [entry["buckets"][b] for b in sorted(entry["buckets"])]
    return list(merged.values())


def report(result: dict[str, Any]) -> Report:
    phases = list(result["phases"])
    if result["cold_is_cold"]:
        head = "Inductor cache: a new empty directory for this run; cold compiles into it, warm reuses it."
    else:
        dirs = ", ".join(result["explicit_cache_dirs"])
        head = f"**Cold is not cold**: the config sets compile.cache_dir ({dirs}), which every phase reads as it was."
    mib = lambda n: None if n is None else n / 2**20  # noqa: E731
    out = Report([head, Table(["phase", "engine start s", "process s", "peak RSS MiB", "error"], [
        [phase, p.get("start_seconds"), p["process_seconds"], mib(p.get("peak_rss_bytes")), p["error"] or ""]
        for phase, p in result["phases"].items()])])
    for phase, p in result["phases"].items():
        if p["error"] is None:
            out.summary |= {f"{phase} engine start s": p["start_seconds"], f"{phase} peak RSS MiB": mib(p["peak_rss_bytes"])}
    for backend in result["backends"]:
        _backend_report(out, backend, phases)
    return out


def _backend_report(out: Report, backend: dict[str, Any], phases: list[str]) -> None:
    name, rows = backend["name"], backend["buckets"]
    shared = [m for m in backend["modes"] if m != name]
    title = f"{name}: {backend['backend']}" + (f" (shared by {', '.join(shared)})" if shared else "")
    if not rows:
        out.blocks.append(f"### {title}\n\nNothing captured (no buckets).")
        return
    cells = []
    for row in rows:
        # "(artifact)": the bucket's compiled layer was loaded, not compiled (compile.aot).
        seconds = [cell(row.get(f"{ph}_seconds")) + (" (artifact)" if row.get(f"{ph}_origin") == "artifact" else "")
                   for ph in phases]
        state = row.get(f"{phases[-1]}_state") or "—"
        decision = state if not row.get("reason") else f"{state} ({row['reason']})"
        cells.append([row["bucket"], row.get("eager_ms"), row.get("graph_ms"), row.get("speedup"), decision, *seconds,
                      *(row.get(f"{ph}_mib") for ph in phases)])
    out.blocks.append(Table(["bucket", "eager ms", "graph ms", "speedup", "decision", *(f"{ph} s" for ph in phases),
                             *(f"{ph} MiB" for ph in phases)], cells, title))
    if len(phases) > 1:
        out.blocks.append(f"{phases[-1]} s of a kept bucket is what loading its graph costs with the cache and plan "
                          "warm; a dropped bucket is not compiled there at all.")
    out.plots.append(Bars(f"capture_{name}.png", f"{name} capture ({backend['backend']})", "seconds",
                          [row["bucket"] for row in rows],
                          {ph: [row.get(f"{ph}_seconds") for row in rows] for ph in phases}, "bucket"))
    for phase in phases:
        seconds = [row[f"{phase}_seconds"] for row in rows if row.get(f"{phase}_seconds") is not None]
        if seconds:
            out.summary[f"{name} {phase} s total"] = sum(seconds)


# ---------------------------------------------------------------------------------------------
# the probe: a fresh process's engine start


def config_without_progress_bars(overrides: list[str]):
    """The engine config for `overrides`, with capture progress bars off: they would bury the
    error line on stderr.  Capture happens before the engine returns (`capture.background=false`),
    so what is timed is the plan's steady state.  Modes that alias another mode's spec
    (`mixed: ${.extend}`) are left alone, so they keep resolving to the very same spec and still
    share its backend."""
    from graphexec.config import EngineConfig, compose  # imported here: part of the timed start

    cfg = compose(overrides)
    quiet = [f"capture.{key}.progress=false" for key in (mode.config_key for mode in ForwardMode)
             if key in cfg.capture and not OmegaConf.is_interpolation(cfg.capture, key)
             and isinstance(cfg.capture[key], DictConfig) and "progress" in cfg.capture[key]]
    return EngineConfig.from_dictconfig(compose([*overrides, *quiet, "++capture.background=false"]))


def distinct_backends(runner) -> list[dict[str, Any]]:
    """One entry per backend instance: modes sharing a spec share one instance (ModelRunner
    builds one per distinct spec), so `backend_stats()`, keyed by mode, would count it twice."""
    by_instance: dict[int, dict[str, Any]] = {}
    for mode, backend in runner.backends.items():
        stats = backend.stats
        entry = by_instance.setdefault(id(backend), {
            "modes": [], "backend": backend.name, "buckets": [],
            "executions": stats.executions, "fallbacks": stats.fallbacks, "padded_rows": stats.padded_rows,
        })
        entry["modes"].append(mode.config_key)
        if entry["buckets"]:
            continue
        # Every bucket with a state: a dropped one has no capture seconds when a stored plan
        # skipped it, and its timings when it was measured here.
        entry["buckets"] = [
            {"bucket": bucket, "seconds": stats.capture_seconds.get(bucket), "bytes": stats.capture_bytes.get(bucket, 0),
             "state": stats.states.get(bucket),
             "origin": stats.origins.get(bucket)}  # artifact (loaded) | compiled | dynamo | None
            | (stats.decisions[bucket].as_dict() if bucket in stats.decisions else {})
            for bucket in sorted(set(stats.capture_seconds) | set(stats.states))
        ]
    return list(by_instance.values())


def peak_rss_bytes() -> int:
    # ru_maxrss is KiB on Linux.  Inductor's compile workers are other processes: not counted.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def probe(overrides: list[str]) -> dict[str, Any]:
    t0 = time.perf_counter()
    from graphexec import Engine

    engine = Engine(config=config_without_progress_bars(overrides))
    return {"start_seconds": time.perf_counter() - t0, "peak_rss_bytes": peak_rss_bytes(),
            "backends": distinct_backends(engine.runner)}


def main(argv: list[str]) -> None:
    emit("probe", lambda: probe(argv))
