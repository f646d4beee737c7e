"""Background capture: what the engine loop does while no request waits (`capture.background`).

The loop calls `run` once it has been idle `capture.idle_delay_s`, and again after the delay each
call returns; it calls `pause` before serving anything, and `close` when it stops.  Each `run`
captures at most one bucket on the loop thread: the target model's buckets first (decode's B=1
first), then a draft model's.

A compile on the loop thread makes a request that arrives meanwhile wait for it (a whole
forward: tens of seconds on 2 cores), and a compile beside a serving engine slows every step it
shares the cores with (docs/STATUS.md, issue 22: eager 29 ms/token became 43-305 ms).  So with
`capture.compile_in_child` the buckets whose compiled code persists (full_graph `compile.aot`,
with `capture.cache_dir`) are compiled by a child process with the engine's config
(graphexec/engine/capture_worker.py), or by up to `capture.compile_processes` of them side by
side, each given whole groups of buckets that share one compile; the loop stops each with
SIGSTOP, its whole process group (inductor's compile workers and the C++ compiler too), while
any request is served, and continues them while idle.  The loop then only loads what a child
saved: the artifact, the bucket's capture forward and its timing against eager
(capture/measure.py), a fraction of a second to ~2 s (a whole forward); Dynamo and inductor are
imported while the children compile.  Where a bucket has a stand-in (full_graph
`compile.interim_buckets`: the regional layer for a whole forward's package), the first child
builds every stand-in before any graph, and the loop serves each as soon as it is reported, until
the graph that replaces it is (capture/bucketed.py).
Buckets that cannot be built apart (no artifacts: a CUDA graph, the op tape, `compile.aot` off)
are captured on the loop thread as before, and so are a draft model's and any the child failed
to build.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from graphexec.runner.model_runner import ModelRunner

_log = logging.getLogger(__name__)

# How often an idle loop looks at a running child's reports: what a built bucket may wait before
# the loop loads it.
POLL_S = 0.2
# How much lower the CPU priority of every capture process but the first is: where they contend
# for the cores, the first (B=1's compile) goes ahead.
_LATER_CHILD_NICENESS = 10
# Bytes of a failed child's stderr quoted in the warning.
_LOG_TAIL = 2000


class BackgroundCapture:
    """EngineLoop's idle work: capture every pending bucket of `runners`, the first runner's
    buildable ones in child processes when `in_child` (at most `processes` of them, each building
    whole groups of buckets that share one compile)."""

    def __init__(self, runners: Sequence[ModelRunner], in_child: bool, child_command: Sequence[str] | None = None,
                 processes: int = 1):
        self.runners = list(runners)
        self._in_child = in_child
        self._processes = processes
        self._child_command = child_command  # CaptureChild.start's `command` (tests)
        self._children: list[CaptureChild] = []
        # (config path, bucket) a child has yet to build: the loop thread leaves them alone.
        self._owed: set[tuple[str, int]] = set()

    def run(self) -> float | None:
        """One unit of work: seconds until the next call may come (0: at once), None when done."""
        target = self.runners[0]
        if self._children:
            self._follow_children(target)
        elif self._in_child:
            self._in_child = False  # children once per engine: what they fail is captured here
            self._start_children(target)
        for runner in self.runners:
            skip = self._owed if runner is target else ()
            if runner.capture_pending(skip):
                # Stopped while this process captures too: a bucket is timed against eager here,
                # and a compile beside it would decide that timing.
                self.pause()
                runner.capture_next(skip)
                return 0.0
        if self._children:
            for child in self._children:
                child.resume()
            return POLL_S
        return None

    def waits(self) -> bool:
        # Loading stored packages takes milliseconds; anything else may compile on this thread.
        return not all(runner.capture_only_loads() for runner in self.runners)

    def pause(self) -> None:
        """The loop is about to serve: stop the children until the next `run`."""
        for child in self._children:
            child.pause()

    def close(self) -> None:
        """The loop stops: end the children, whatever they were doing."""
        for child in self._children:
            child.kill()
        self._children = []

    def _start_children(self, target: ModelRunner) -> None:
        # Whole groups to each child in turn: the first group starts at once in the first child,
        # which the others yield the cores to.  Every stand-in goes first, to the first child, as
        # one group: seconds each where a graph takes a minute or more, they are what serves soonest.
        groups = [[(*b, GRAPH) for b in group] for group in target.buckets_to_build_apart()]
        interims = [(*b, INTERIM) for group in target.interims_to_build_apart() for b in group]
        groups = ([interims] if interims else []) + groups
        jobs = [[b for group in groups[i :: self._processes] for b in group] for i in range(min(self._processes, len(groups)))]
        for index, work in enumerate(jobs):
            try:
                # The first child builds the most used buckets (B=1): the others yield the cores to it.
                child = CaptureChild.start(target.config, work, target.artifact_key, self._child_command,
                                           niceness=_LATER_CHILD_NICENESS if index else 0)
            except Exception as error:  # noqa: BLE001 - no process (OSError), a config that cannot travel: the loop captures
                _log.warning("could not start a capture process (%r); capturing on the engine loop instead", error)
                continue
            self._children.append(child)
            self._owed.update((path, bucket) for path, bucket, stage in work if stage == GRAPH)
            _log.info("capture process %d builds %s", child.pid,
                      ", ".join(f"{p} bucket {b}{' (stand-in)' if s == INTERIM else ''}" for p, b, s in work))
        if self._children and (interims or target.loads_need_compiler(sorted(self._owed))):
            # The first artifact loaded here would import Dynamo and inductor on the loop thread
            # (2.3-3.4 s on 2 cores): import them now, on a thread that ends, while the children
            # compile for longer than that.  A request that comes during the import still waits
            # about as long as it would behind the loop's: the importing thread holds the GIL, and
            # an eager forward takes it back after every op (a 16-token request: 4.1 s during a
            # 3.8 s import, 0.4 s alone; docs/STATUS.md, issue 22).
            threading.Thread(target=_import_compiler, name="graphexec-import-compiler", daemon=True).start()

    def _follow_children(self, target: ModelRunner) -> None:
        self._children = [child for child in self._children if not self._follow(child, target)]

    def _follow(self, child: CaptureChild, target: ModelRunner) -> bool:
        """Take the child's reports; True once it has exited (and is reaped)."""
        exit_code = child.exit_code()  # before reading: every report of an exited child is in the pipe
        for report in child.reports():
            bucket = (report.config_path, report.bucket)
            if report.event == "start":
                target.compiling_apart(*bucket)
            elif report.stage == INTERIM:
                if report.event == "done":
                    target.interim_built_apart(*bucket)
                else:  # the bucket runs eager until its graph is built
                    _log.warning("capture process could not build the stand-in of %s bucket %d (%s)", *bucket, report.error)
            elif report.event == "done":
                self._owed.discard(bucket)
            else:
                _log.warning("capture process could not build %s bucket %d (%s); capturing it on the engine loop",
                             *bucket, report.error)
                self._owed.discard(bucket)
        if exit_code is None:
            return False
        left = [(path, bucket) for path, bucket, stage in child.unreported() if stage == GRAPH]
        if left:
            _log.warning("capture process exited with code %d before building %s; capturing them on the engine "
                         "loop.  Its log ends:\n%s", exit_code, left, child.log_tail())
            self._owed.difference_update(left)
        elif exit_code != 0:
            _log.info("capture process exited with code %d after building everything", exit_code)
        child.kill()
        return True


def _import_compiler() -> None:
    try:
        for module in ("torch._dynamo", "torch._inductor.compile_fx"):
            importlib.import_module(module)
    except Exception:  # noqa: BLE001 - the load imports them itself, and reports what fails
        _log.debug("importing the compiler ahead of the first artifact failed", exc_info=True)


# What a child builds of a bucket: its graph, or the stand-in that serves until the graph is built.
GRAPH = "graph"
INTERIM = "interim"


@dataclass(frozen=True)
class Report:
    """One line of the child's stdout: it started, built or failed a bucket's graph or stand-in."""

    event: str  # start | done | failed
    config_path: str
    bucket: int
    error: str = ""
    stage: str = GRAPH

    def line(self) -> bytes:
        return json.dumps({"event": self.event, "config_path": self.config_path, "bucket": self.bucket,
                           "error": self.error, "stage": self.stage}).encode() + b"\n"

    @classmethod
    def parse(cls, line: bytes) -> Report:
        raw = json.loads(line)
        return cls(str(raw["event"]), str(raw["config_path"]), int(raw["bucket"]), str(raw.get("error", "")),
                   str(raw.get("stage", GRAPH)))


class CaptureChild:
    """The process building buckets for this engine: started, stopped and continued as a process
    group, its reports read without blocking, its stderr kept in a file for a failure's warning."""

    def __init__(self, proc: subprocess.Popen, log, work: list[tuple[str, int, str]]):
        self._proc = proc
        self._log = log
        self._unreported = {tuple(w) for w in work}  # given, neither reported done nor failed yet
        self._partial = b""
        self._running = True
        self.pid = proc.pid

    @classmethod
    def start(cls, config, work: list[tuple[str, int, str]], key: str | None,
              command: Sequence[str] | None = None, niceness: int = 0) -> CaptureChild:
        """`work`: (config path, bucket, GRAPH or INTERIM), built in this order.  `command`
        replaces the worker module (tests); it reads the same JSON from stdin.  `niceness`: how
        much lower than this process's its CPU priority is (and its compilers')."""
        threads = torch.get_num_threads()  # part of the plan's key: the child must compile under the same
        payload = json.dumps({"config": config.to_plain(), "work": work, "key": key, "threads": threads}).encode()
        log = tempfile.TemporaryFile()
        # Its own process group, in this session: SIGSTOP reaches its compilers too.  The worker
        # dies with the thread that started it, stopped or not (capture_worker.py); compilers it
        # leaves stopped are an orphaned stopped group, which the kernel hangs up.
        proc = subprocess.Popen(
            list(command) if command else [sys.executable, "-m", "graphexec.engine.capture_worker", str(os.getpid())],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, process_group=0,
            env=dict(os.environ, OMP_NUM_THREADS=str(threads)),
        )
        if niceness:
            # Before it imports torch (seconds), so the compilers it starts inherit it.
            os.setpriority(os.PRIO_PROCESS, proc.pid, os.getpriority(os.PRIO_PROCESS, 0) + niceness)
        try:
            proc.stdin.write(payload)
            proc.stdin.close()
        except OSError:
            pass  # it exited at once: its exit code and log say why
        os.set_blocking(proc.stdout.fileno(), False)
        return cls(proc, log, work)

    def reports(self) -> list[Report]:
        """What the child reported since the last call."""
        chunks = []
        while True:
            try:
                chunk = os.read(self._proc.stdout.fileno(), 1 << 16)
            except BlockingIOError:
                break
            if not chunk:
                break
            chunks.append(chunk)
        *lines, self._partial = (self._partial + b"".join(chunks)).split(b"\n")
        reports = []
        for line in lines:
            try:
                report = Report.parse(line)
            except (ValueError, KeyError, TypeError):
                _log.debug("capture process said %r", line)  # not a report (a library printing)
                continue
            if report.event != "start":
                self._unreported.discard((report.config_path, report.bucket, report.stage))
            reports.append(report)
        return reports

    def unreported(self) -> list[tuple[str, int, str]]:
        """The work it was given and has reported neither built nor failed."""
        return sorted(self._unreported)

    def exit_code(self) -> int | None:
        """Its exit code once it has exited.  Not reaped here: until `kill` reaps it, its process
        group id stays its own, so `kill` can still end whatever it left running in the group."""
        if self._proc.returncode is not None:
            return self._proc.returncode
        info = os.waitid(os.P_PID, self._proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        if info is None:
            return None
        return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status

    def pause(self) -> None:
        if self._running:
            self._signal(signal.SIGSTOP)
            self._running = False

    def resume(self) -> None:
        if not self._running:
            self._signal(signal.SIGCONT)
            self._running = True

    def kill(self) -> None:
        """End it and everything in its group (compilers, workers: stopped or not), then reap it."""
        if self._proc.returncode is None:  # not reaped yet: the group id is still its own
            self._signal(signal.SIGKILL)
            self._proc.wait()
        self._proc.stdout.close()
        self._log.close()

    def log_tail(self) -> str:
        self._log.seek(0, os.SEEK_END)
        size = self._log.tell()
        self._log.seek(max(0, size - _LOG_TAIL))
        return self._log.read().decode(errors="replace")

    def _signal(self, sig: int) -> None:
        try:
            os.killpg(self._proc.pid, sig)
        except ProcessLookupError:
            pass  # the group is gone: the child and everything it started have exited
