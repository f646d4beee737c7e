"""Fresh-process workers: a bench side that must not share a process with another (two OpenMP
teams, an inductor cache, a CUDA context) runs through here.

Boundary: no measuring.  The parent half (`run_python`, `run_command`; `alternate` over sides
and rounds) starts a Python process with a timeout and takes the last line of its stdout as the
JSON result; a timeout, a non-zero exit without that line, or a line that is not JSON becomes
{"error": ...}, so a failed side is that side's record, never the caller's exception.  The child
half (`emit`) prints that line, or a one-line reason as the last line of stderr and exits 1.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import traceback
from typing import Any, Callable, Mapping, Sequence


def run_command(command: str, args: Sequence[str], timeout_s: float, **kwargs: Any) -> dict[str, Any]:
    """`graphexec-bench <command> <args>` in a fresh process (bench/cli.py's commands)."""
    return run_python(["-m", "bench.cli", command, *args], timeout_s, **kwargs)


def cache_env(cache_dir: str) -> dict[str, str]:
    """Inductor's and Triton's caches under `cache_dir`, for a worker that must start cold (or
    reuse exactly what an earlier worker left there); Triton's would otherwise stay wherever the
    caller's environment put it.  The temporary directory too: inductor keeps its precompiled
    C++ headers under it whatever TORCHINDUCTOR_CACHE_DIR says (torch 2.13, ~140 MB and ~6 s
    each to build), so a cold run that kept the caller's would find them built."""
    tmp = os.path.join(cache_dir, "tmp")
    os.makedirs(tmp, exist_ok=True)  # tempfile ignores a TMPDIR that does not exist
    return {"TORCHINDUCTOR_CACHE_DIR": os.path.join(cache_dir, "inductor"),
            "TRITON_CACHE_DIR": os.path.join(cache_dir, "triton"), "TMPDIR": tmp}


def run_python(args: Sequence[str], timeout_s: float, env: Mapping[str, str] | None = None, label: str = "worker",
               option: str | None = None, cwd: str | None = None) -> dict[str, Any]:
    """`python <args>` with `env` added to this environment.  The result is the worker's JSON plus
    process_seconds, exit_code and exit_error (a crash after the JSON line, in interpreter
    teardown, loses no measurement); or {"error": ...} with what is known.  `option` names the
    setting behind `timeout_s` in the timeout's message."""
    t0 = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, *args], env=os.environ | dict(env or {}), capture_output=True, text=True,
                              timeout=timeout_s, cwd=cwd)
    except subprocess.TimeoutExpired:
        why = f"{label} timed out after {timeout_s:.0f} s" + (f" ({option})" if option else "")
        return {"error": why, "process_seconds": time.perf_counter() - t0}
    facts = {"process_seconds": time.perf_counter() - t0, "exit_code": proc.returncode}
    lines = proc.stderr.strip().splitlines()
    last_line = lines[-1] if lines else f"{label} exited with code {proc.returncode}"
    try:
        result = json.loads(proc.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        error = last_line if proc.returncode != 0 else f"{label} printed no JSON line: {proc.stdout[-200:]!r}"
        return facts | {"error": error}
    return result | facts | {"exit_error": last_line if proc.returncode != 0 else None}


def alternate(sides: Sequence[Any], rounds: int, run_one: Callable[[Any, int], dict[str, Any]],
              say: Callable[[str], None] = lambda line: None, what: str = "bench"):
    """A B C A B C ...: every round runs each side once, in order, so machine noise lands on all of
    them alike.  Returns each side's rounds and the order things ran in; `say` gets a progress line
    before and after each run (a side's `error`, if any, in the second)."""
    raw: dict[Any, list[dict[str, Any]]] = {side: [] for side in sides}
    sequence = []
    for r in range(rounds):
        for side in sides:
            sequence.append({"round": r, "side": side})
            say(f"{what}: round {r + 1}/{rounds}, {side} (fresh process) ...")
            t0 = time.perf_counter()
            raw[side].append(run_one(side, r))
            say(f"{what}: {side}: {raw[side][-1].get('error') or 'ok'} ({time.perf_counter() - t0:.0f} s)")
    return raw, sequence


def emit(label: str, measure: Callable[[], dict[str, Any]]) -> None:
    """A worker's ending: its result as one JSON line on stdout, or a one-line reason as the last
    line of stderr (the parent records it as that run's error) and exit status 1."""
    try:
        result = measure()
    except Exception as exc:
        traceback.print_exc()
        reason = " ".join(f"{type(exc).__name__}: {exc}".split())
        print(f"{label} failed: {reason}", file=sys.stderr)
        raise SystemExit(1)
    print(json.dumps(result))
