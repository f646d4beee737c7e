"""The server the serve suite measures: a `graphexec-serve` it starts itself, or a given URL.

Boundary: process management and readiness only.  `launched_server` starts
`python -m graphexec.entrypoints.serve` with the run's engine overrides on a free loopback port,
its output going to a log file in the run directory, waits until /health answers 200, and on the
way out (normally or on any error) stops it with SIGINT, then SIGTERM, then SIGKILL.  With
bench.url set nothing is started and that server is used as it is, so other OpenAI-compatible
servers (llama.cpp's, vLLM's) are measured unmodified.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import httpx

from graphexec.parallel.ports import free_port

LOG_FILE = "server.log"
_STOP_GRACE_S = (30.0, 10.0)  # after SIGINT, then after SIGTERM, before SIGKILL


@dataclass(frozen=True)
class Target:
    """Where requests go: the base URL, and what the suite knows of the server."""

    url: str
    launched: bool
    command: tuple[str, ...] = ()
    pid: int | None = None
    start_seconds: float | None = None
    log_path: str | None = None


def serve_command(overrides: Sequence[str], port: int) -> list[str]:
    """graphexec-serve as a module of this interpreter (so it is this checkout's graphexec)."""
    return [sys.executable, "-m", "graphexec.entrypoints.serve", *overrides, "server.host=127.0.0.1",
            f"server.port={port}", "server.log_level=warning"]


@contextlib.contextmanager
def launched_server(overrides: Sequence[str], log_dir: Path, start_timeout_s: float) -> Iterator[Target]:
    """graphexec-serve on a free port for the duration of the block; stopped however it ends."""
    port = free_port()
    command = serve_command(overrides, port)
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / LOG_FILE
    started = time.perf_counter()
    with open(log_path, "wb") as log:
        # No preexec_fn (unsafe once torch's threads exist): a benchmark killed by SIGKILL leaves
        # the server running; every other way out stops it below.
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, process, log_path, start_timeout_s)
        yield Target(url, True, tuple(command), process.pid, time.perf_counter() - started, str(log_path))
    finally:
        stop(process)


def wait_healthy(url: str, process: subprocess.Popen, log_path: Path, timeout_s: float) -> None:
    """Until GET /health answers 200; the server's exit or the deadline raise with its log's tail."""
    deadline = time.monotonic() + timeout_s
    with httpx.Client(trust_env=False, timeout=5) as http:
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"graphexec-serve exited with code {process.returncode} before it was ready: "
                                   f"{log_tail(log_path)}")
            with contextlib.suppress(httpx.TransportError):
                if http.get(f"{url}/health").status_code == 200:
                    return
            if time.monotonic() > deadline:
                raise RuntimeError(f"graphexec-serve did not answer /health within bench.server_start_timeout_s="
                                   f"{timeout_s:g}: {log_tail(log_path)}")
            time.sleep(0.25)


def stop(process: subprocess.Popen) -> int | None:
    """SIGINT (graphexec-serve's clean shutdown), then SIGTERM, then SIGKILL; the exit code."""
    for sig, grace in ((signal.SIGINT, _STOP_GRACE_S[0]), (signal.SIGTERM, _STOP_GRACE_S[1]), (signal.SIGKILL, None)):
        if process.poll() is not None:
            break
        process.send_signal(sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(grace)
    return process.returncode


def log_tail(path: Path, chars: int = 2000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:].strip() or "(empty log)"
    except OSError as error:
        return f"(no log: {error})"


@contextlib.contextmanager
def given_server(url: str) -> Iterator[Target]:
    """A server someone else runs: nothing to start or stop."""
    yield Target(url.rstrip("/"), False)
