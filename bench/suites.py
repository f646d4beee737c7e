"""The harness's suites, by name.  Each suite module provides

    run(cfg, ctx: SuiteContext) -> dict     # the measurements (JSON-serialisable)
    markdown(result) -> str                 # the report's tables
    plots(result, out_dir) -> list[str]     # PNG files written, relative to out_dir
    summary(result) -> dict[str, float]     # headline numbers, for the multirun comparison

and is imported only when chosen, so `graphexec-bench bench=e2e` never imports the other suites.
"""

from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

SUITES = {
    "decode": "bench.decode",
    "prefill": "bench.prefill",
    "capture": "bench.capture",
    "padding": "bench.padding",
    "e2e": "bench.e2e",
    "peer": "bench.peer",
    "serve": "bench.serve",
    "parallel": "bench.parallel",
    "spec": "bench.spec",
}


@dataclass(frozen=True)
class SuiteContext:
    out_dir: Path
    # The engine overrides given on the command line (bench.* excluded): fresh processes the
    # suite starts (cold/warm capture probes) are configured with exactly these.
    overrides: tuple[str, ...] = field(default_factory=tuple)
    progress: bool = True

    def say(self, message: str) -> None:
        """A progress line on stderr (stdout is the report's), when bench.progress is on."""
        if self.progress:
            print(message, file=sys.stderr, flush=True)


def load_suite(name: str) -> ModuleType:
    if name not in SUITES:
        raise ValueError(f"bench.suite={name!r} is unknown; choose one of {sorted(SUITES)}")
    return importlib.import_module(SUITES[name])


def build_engine(cfg):
    """The engine a suite measures, from the composed Hydra config, with every kept graph captured
    before it returns (never in the background while a suite times it)."""
    from omegaconf import OmegaConf

    from graphexec.config import EngineConfig
    from graphexec.engine.engine import Engine

    cfg = OmegaConf.merge(cfg, {"capture": {"background": False}})
    return Engine(config=EngineConfig.from_dictconfig(cfg))
