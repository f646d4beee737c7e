"""One comparison across the runs of a `--multirun` sweep, from each run's results.json (a failed run
is listed with its error): comparison.md and a plot per suite in the sweep directory.  Hydra calls it
at the end of a sweep (configs/bench.yaml registers the callback); by hand, on any directory of runs:

    graphexec-bench compare multirun/bench/e2e/2026-11-29_12-00-00
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from hydra.experimental.callback import Callback

from bench.report import RESULTS, Bars
from bench.suites import load_suite
from bench.tables import sig3, table


def write_comparison(sweep_dir: Path) -> Path | None:
    # Every run's results.json with its directory's name, in job order (0, 1, ... 10, then others).
    paths = sorted(sweep_dir.glob(f"*/{RESULTS}"),
                   key=lambda p: (int(p.parent.name) if p.parent.name.isdigit() else sys.maxsize, p.parent.name))
    runs = [json.loads(path.read_text()) | {"run_dir": path.parent.name} for path in paths]
    if not runs:
        return None
    suites = sorted({r["suite"] for r in runs})
    lines = [f"# graphexec-bench comparison · {', '.join(suites)} · {len(runs)} runs", ""]
    for suite in suites:
        lines += _suite_section(sweep_dir, suite, [r for r in runs if r["suite"] == suite])
    out = sweep_dir / "comparison.md"
    out.write_text("\n".join(lines))
    return out


def _suite_section(sweep_dir: Path, suite: str, group: list[dict]) -> list[str]:
    keys = list(dict.fromkeys(k for r in group for k in r.get("summary", {})))
    common = [o for o in group[0]["label"].split() if all(o in r["label"].split() for r in group)]
    # Each run named by the overrides that differ between runs, then its job number.
    names = {r["run_dir"]: " ".join(o for o in r["label"].split() if o not in common) + f" (#{r['run_dir']})"
             for r in group}
    rows = [[names[r["run_dir"]], *([sig3(r["summary"].get(k)) for k in keys] if r["status"] == "ok"
                                    else [f"FAILED: {r['error']}", *[""] * (len(keys) - 1)])] for r in group]
    lines = [f"## {suite}", "", f"Overrides every run shares: {' '.join(common) or 'none'}", "",
             table(["run", *keys], rows), ""]
    # The summary numbers in the suite's comparison unit (its COMPARE_UNIT), else the first few.
    unit = getattr(load_suite(suite), "COMPARE_UNIT", None)
    plotted = [k for k in keys if unit and unit in k] or keys[:6]
    if (ok := [r for r in group if r["status"] == "ok"]) and plotted:
        name = Bars(f"comparison_{suite}.png", f"{suite}: runs compared", unit or "", plotted,
                    {names[r["run_dir"]]: [r["summary"].get(k) for k in plotted] for r in ok}).draw(sweep_dir)
        lines += [f"![{name}]({name})", ""]
    return lines


class ComparisonReport(Callback):
    """Hydra callback: after a sweep, compare its runs."""

    def on_multirun_end(self, config, **kwargs) -> None:
        if (out := write_comparison(Path(config.hydra.sweep.dir))) is not None:
            print(out.read_text())
            print(f"written to {out}")


def main(argv: list[str]) -> None:
    if len(argv) != 1:
        sys.exit("usage: graphexec-bench compare SWEEP_DIR")
    if (out := write_comparison(Path(argv[0]))) is None:
        sys.exit(f"error: no */{RESULTS} under {argv[0]}")
    print(out.read_text())
