"""The engine's capture process (graphexec/engine/background_capture.py, capture_worker.py): stopped
with its whole process group while the engine serves, continued while idle, gone with the engine
even when stopped; its reports decide which buckets the loop thread captures itself.  A stand-in
child here (a few lines speaking the worker's stdin/stdout protocol); the real worker compiles in
tests/test_capture_artifacts.py, under a serving engine."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time

import pytest

from graphexec.engine.background_capture import POLL_S, BackgroundCapture, CaptureChild

# Reads the job, starts a grandchild (what inductor's compile workers and compilers are), then
# reports each bucket as its config's `outcomes` say: done (default), failed, or exit mid-bucket.
FAKE_WORKER = r"""
import json, subprocess, sys, time
job = json.load(sys.stdin)
sleeper = subprocess.Popen(["sleep", "60"])
if job["config"]["pidfile"]:
    open(job["config"]["pidfile"], "w").write(str(sleeper.pid))
for path, bucket, stage in job["work"]:
    print(json.dumps({"event": "start", "config_path": path, "bucket": bucket, "stage": stage}), flush=True)
    outcome = job["config"]["outcomes"].get(f"{bucket}" if stage == "graph" else f"{bucket} {stage}", "done")
    if outcome == "exit":
        sys.exit(7)
    print(json.dumps({"event": outcome, "config_path": path, "bucket": bucket, "error": "boom", "stage": stage}), flush=True)
time.sleep(job["config"]["linger_s"])
"""
COMMAND = [sys.executable, "-c", FAKE_WORKER]


class Config:
    """What the stand-in reads of the engine's config."""

    def __init__(self, outcomes=None, linger_s=0.0, pidfile=None):
        self.plain = {"outcomes": outcomes or {}, "linger_s": linger_s, "pidfile": pidfile and str(pidfile)}

    def to_plain(self):
        return self.plain


class FakeRunner:
    """The runner's side of background capture: pending buckets, the ones a child could build."""

    def __init__(self, buckets, apart, outcomes=None, pidfile=None, shared=(), interims=()):
        self.config = Config(outcomes, pidfile=pidfile)
        self.artifact_key = "k"
        self.pending = list(buckets)
        self.apart = set(apart)
        self.shared = set(shared)  # these share one compile (one group)
        self.interims = list(interims)  # buckets built apart with a stand-in, each its own group
        self.captured, self.compiling, self.interims_built = [], [], []

    def interims_to_build_apart(self):
        return [[("capture.decode", b)] for b in self.interims]

    def interim_built_apart(self, config_path, bucket):
        # What the loop learns while the graph is still owed: the stand-in is there to load.
        assert bucket in self.pending
        self.interims_built.append(bucket)

    def buckets_to_build_apart(self):
        groups = {}
        for b in self.pending:
            if b in self.apart:
                groups.setdefault("shared" if b in self.shared else b, []).append(("capture.decode", b))
        return list(groups.values())

    def capture_next(self, skip=()):
        for bucket in self.pending:
            if ("capture.decode", bucket) not in skip:
                self.pending.remove(bucket)
                self.captured.append(bucket)
                return True
        return False

    def capture_pending(self, skip=()):
        return any(("capture.decode", b) not in skip for b in self.pending)

    def loads_need_compiler(self, buckets):
        return True  # as compile.aot's artifacts (AOTInductor packages need none: test_aoti_forward.py)

    def compiling_apart(self, config_path, bucket):
        self.compiling.append(bucket)


def _drive(work: BackgroundCapture, timeout_s: float = 60.0) -> None:
    """Call `run` as an idle loop would, until it says there is no more."""
    deadline = time.monotonic() + timeout_s
    while (delay := work.run()) is not None:
        assert time.monotonic() < deadline
        time.sleep(delay)


@pytest.mark.parametrize("outcomes, warned", [({}, 0), ({"4": "failed"}, 1), ({"2": "exit"}, 1)])
def test_the_loop_captures_what_the_child_built_and_what_it_could_not(tmp_path, caplog, outcomes, warned):
    runner = FakeRunner([1, 2, 4], apart=[2, 4], outcomes=outcomes, pidfile=tmp_path / "sleeper")
    work = BackgroundCapture([runner], in_child=True, child_command=COMMAND)
    with caplog.at_level(logging.WARNING, logger="graphexec.engine.background_capture"):
        _drive(work)
    # What the child left in its group (stopped with it at every pause) went with it.
    assert _wait(lambda: _state(int((tmp_path / "sleeper").read_text())) in (None, "Z"))
    # Bucket 1 cannot be built apart: captured at once; the others once the child is done with them.
    assert runner.captured[0] == 1 and sorted(runner.captured) == [1, 2, 4] and runner.pending == []
    assert runner.compiling == ([2] if "2" in outcomes else [2, 4])
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == warned
    if outcomes.get("4") == "failed":
        assert "bucket 4 (boom)" in messages[0]
    if outcomes.get("2") == "exit":
        assert "exited with code 7" in messages[0] and "('capture.decode', 2)" in messages[0]


def test_groups_of_buckets_go_to_as_many_children_as_allowed(tmp_path, caplog):
    """Buckets that share one compile stay in one child; with two processes allowed, B=1's group
    and the shared group build side by side, and the loop captures each once its child is done."""
    runner = FakeRunner([1, 2, 4, 8], apart=[1, 2, 4, 8], shared=[2, 4, 8], outcomes={"8": "failed"})
    work = BackgroundCapture([runner], in_child=True, child_command=COMMAND, processes=2)
    with caplog.at_level(logging.INFO, logger="graphexec.engine.background_capture"):
        assert work.run() == POLL_S  # both started; nothing built yet, so nothing for the loop
        assert len(work._children) == 2
        # Where they contend for the cores, the first (B=1's) goes ahead.
        base = os.getpriority(os.PRIO_PROCESS, 0)
        assert [os.getpriority(os.PRIO_PROCESS, c.pid) for c in work._children] == [base, base + 10]
        _drive(work)
    builds = sorted(r.getMessage() for r in caplog.records if r.getMessage().startswith("capture process") and "builds" in r.getMessage())
    assert [m.split(" builds ")[1] for m in builds] == ["capture.decode bucket 1", "capture.decode bucket 2, capture.decode bucket 4, capture.decode bucket 8"]
    assert sorted(runner.captured) == [1, 2, 4, 8] and sorted(runner.compiling) == [1, 2, 4, 8] and not work._children
    assert len([r for r in caplog.records if "could not build capture.decode bucket 8" in r.getMessage()]) == 1


def test_stand_ins_are_built_before_any_graph_and_the_loop_learns_of_each(caplog):
    """Stand-ins (compile.interim_buckets) go first, all to the first child (the one the others yield the
    cores to), the graphs' groups after them in turn; a built stand-in is reported to the runner
    while its graph is still owed; a failed one only warns (the bucket runs eager until its graph
    is built), and its graph is still built."""
    runner = FakeRunner([1, 2, 4, 8], apart=[1, 2, 4, 8], shared=[2, 4, 8], interims=[1, 2, 4],
                        outcomes={"2 interim": "failed"})
    work = BackgroundCapture([runner], in_child=True, child_command=COMMAND, processes=2)
    with caplog.at_level(logging.INFO, logger="graphexec.engine.background_capture"):
        _drive(work)
    builds = [r.getMessage().split(" builds ")[1] for r in caplog.records if " builds " in r.getMessage()]
    assert builds == ["capture.decode bucket 1 (stand-in), capture.decode bucket 2 (stand-in), capture.decode bucket 4 (stand-in), "
                      "capture.decode bucket 2, capture.decode bucket 4, capture.decode bucket 8",
                      "capture.decode bucket 1"]
    assert runner.interims_built == [1, 4] and sorted(runner.captured) == [1, 2, 4, 8]
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == [
        "capture process could not build the stand-in of capture.decode bucket 2 (boom)"]


def test_nothing_to_build_apart_starts_no_child(tmp_path):
    runner = FakeRunner([1, 2], apart=[])
    started = tmp_path / "started"
    work = BackgroundCapture([runner], in_child=True, child_command=[sys.executable, "-c", f"open({str(started)!r}, 'w')"])
    _drive(work)
    assert runner.captured == [1, 2] and not started.exists()


def test_pause_stops_the_child_and_its_children_resume_continues_them_kill_ends_them():
    child = CaptureChild.start(Config(linger_s=60), [("capture.decode", 1, "graph")], "k", command=COMMAND)
    try:
        reports = _reports(child, 2)
        assert [(r.event, r.bucket) for r in reports] == [("start", 1), ("done", 1)]
        group = _group(child.pid)
        assert len(group) == 2  # the child and its sleeping grandchild
        child.pause()
        assert _wait(lambda: {_state(pid) for pid in group} == {"T"})
        child.resume()
        assert _wait(lambda: "T" not in {_state(pid) for pid in group})
    finally:
        child.kill()
    assert _wait(lambda: all(_state(pid) in (None, "Z") for pid in group))


_ENGINE = r"""
import subprocess, sys, time
from graphexec.engine.background_capture import CaptureChild
child = CaptureChild.start(type("C", (), {"to_plain": lambda self: {}})(), [], "k", command=[sys.executable, "-c", sys.argv[1]])
while not child.reports():
    time.sleep(0.05)
child.pause()
print(child.pid, flush=True)
"""
# What the worker does first, then waits to be stopped.  Deaf to SIGHUP, so that only the worker's
# own measure can end it: the kernel hangs up an orphaned stopped group, which would pass this test
# on a machine whose init runs in another session, and not elsewhere.
_DIES_WITH_ENGINE = r"""
import os, signal, sys, time
signal.signal(signal.SIGHUP, signal.SIG_IGN)
from graphexec.engine.capture_worker import _die_with
_die_with(os.getppid())
print('{"event": "start", "config_path": "x", "bucket": 1}', flush=True)
time.sleep(60)
"""


def test_a_stopped_capture_process_dies_with_its_engine():
    engine = subprocess.run([sys.executable, "-c", _ENGINE, _DIES_WITH_ENGINE], capture_output=True, text=True, timeout=60)
    assert engine.returncode == 0, engine.stderr[-2000:]
    pid = int(engine.stdout.split()[-1])
    try:
        assert _wait(lambda: _state(pid) in (None, "Z"))
    finally:
        if _state(pid) not in (None, "Z"):
            os.kill(pid, signal.SIGKILL)


def _reports(child: CaptureChild, count: int) -> list:
    got = []
    assert _wait(lambda: got.extend(child.reports()) or len(got) >= count)
    return got


def _group(pgid: int) -> list[int]:
    pids = []
    for stat in os.listdir("/proc"):
        if stat.isdigit():
            fields = _stat(int(stat))
            if fields is not None and int(fields[2]) == pgid:
                pids.append(int(stat))
    return pids


def _state(pid: int) -> str | None:
    fields = _stat(pid)
    return None if fields is None else fields[0]


def _stat(pid: int) -> list[str] | None:
    """/proc/PID/stat after the command name: state, ppid, pgrp, ..."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None


def _wait(condition, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(POLL_S / 4)
    return True
