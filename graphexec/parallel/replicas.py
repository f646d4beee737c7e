"""Data-parallel replicas: `parallel.dp_size` graphexec-serve processes on this machine.

Each replica is a plain `python -m graphexec.entrypoints.serve` with the front's own overrides
plus its own: a free loopback port, `parallel.dp_size=1`, and its share of the CPU threads
(`parallel.threads_per_rank`, and OMP_NUM_THREADS for a replica of one rank).  A replica with
`parallel.tp_size > 1` starts its own tensor-parallel ranks, as any graphexec-serve does.

A replica answers the front only: plain HTTP on loopback, none of the front's keys, TLS or
public routes.  What makes it take the front's per-run token as its key is the caller's `env`
(graphexec-serve's, from server/api_keys.py): it goes in the replica's environment, not on its
command line, which any local user can list.

Replicas never outlive the front: each asks Linux for SIGTERM when the front dies
(PR_SET_PDEATHSIG, in `die_with_front`, which graphexec-serve calls first thing), and `stop`
terminates them, then kills what has not exited after a grace period.  They run in sessions of
their own, so a Ctrl-C at the terminal reaches the front only, which stops them in order.  Their
stderr is echoed with a `[replica i]` prefix; its tail goes
into the error when a replica exits during start-up.
"""

from __future__ import annotations

import collections
import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

from graphexec.errors import WorkerFailedError
from graphexec.parallel.ports import free_port

# Loading a model (and capturing, unless capture=eager) on a loaded machine.
STARTUP_TIMEOUT_S = 900.0
STOP_GRACE_S = 10.0
_STDERR_TAIL_LINES = 40
_PR_SET_PDEATHSIG = 1
_FRONT_PID_ENV = "GRAPHEXEC_REPLICA_OF"  # the front's pid, in a replica's environment
# The server options a replica's command line sets itself, whatever the front's config says: the
# front alone faces clients (keys, TLS, public routes); a replica faces the front on loopback.
_REPLICA_SERVER = MappingProxyType({
    "server.host": "127.0.0.1",
    "server.api_key": "null",
    "server.api_key_file": "null",
    "server.admin_api_key": "null",
    "server.admin_api_key_file": "null",
    "server.public_routes": "[/health]",
    "server.public_metrics": "false",
    "server.allow_unauthenticated": "false",
    "server.ssl_certfile": "null",
    "server.ssl_keyfile": "null",
    "server.ssl_ca_certs": "null",
    "server.ssl_cert_reqs": "none",
})
# The options a replica's command line sets itself, dropped from the front's overrides.
_OWN_OPTIONS = ("server.port", "parallel.dp_size", "parallel.threads_per_rank", *_REPLICA_SERVER)


class ReplicaStartError(WorkerFailedError):
    """A replica exited, or did not answer /health, during start-up."""


@dataclass
class Replica:
    index: int
    port: int
    proc: subprocess.Popen
    stderr_tail: collections.deque = field(default_factory=lambda: collections.deque(maxlen=_STDERR_TAIL_LINES))

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def tail(self) -> str:
        return "\n".join(self.stderr_tail)


def replica_overrides(overrides: Sequence[str], port: int, threads: int) -> list[str]:
    """A replica's Hydra overrides: the front's, less those the replica sets, plus its own."""
    kept = [o for o in overrides if o.lstrip("+~").partition("=")[0] not in _OWN_OPTIONS]
    own = [f"server.port={port}", "parallel.dp_size=1", f"parallel.threads_per_rank={threads}"]
    return kept + own + [f"{name}={value}" for name, value in _REPLICA_SERVER.items()]


def replica_env(environ: Mapping[str, str], threads: int, env: Mapping[str, str | None]) -> dict[str, str]:
    """A replica's environment: the front's `environ`, its thread counts, the front's pid, and
    the caller's `env` (a None value unsets that variable)."""
    own = {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), _FRONT_PID_ENV: str(os.getpid())}
    merged = {**environ, **own, **env}
    return {name: value for name, value in merged.items() if value is not None}


def threads_per_replica_rank(dp_size: int, tp_size: int, threads_per_rank: int | None) -> int:
    """`parallel.threads_per_rank` when set, else the machine's cores over every rank of every replica."""
    if threads_per_rank is not None:
        return threads_per_rank
    return max(1, (os.cpu_count() or 1) // (dp_size * tp_size))


class ReplicaSet:
    """The running replicas, replica i at `replicas[i]`."""

    def __init__(self, replicas: list[Replica]):
        self.replicas = replicas

    @property
    def urls(self) -> list[str]:
        return [r.url for r in self.replicas]

    @classmethod
    def start(
        cls,
        overrides: Sequence[str],
        dp_size: int,
        threads: int,
        startup_timeout_s: float = STARTUP_TIMEOUT_S,
        env: Mapping[str, str | None] | None = None,
    ) -> ReplicaSet:
        """Start `dp_size` replicas, `env` added to (None: removed from) each one's environment, and
        wait until each answers /health (or raise, none left running)."""
        replicas: list[Replica] = []
        try:
            for index in range(dp_size):
                replicas.append(_spawn(index, overrides, threads, env or {}))
            started = cls(replicas)
            started.wait_healthy(startup_timeout_s)
        except BaseException:
            cls(replicas).stop()
            raise
        return started

    def wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        pending = list(self.replicas)
        while pending:
            for replica in list(pending):
                if replica.proc.poll() is not None:
                    time.sleep(0.2)  # let the echo thread take the last lines
                    raise ReplicaStartError(
                        f"data-parallel replica {replica.index} exited with code {replica.proc.returncode} "
                        f"during start-up; its last stderr lines:\n{replica.tail()}"
                    )
                if _healthy(replica.url):
                    pending.remove(replica)
            if pending and time.monotonic() > deadline:
                raise ReplicaStartError(
                    f"data-parallel replica {pending[0].index} did not answer {pending[0].url}/health within "
                    f"{timeout_s:g} s; its last stderr lines:\n{pending[0].tail()}"
                )
            if pending:
                time.sleep(0.25)

    def exited(self) -> list[tuple[int, int]]:
        """(replica, exit code) of every replica that has exited."""
        return [(r.index, r.proc.returncode) for r in self.replicas if r.proc.poll() is not None]

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """SIGTERM every replica (each shuts its engine and ranks down), SIGKILL after `grace_s`."""
        for replica in self.replicas:
            if replica.proc.poll() is None:
                replica.proc.terminate()
        deadline = time.monotonic() + grace_s
        for replica in self.replicas:
            try:
                replica.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                replica.proc.kill()
                replica.proc.wait()


def _spawn(index: int, overrides: Sequence[str], threads: int, env: Mapping[str, str | None]) -> Replica:
    port = free_port()
    command = [sys.executable, "-m", "graphexec.entrypoints.serve", *replica_overrides(overrides, port, threads)]
    proc = subprocess.Popen(
        command,
        stdin=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env=replica_env(os.environ, threads, env),
        start_new_session=True,
    )
    replica = Replica(index, port, proc)
    threading.Thread(target=_echo, args=(replica,), name=f"graphexec-replica-{index}-stderr", daemon=True).start()
    return replica


def die_with_front() -> None:
    """In a replica, first thing: SIGTERM when the front that started it dies (Linux
    PR_SET_PDEATHSIG; elsewhere the front's `stop` only).  Done here rather than in a Popen
    preexec_fn, which is unsafe in a front that already runs threads."""
    front = os.environ.pop(_FRONT_PID_ENV, None)
    if front is not None:
        die_with(int(front), signal.SIGTERM, "graphexec-serve replica")


def die_with(parent_pid: int, sig: int, who: str) -> bool:
    """This process gets `sig` when the thread of `parent_pid` that started it ends (Linux
    PR_SET_PDEATHSIG; stopped or not, for SIGKILL); exits at once if that parent is already gone.
    False where the platform has no such signal (the caller watches its parent another way)."""
    linux = sys.platform.startswith("linux")
    if linux:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, sig)
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        sys.exit(f"{who}: its parent (pid {parent_pid}) is gone")
    return linux


def _echo(replica: Replica) -> None:
    """The replica's stderr, line by line, to the front's, kept as a tail for start-up errors."""
    assert replica.proc.stderr is not None
    for raw in replica.proc.stderr:
        line = raw.decode("utf-8", "replace").rstrip("\n")
        replica.stderr_tail.append(line)
        print(f"[replica {replica.index}] {line}", file=sys.stderr, flush=True)


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2.0) as answer:
            return answer.status == 200
    except (urllib.error.URLError, OSError):
        return False


