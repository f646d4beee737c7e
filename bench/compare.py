"""One comparison across the runs of a `--multirun` sweep: comparison.md and comparison.png in the
sweep directory, from each run's results.json (a failed run is listed with its error).

Hydra calls it at the end of a sweep (configs/bench.yaml registers the callback); it also runs
on any directory holding run directories:

    graphexec-bench compare multirun/bench/e2e/2026-11-29_12-00-00
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback

from bench.plots import grouped_bars
from bench.report import RESULTS
from bench.suites import load_suite
from bench.tables import sig3, table

COMPARISON = "comparison.md"


def load_runs(sweep_dir: Path) -> list[dict[str, Any]]:
    runs = []
    for path in sorted(sweep_dir.glob(f"*/{RESULTS}"), key=lambda p: _job_order(p.parent.name)):
        payload = json.loads(path.read_text())
        payload["run_dir"] = path.parent.name
        runs.append(payload)
    return runs


def _job_order(name: str) -> tuple[int, str]:
    return (int(name), name) if name.isdigit() else (sys.maxsize, name)


def write_comparison(sweep_dir: Path) -> Path | None:
    runs = load_runs(sweep_dir)
    if not runs:
        return None
    suites = sorted({r["suite"] for r in runs})
    lines = [f"# graphexec-bench comparison · {', '.join(suites)} · {len(runs)} runs", ""]
    plot_files = []
    for suite in suites:
        group = [r for r in runs if r["suite"] == suite]
        keys = _keys(group)
        names = _distinct_labels(group)
        common = " ".join(_common_overrides(group))
        rows = [[names[run["run_dir"]], *([sig3(run["summary"].get(k)) for k in keys] if run["status"] == "ok"
                                          else [f"FAILED: {run['error']}", *[""] * (len(keys) - 1)])] for run in group]
        lines += [f"## {suite}", "", f"Overrides every run shares: {common or 'none'}", "", table(["run", *keys], rows), ""]
        plotted = _plot_keys(suite, keys)
        ok = [r for r in group if r["status"] == "ok"]
        if ok and plotted:
            unit = getattr(load_suite(suite), "COMPARE_UNIT", "")
            name = grouped_bars(
                sweep_dir / f"comparison_{suite}.png", f"{suite}: runs compared", unit,
                plotted, {names[r["run_dir"]]: [r["summary"].get(k) for k in plotted] for r in ok},
            )
            plot_files.append(name)
            lines += [f"![{name}]({name})", ""]
    out = sweep_dir / COMPARISON
    out.write_text("\n".join(lines))
    return out


def _common_overrides(group: list[dict[str, Any]]) -> list[str]:
    first = group[0]["label"].split()
    return [o for o in first if all(o in r["label"].split() for r in group)]


def _distinct_labels(group: list[dict[str, Any]]) -> dict[str, str]:
    """Each run named by the overrides that differ between runs, then its job number."""
    common = set(_common_overrides(group))
    return {
        r["run_dir"]: " ".join(o for o in r["label"].split() if o not in common) + f" (#{r['run_dir']})"
        for r in group
    }


def _keys(group: list[dict[str, Any]]) -> list[str]:
    keys: list[str] = []
    for run in group:
        keys += [k for k in run.get("summary", {}) if k not in keys]
    return keys


def _plot_keys(suite: str, keys: list[str]) -> list[str]:
    """The summary numbers in the suite's comparison unit (its COMPARE_UNIT), else the first few."""
    unit = getattr(load_suite(suite), "COMPARE_UNIT", None)
    chosen = [k for k in keys if unit and unit in k]
    return chosen or keys[:6]


class ComparisonReport(Callback):
    """Hydra callback: after a sweep, compare its runs."""

    def on_multirun_end(self, config, **kwargs) -> None:
        out = write_comparison(Path(config.hydra.sweep.dir))
        if out is not None:
            print(out.read_text())
            print(f"written to {out}")


def main(argv: list[str]) -> None:
    if len(argv) != 1:
        sys.exit("usage: graphexec-bench compare SWEEP_DIR")
    out = write_comparison(Path(argv[0]))
    if out is None:
        sys.exit(f"error: no */{RESULTS} under {argv[0]}")
    print(out.read_text())
