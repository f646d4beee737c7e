"""`graphexec-bench`: every benchmark behind one command.

Suites (a Hydra app; configs/bench/*.yaml, bench/suites.py):

    graphexec-bench bench=decode                      # one suite, the default (graph_first) plan
    graphexec-bench --multirun bench=e2e capture=eager,graph_first

Each run writes results.json (with the config, torch version and machine facts), report.md and
PNG plots into its Hydra run directory and prints the report; a sweep also writes
comparison.md and comparison.png into the sweep directory (bench/compare.py).

Commands (their own options; `graphexec-bench <command> --help`):

    graphexec-bench startup --plans eager auto --rounds 2
    graphexec-bench compare multirun/bench/e2e/2026-11-29_12-00-00

bench/README.md lists them all.  `python -m bench.cli ...` is the same entry point (what the
fresh-process workers run, bench/workers.py).
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

# Command -> module with main(argv) -> exit status or None.  The workers are commands too, so a
# parent starts them as `python -m bench.cli <worker> ...` (bench/workers.py).
COMMANDS = {
    "agent_check": "bench.agent_check",
    "attention_kernels": "bench.attention_kernels",
    "compare": "bench.compare",
    "gpu_check": "bench.gpu_check",
    "host_overhead": "bench.host_overhead",
    "loader": "bench.loader",
    "lm_eval_check": "bench.lm_eval_check",
    "moe_decode": "bench.moe_decode",
    "overload": "bench.overload",
    "penalties": "bench.penalties",
    "quant_kernels": "bench.quant_kernels",
    "startup": "bench.startup",
    "step_message": "bench.step_message",
    "step_profile": "bench.step_profile",
    "structured_cost": "bench.structured_cost",
    "tp_step": "bench.tp_step",
    # fresh-process workers of the capture, peer, parallel and spec suites
    "capture_probe": "bench.capture",
    "peer_worker": "bench.peer_worker",
    "spec_worker": "bench.spec",
}


def _run(cfg) -> None:
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    from bench.report import REPORT, run_suite
    from bench.suites import SuiteContext, load_suite

    hydra_cfg = HydraConfig.get()
    overrides = tuple(o for o in hydra_cfg.overrides.task if not o.lstrip("+~").startswith("bench"))
    out_dir = Path(hydra_cfg.runtime.output_dir)
    suite = load_suite(cfg.bench.suite)
    ctx = SuiteContext(out_dir=out_dir, overrides=overrides, progress=bool(cfg.bench.get("progress", True)))
    label = " ".join(overrides) or "defaults"
    config = OmegaConf.to_container(cfg, resolve=True)
    payload = run_suite(suite, cfg.bench.suite, lambda: suite.run(cfg, ctx), out_dir, config, label)
    print((out_dir / REPORT).read_text())
    print(f"written to {out_dir}")
    if payload["status"] != "ok" and hydra_cfg.mode.name != "MULTIRUN":
        raise SystemExit(1)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] in COMMANDS:
        command = sys.argv.pop(1)
        sys.argv[0] = f"graphexec-bench {command}"  # argparse's prog
        raise SystemExit(importlib.import_module(COMMANDS[command]).main(sys.argv[1:]))
    import hydra

    from graphexec.config import config_dir

    hydra.main(version_base=None, config_path=str(config_dir()), config_name="bench")(_run)()


if __name__ == "__main__":
    main()
