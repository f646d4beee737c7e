"""One suite run on disk: results.json (machine-readable), report.md (tables) and PNG plots.

A suite that fails still gets all three files: results.json with `status: failed` and the error,
and a report that says so, so a `--multirun` sweep goes on and its comparison shows the failure.
"""

from __future__ import annotations

import json
import os
import platform
import time
import traceback
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

RESULTS = "results.json"
REPORT = "report.md"


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
        payload |= {"status": "failed", "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    payload["seconds"] = time.time() - started
    write(out_dir, payload, suite)
    return payload


def write(out_dir: Path, payload: dict[str, Any], suite: ModuleType) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    body, plot_files = "", []
    if payload["status"] == "ok":
        try:
            body = suite.markdown(payload["result"])
            plot_files = suite.plots(payload["result"], out_dir)
            payload["summary"] = suite.summary(payload["result"])
        except Exception as exc:  # a report bug must not lose the measurements
            payload |= {"status": "failed", "error": f"report: {type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    payload["plots"] = plot_files
    (out_dir / RESULTS).write_text(json.dumps(payload, indent=2, default=str))
    (out_dir / REPORT).write_text(render(payload, body))


def render(payload: dict[str, Any], body: str) -> str:
    m = payload["machine"]
    head = [
        f"# graphexec-bench · {payload['suite']} · {payload['label']}",
        "",
        f"{m['cpu']} ({m['cpu_count']} CPUs, {m['torch_threads']} torch threads"
        + (f", {m['cuda']}" if m["cuda"] else "")
        + f") · torch {m['torch']} · {time.strftime('%Y-%m-%d %H:%M', time.localtime(payload['started']))}"
        + f" · {payload['seconds']:.0f} s",
        "",
    ]
    if payload["status"] != "ok":
        head += [f"**FAILED**: {payload['error']}", "", "```", payload.get("traceback", "").strip(), "```", ""]
    plots = [f"![{p}]({p})" for p in payload.get("plots", [])]
    return "\n".join(head) + "\n" + body + ("\n" + "\n".join(plots) + "\n" if plots else "")
