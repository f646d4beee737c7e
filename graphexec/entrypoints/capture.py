"""`graphexec-capture [overrides]`: capture and measure every bucket of the configured plan now,
store the decisions under `capture.cache_dir`, and print the plan (one line per bucket).

The same Hydra overrides as graphexec-generate and graphexec-serve: a plan is keyed by them, so
build it with the overrides the server will run with.  The compiled decode layers are saved
beside the plan (full_graph `compile.aot`, one artifact per kept bucket); their kernels' shared
objects stay in inductor's cache (TORCHINDUCTOR_CACHE_DIR), which a deployment ships too, or a
first start there rebuilds the C++ of each artifact it loads.
"""

from __future__ import annotations

import sys
import time

from omegaconf import DictConfig, OmegaConf

from graphexec.config import EngineConfig, config_dir
from graphexec.errors import GraphexecError


def _run(cfg: DictConfig) -> None:
    from graphexec.engine.engine import Engine

    OmegaConf.set_struct(cfg, False)
    cfg.capture.background = False  # capture before returning, not while serving
    try:
        config = EngineConfig.from_dictconfig(cfg)
        if config.capture.cache_dir is None:
            print("error: capture.cache_dir is null: there is nowhere to keep the plan", file=sys.stderr)
            sys.exit(2)
        t0 = time.perf_counter()
        engine = Engine(config=config)
        seconds = time.perf_counter() - t0
        stats = engine.metrics().backends
        plan_path = engine.runner.plan_path
        engine.shutdown()
    except GraphexecError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    print(format_plan(stats))
    print(f"capture plan {config.capture.name}: {plan_path} ({seconds:.1f} s)", file=sys.stderr)


def format_plan(per_mode: dict[str, dict]) -> str:
    """One line per bucket of each bucketed backend: state, eager and graph ms, speedup, capture
    seconds, where its compiled code came from (artifact loaded, compiled here), why."""
    lines = [
        f"{'modes':<16} {'bucket':>6} {'state':<8} {'eager ms':>9} {'graph ms':>9} {'speedup':>8} {'capture s':>9} {'code':<8}  reason"
    ]
    seen = set()
    for stats in per_mode.values():
        modes = ",".join(stats["modes"])
        if modes in seen:
            continue
        seen.add(modes)
        for bucket, entry in stats.get("buckets", {}).items():
            capture_s = stats["capture_seconds"].get(bucket)
            lines.append(
                f"{modes:<16} {bucket:>6} {entry['state']:<8} {_num(entry.get('eager_ms')):>9} {_num(entry.get('graph_ms')):>9} "
                f"{_num(entry.get('speedup'), 'x'):>8} {_num(capture_s):>9} {entry.get('origin') or '-':<8}  {entry.get('reason', '')}"
            )
    return "\n".join(lines)


def _num(value, suffix: str = "") -> str:
    return "-" if value is None else f"{value:.2f}{suffix}"


def main() -> None:
    import hydra

    hydra.main(version_base=None, config_path=str(config_dir()), config_name="capture_cmd")(_run)()


if __name__ == "__main__":
    main()
