"""`graphexec-bench`: the graph-capture benchmarking harness (a Hydra app).

    graphexec-bench bench=decode                      # one suite, the default (graph_first) plan
    graphexec-bench --multirun bench=e2e capture=eager,graph_first

Each run writes results.json (with the config, torch version and machine facts), report.md and
PNG plots into its Hydra run directory and prints the report; a sweep also writes
comparison.md and comparison.png into the sweep directory (bench/compare.py).
"""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from graphexec.config import config_dir


def _run(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    from bench.report import REPORT, run_suite
    from bench.suites import SuiteContext, load_suite

    hydra_cfg = HydraConfig.get()
    overrides = tuple(o for o in hydra_cfg.overrides.task if not o.startswith("bench"))
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
    import hydra

    hydra.main(version_base=None, config_path=str(config_dir()), config_name="bench")(_run)()


if __name__ == "__main__":
    main()
