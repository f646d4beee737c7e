"""The harness's suites, by name.  Each suite module provides

    run(cfg, ctx: SuiteContext) -> dict     # the measurements (JSON-serialisable, kept in results.json)
    report(result) -> bench.report.Report   # tables, plot specs and headline numbers, as data

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


def checked_options(bench_cfg, ints: dict[str, int] | None = None, int_lists: dict[str, int] | None = None) -> dict:
    """bench.* as plain values.  `ints`: dotted key -> the least integer it may be; `int_lists`:
    dotted key -> the least length of a list of integers >= 1.  Errors name the option."""
    from omegaconf import OmegaConf

    o = OmegaConf.to_container(bench_cfg, resolve=True)
    for key, least in (ints or {}).items():
        value = _get(o, key)
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise ValueError(f"bench.{key}={value!r} must be an integer >= {least}")
    for key, least in (int_lists or {}).items():
        values = _get(o, key)
        good = isinstance(values, list) and len(values) >= least and all(isinstance(v, int) and v >= 1 for v in values)
        if not good:
            raise ValueError(f"bench.{key}={values!r} must be a list of at least {least} integers >= 1")
    return o


def _get(tree: dict, dotted: str):
    for part in dotted.split("."):
        tree = tree.get(part) if isinstance(tree, dict) else None
    return tree


def build_engine(cfg):
    """The engine a suite measures, from the composed Hydra config, with every kept graph captured
    before it returns (never in the background while a suite times it)."""
    from omegaconf import open_dict

    from graphexec.config import EngineConfig
    from graphexec.engine.engine import Engine

    cfg = cfg.copy()
    with open_dict(cfg):  # a plan without the key (capture=eager) is a struct without it
        cfg.capture.background = False
    return Engine(config=EngineConfig.from_dictconfig(cfg))
