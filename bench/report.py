"""One suite run on disk: results.json (machine-readable), report.md (tables) and PNG plots.

The common result format: a suite's `run` returns its raw numbers (a JSON-serialisable dict, kept
whole in results.json) and its `report(result)` turns them into a `Report`: paragraphs and
`Table`s (cells are raw values, formatted here by bench/tables.py's `cell`), `Bars` plot specs
(or a callable for a figure of its own) and the summary numbers a multirun comparison lines up.
This module alone writes Markdown and draws (matplotlib's object API: no global state, no display).

A suite that fails still gets all three files: results.json with `status: failed` and the error,
and a report that says so, so a `--multirun` sweep goes on and its comparison shows the failure.
"""

from __future__ import annotations

import json
import os
import platform
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Mapping, Sequence

from bench.tables import table

RESULTS = "results.json"
REPORT = "report.md"


@dataclass
class Table:
    """A Markdown table under an optional `### title`: cells as values, formatted when written."""

    columns: Sequence[Any]
    rows: Sequence[Sequence[Any]]
    title: str = ""


@dataclass
class Bars:
    """A grouped bar chart: one group of bars per x label, one bar per series (None: no bar), and a
    dashed reference line at `hline` if given; drawn into a directory as `file`."""

    file: str
    title: str
    ylabel: str
    groups: Sequence[Any]
    series: Mapping[str, Sequence[float | None]]
    xlabel: str = ""
    log_y: bool = False
    hline: float | None = None

    def draw(self, out_dir: Path) -> str:
        from matplotlib.figure import Figure

        series, groups = self.series, self.groups
        fig = Figure(figsize=(max(5.0, 1.1 * len(groups) * max(1, len(series)) ** 0.5 + 2), 3.6), dpi=110)
        ax = fig.add_subplot()
        width = 0.8 / max(1, len(series))
        for i, (name, values) in enumerate(series.items()):
            xs = [g + (i - (len(series) - 1) / 2) * width for g in range(len(groups))]
            if pairs := [(x, v) for x, v in zip(xs, values) if v is not None]:
                bars = ax.bar([x for x, _ in pairs], [v for _, v in pairs], width=width, label=name)
                ax.bar_label(bars, fmt="%.3g", fontsize=7, padding=1)
        ax.set_xticks(range(len(groups)), [str(g) for g in groups])
        ax.set(title=self.title, ylabel=self.ylabel, xlabel=self.xlabel, yscale="log" if self.log_y else "linear")
        if self.hline is not None:
            ax.axhline(self.hline, color="grey", linestyle="--", linewidth=0.8)
        ax.margins(y=0.15)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(Path(out_dir) / self.file)
        return self.file


@dataclass
class Report:
    """What a suite's `report(result)` returns: blocks in order (a str is a paragraph), plots (a
    `Bars`, or a callable drawing into the run directory and returning its file name) and summary."""

    blocks: list[Any] = field(default_factory=list)
    plots: list[Any] = field(default_factory=list)
    summary: dict[str, float] = field(default_factory=dict)

    def markdown(self) -> str:
        parts = [(f"### {b.title}\n\n" if b.title else "") + table(b.columns, b.rows) if isinstance(b, Table) else b
                 for b in self.blocks]
        return "\n\n".join(parts) + "\n"

    def draw(self, out_dir: Path) -> list[str]:
        return [p.draw(out_dir) if isinstance(p, Bars) else p(out_dir) for p in self.plots]


def machine() -> dict[str, Any]:
    import torch

    return {
        "platform": platform.platform(),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),  # the ISA level torch dispatches to
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def run_suite(
    suite: ModuleType, name: str, run: Callable[[], dict[str, Any]], out_dir: Path, config: dict, label: str
) -> dict[str, Any]:
    """Run one suite and write its files; an exception becomes a failed run, not a crash."""
    started = time.time()
    payload: dict[str, Any] = {"suite": name, "label": label, "started": started, "config": config, "machine": machine()}
    try:
        payload |= {"status": "ok", "result": run()}
    except Exception as exc:  # the sweep goes on; the report shows what failed and where
        payload |= _failure("", exc)
    payload["seconds"] = time.time() - started
    write(out_dir, payload, suite)
    return payload


def _failure(where: str, exc: Exception) -> dict[str, Any]:
    return {"status": "failed", "error": f"{where}{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}


def write(out_dir: Path, payload: dict[str, Any], suite: ModuleType) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    body, plot_files = "", []
    if payload["status"] == "ok":
        try:
            report = suite.report(payload["result"])
            body, plot_files = report.markdown(), report.draw(out_dir)
            payload["summary"] = report.summary
        except Exception as exc:  # a report bug must not lose the measurements
            payload |= _failure("report: ", exc)
    payload["plots"] = plot_files
    (out_dir / RESULTS).write_text(json.dumps(payload, indent=2, default=str))
    (out_dir / REPORT).write_text(render(payload, body))


def render(payload: dict[str, Any], body: str) -> str:
    m = payload["machine"]
    gpu = f", {m['cuda']}" if m["cuda"] else ""
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(payload["started"]))
    head = [f"# graphexec-bench · {payload['suite']} · {payload['label']}", "",
            f"{m['cpu']} ({m['cpu_count']} CPUs, {m['torch_threads']} torch threads{gpu}) · torch {m['torch']} · "
            f"{when} · {payload['seconds']:.0f} s", ""]
    if payload["status"] != "ok":
        head += [f"**FAILED**: {payload['error']}", "", "```", payload.get("traceback", "").strip(), "```", ""]
    plots = [f"![{p}]({p})" for p in payload.get("plots", [])]
    return "\n".join(head) + "\n" + body + ("\n" + "\n".join(plots) + "\n" if plots else "")
