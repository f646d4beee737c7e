"""PNG plots for the reports.  Uses matplotlib's object API (no pyplot), so plotting touches no
global state and needs no display."""

from __future__ import annotations

from pathlib import Path
from typing import Mapping, Sequence


def grouped_bars(
    path: Path,
    title: str,
    ylabel: str,
    groups: Sequence[str],
    series: Mapping[str, Sequence[float | None]],
    xlabel: str = "",
    log_y: bool = False,
    hline: float | None = None,
) -> str:
    """One group of bars per x label, one bar per series (None: no bar), and a dashed reference
    line at `hline` if given; returns the file name."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(max(5.0, 1.1 * len(groups) * max(1, len(series)) ** 0.5 + 2), 3.6), dpi=110)
    ax = fig.add_subplot()
    width = 0.8 / max(1, len(series))
    for i, (name, values) in enumerate(series.items()):
        xs = [g + (i - (len(series) - 1) / 2) * width for g in range(len(groups))]
        pairs = [(x, v) for x, v in zip(xs, values) if v is not None]
        if pairs:
            bars = ax.bar([x for x, _ in pairs], [v for _, v in pairs], width=width, label=name)
            ax.bar_label(bars, fmt="%.3g", fontsize=7, padding=1)
    ax.set_xticks(range(len(groups)), [str(g) for g in groups])
    ax.set_title(title)
    ax.set_ylabel(ylabel)
    if xlabel:
        ax.set_xlabel(xlabel)
    if log_y:
        ax.set_yscale("log")
    if hline is not None:
        ax.axhline(hline, color="grey", linestyle="--", linewidth=0.8)
    ax.margins(y=0.15)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    return Path(path).name
