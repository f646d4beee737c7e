"""Markdown tables from rows, and the cell formats the reports share.

Boundary: strings only.  The numbers come from the suites and bench/stats.py; a script's tables
start with `machine_line()`, so every table names the CPU it was measured on.
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

MISSING = "—"


def table(columns: Sequence[Any], rows: Iterable[Sequence[Any]]) -> str:
    """A Markdown table; a "|" inside a cell is escaped so it cannot split the cell."""
    return "\n".join([header(columns), *map(row, rows)])


def header(columns: Sequence[Any]) -> str:
    """A table's first two lines, for a script that prints each row as it is measured."""
    return row(columns) + "\n|" + "---|" * len(columns)


def row(cells: Sequence[Any]) -> str:
    return "| " + " | ".join(cell(c).replace("|", "\\|") for c in cells) + " |"


def cell(value: Any) -> str:
    """A raw value as the reports show it: None "—", a float to three significant digits, a
    bench/stats.py spread or a paired timing as its median and range; anything else as str()."""
    if value is None:
        return MISSING
    if isinstance(value, float):
        return sig3(value)
    if isinstance(value, dict) and "rounds" in value:
        return spread_cell(value)
    if isinstance(value, dict) and "median_ms" in value:
        return ms_range(value)
    return str(value)


def times(value: float | None) -> str:
    """A ratio: 1.23×."""
    return MISSING if value is None else f"{value:.2f}×"


def sig3(value: float | None) -> str:
    """Three significant digits, whole numbers from 100 up."""
    if value is None:
        return MISSING
    return f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"


def spread_cell(s: dict[str, Any] | None) -> str:
    """A bench/stats.py spread: the median, then (min–max) when there was more than one round."""
    if s is None:
        return MISSING
    return sig3(s["median"]) if s["rounds"] == 1 else f"{sig3(s['median'])} ({sig3(s['min'])}–{sig3(s['max'])})"


def ms_range(t: dict[str, float], fmt: str = ".1f") -> str:
    """A paired timing (bench/timing.py): median (min–max) ms."""
    return f"{t['median_ms']:{fmt}} ({t['min_ms']:{fmt}}–{t['max_ms']:{fmt}})"


def machine_line(torch_facts: bool = True) -> str:
    """The CPU (and GPU) a script's numbers come from, for the line above its tables; without
    `torch_facts`, the CPU alone (for a client that does not import torch)."""
    import os

    from bench.report import cpu_model, machine

    if not torch_facts:
        return f"CPU: {cpu_model()} ({os.cpu_count()} cores)"
    m = machine()
    gpu = f", {m['cuda']}" if m["cuda"] else ""
    return (f"CPU: {m['cpu']} ({m['cpu_capability']}, {m['cpu_count']} cores{gpu}), torch {m['torch']} "
            f"({m['torch_threads']} threads), python {m['python']}")
