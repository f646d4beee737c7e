"""`graphexec-bench`: the graph-capture benchmarking harness (a Hydra app).

Writes results.json (with the config, torch version and machine facts) and report.md into the
Hydra run directory and prints the report.
"""

from __future__ import annotations

import json
import os
import platform
import sys
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from graphexec.config import config_dir

SUITES = ("decode", "prefill")


def _machine() -> dict:
    import torch

    return {
        "platform": platform.platform(),
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }


def _run(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    from bench import decode, prefill
    from graphexec.config import EngineConfig
    from graphexec.engine import Engine

    if cfg.bench.suite not in SUITES:
        sys.exit(f"error: bench.suite={cfg.bench.suite!r} is unknown; choose one of {list(SUITES)}")
    overrides = [o for o in HydraConfig.get().overrides.task if not o.startswith("bench")]
    engine = Engine(config=EngineConfig.from_dictconfig(cfg))
    if cfg.bench.suite == "prefill":
        result = prefill.run(engine, cfg)
        report = prefill.markdown(result)
    else:
        result = decode.run(engine, cfg, ["capture=graph_first", *overrides])
        report = decode.markdown(result)
    out_dir = Path(HydraConfig.get().runtime.output_dir)
    payload = {"suite": cfg.bench.suite, "config": OmegaConf.to_container(cfg, resolve=True), "machine": _machine(), "result": result}
    (out_dir / "results.json").write_text(json.dumps(payload, indent=2))
    (out_dir / "report.md").write_text(report)
    print(report)
    print(f"written to {out_dir}")


def main() -> None:
    import hydra

    hydra.main(version_base=None, config_path=str(config_dir()), config_name="bench")(_run)()


if __name__ == "__main__":
    main()
