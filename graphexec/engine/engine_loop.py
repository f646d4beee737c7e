"""The engine loop: one background thread that owns the scheduler (and so the model).

Callers on any thread submit requests and aborts through a locked inbox; the loop applies them
between steps, steps while any of its requests is unfinished, publishes each request's delta
after every step, and sleeps on a condition when idle.  The Scheduler stays single-threaded and
unaware of threads: only this thread touches it once the loop has started.

A step that raises fails only the requests of that batch (their streams end with the error);
the loop keeps serving the rest.  The thread starts on the first submission, so code that drives
`engine.scheduler.step()` itself on a fresh engine never races with it (except under tensor
parallelism, where it starts at once: the other ranks need its keep-alives from the start).

Work the loop may do while no request waits (`idle_work`: the engine's background capture,
graphexec/engine/background_capture.py) runs between steps only when the inbox is empty and
nothing is running, one unit per call, so a request arriving meanwhile waits for at most the one
call in progress; before serving anything the loop pauses whatever the idle work runs beside
it (a capture process).  The thread starts at once when there is idle work.

Under tensor parallelism a failed step is different: the ranks are out of step
(WorkerFailedError), so the loop fails every request and stops; the engine takes no more.  While
idle it sends the other ranks a keep-alive every `keep_alive_s`, so that they can tell an idle
rank 0 from a hung one.

On a CPU this thread must be the process's only OpenMP master, or every parallel region pays
a futex wake-up (~40 % of a decode step on 2 cores): Engine loads and captures on a thread that
ends (graphexec/engine/threads.py), so keep other torch work off long-lived threads too.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Protocol

import torch

from graphexec.batch.request import FinishReason
from graphexec.engine.engine_metrics import LoopSnapshot
from graphexec.engine.request_tracker import RequestTracker
from graphexec.engine.serving_stats import ServingStats
from graphexec.errors import EngineClosedError, WorkerFailedError
from graphexec.runner.model_runner import ModelRunner
from graphexec.scheduler.scheduler import Scheduler

_log = logging.getLogger(__name__)

# How long shutdown waits for a step in flight before giving up on the thread.
_JOIN_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class _Submit:
    trackers: tuple[RequestTracker, ...]


@dataclass(frozen=True)
class _Abort:
    rid: str


@dataclass(frozen=True)
class _FlushCache:
    done: Future


class IdleWork(Protocol):
    """What the loop does while idle, a unit at a time (BackgroundCapture)."""

    def run(self) -> float | None:
        """One unit; seconds until the next may start (0: at once), None when there is no more."""

    def pause(self) -> None:
        """The loop is about to serve: stop anything running beside it until the next `run`."""

    def waits(self) -> bool:
        """Whether the next unit must wait for the loop to have been idle `idle_delay_s` (false:
        it takes milliseconds, so a request that comes meanwhile hardly waits)."""

    def close(self) -> None:
        """The loop stops: end anything still running."""


def cuda_index(device: torch.device) -> int | None:
    """The CUDA device the loop thread pins, None off CUDA.  `device=cuda` without an index means
    the current device of the thread that builds the engine (where the weights and graphs went);
    `torch.cuda.set_device` refuses a device without an index."""
    if device.type != "cuda":
        return None
    return device.index if device.index is not None else torch.cuda.current_device()


class EngineLoop:
    def __init__(
        self,
        scheduler: Scheduler,
        runner: ModelRunner,
        name: str = "graphexec-engine-loop",
        idle_work: IdleWork | None = None,
        idle_delay_s: float = 0.0,
    ):
        self._scheduler = scheduler
        self._runner = runner
        self._cuda_index = cuda_index(runner.device)
        self._name = name
        # Rank 0 of several: idle for this long, it tells the other ranks it is alive.
        self._keep_alive_s = keep_alive_s = runner.keep_alive_s
        self.stats = ServingStats()
        self._wakeup = threading.Condition()
        # Guarded by _wakeup: the inbox, the ids of unfinished requests, the stop flag, the thread.
        self._inbox: list[_Submit | _Abort | _FlushCache] = []
        self._unfinished: set[str] = set()
        self._stopping = False
        self._broken: WorkerFailedError | None = None  # why the loop stopped by itself
        self._thread: threading.Thread | None = None
        # Loop thread only.
        self._trackers: dict[str, RequestTracker] = {}
        # Loop thread only once started.
        self._idle_work = idle_work
        # Idle work waits until nothing has happened for this long: a caller that submits right
        # after building the engine (graphexec-generate) never waits for a capture; work that
        # takes milliseconds (`IdleWork.waits`: loading stored graphs) does not wait.
        self._idle_delay_s = idle_delay_s
        self._idle_after = time.monotonic() + self._idle_delay()
        # Replaced whole by the thread that owns scheduler and runner; read by any thread.
        self._snapshot = LoopSnapshot.take(scheduler, runner)
        if keep_alive_s is not None or idle_work is not None:
            # Other ranks wait on this loop from now on, requests or not; idle work starts now.
            with self._wakeup:
                self._start_thread()

    # ---- any thread ----

    def submit(self, trackers: list[RequestTracker]) -> None:
        """Queue requests; all of them reach the scheduler in the same step, in order."""
        with self._wakeup:
            if self._stopping:
                raise self._closed_error()
            if self._thread is None:
                self._start_thread()
            self._inbox.append(_Submit(tuple(trackers)))
            self._unfinished.update(t.rid for t in trackers)
            self._wakeup.notify()

    def _start_thread(self) -> None:
        self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
        self._thread.start()

    def abort(self, rid: str) -> bool:
        """Ask the loop to abort a request; False if it is unknown or already finished."""
        with self._wakeup:
            if rid not in self._unfinished:
                return False
            self._inbox.append(_Abort(rid))
            self._wakeup.notify()
            return True

    def flush_cache(self) -> int:
        """Evict the whole prefix cache on the loop thread; raises RuntimeError while requests
        are in flight.  Returns the slots freed."""
        with self._wakeup:
            if self._stopping:
                raise self._closed_error()
            if self._thread is None:  # nothing has run on a loop thread: the scheduler is ours
                freed = self._scheduler.flush_cache()
                self._take_snapshot()
                return freed
            done: Future = Future()
            self._inbox.append(_FlushCache(done))
            self._wakeup.notify()
        return done.result(timeout=_JOIN_TIMEOUT_S)

    def _closed_error(self) -> EngineClosedError:
        if self._broken is not None:
            return EngineClosedError(f"the engine stopped after a failure and takes no requests: {self._broken}")
        return EngineClosedError("the engine was shut down; create a new Engine")

    def num_unfinished(self) -> int:
        with self._wakeup:
            return len(self._unfinished)

    def snapshot(self) -> LoopSnapshot:
        """The scheduler's, cache's and runner's numbers as the loop last published them (taken
        now if no loop thread has started: until then the caller's thread owns them)."""
        with self._wakeup:
            if self._thread is None:
                self._take_snapshot()
            return self._snapshot

    @property
    def thread_alive(self) -> bool:
        """The thread runs (it outlives a shutdown until every request has its last delta)."""
        with self._wakeup:
            return self._thread is not None and self._thread.is_alive()

    @property
    def is_alive(self) -> bool:
        """Serving: not shut down, and the thread (once started) is running."""
        with self._wakeup:
            return not self._stopping and (self._thread is None or self._thread.is_alive())

    def shutdown(self) -> None:
        """Abort every unfinished request (their streams end with "abort") and stop the thread."""
        with self._wakeup:
            self._stopping = True
            thread = self._thread
            self._wakeup.notify()
        if thread is not None and thread is not threading.current_thread():
            thread.join(_JOIN_TIMEOUT_S)

    # ---- loop thread ----

    def _run(self) -> None:
        if self._cuda_index is not None:
            # The current CUDA device is per thread; graphs and pools live on the engine's.
            torch.cuda.set_device(self._cuda_index)
        while True:
            idle_due = False
            with self._wakeup:
                while not (self._inbox or self._trackers or self._stopping):
                    idle_wait = None if self._idle_work is None else self._idle_after - time.monotonic()
                    if idle_wait is not None and idle_wait <= 0:
                        idle_due = True  # idle long enough: one unit of idle work
                        break
                    waits = [w for w in (self._keep_alive_s, idle_wait) if w is not None]
                    if not self._wakeup.wait(min(waits) if waits else None) and self._keep_alive_s is not None:
                        break  # idle for keep_alive_s: tell the other ranks we are alive
                commands, self._inbox = self._inbox, []
                stopping = self._stopping
            if stopping:
                self._close_idle_work()
                self._abort_everything(commands)
                return
            if idle_due and not commands:
                self._do_idle_work()
                self._take_snapshot()  # a capture changed the backends' counters
                continue
            if self._idle_work is not None:
                self._idle_work.pause()
            self._idle_after = time.monotonic() + self._idle_delay()
            try:
                for command in commands:
                    self._apply(command)
                if self._trackers:
                    self._step()
                elif self._keep_alive_s is not None:
                    self._runner.keep_alive()
                self.publish()
            except WorkerFailedError as error:
                self._stop_broken(error, commands)
                return
            except Exception as error:  # a bug outside the model step: fail what is running, keep serving
                _log.exception("engine loop iteration failed")
                self._fail(list(self._trackers.values()), error)

    def _idle_delay(self) -> float:
        """How long the loop must be idle before the next unit of idle work."""
        if self._idle_work is None or self._idle_work.waits():
            return self._idle_delay_s
        return 0.0

    def _do_idle_work(self) -> None:
        try:
            next_in_s = self._idle_work.run()
        except Exception:  # idle work is an optimisation: serving goes on without it
            _log.exception("idle work failed; the engine keeps serving without it")
            next_in_s = None
        if next_in_s is None:
            self._close_idle_work()
        else:
            self._idle_after = time.monotonic() + next_in_s

    def _close_idle_work(self) -> None:
        if self._idle_work is not None:
            try:
                self._idle_work.close()
            except Exception:  # noqa: BLE001 - closing is best effort; the loop stops or serves on
                _log.exception("closing the idle work failed")
            self._idle_work = None

    def _stop_broken(self, error: WorkerFailedError, commands: list) -> None:
        """The ranks are out of step: fail every request, take no more."""
        _log.error("%s", error)
        self._close_idle_work()
        with self._wakeup:
            self._stopping = True
            self._broken = error
            late, self._inbox = self._inbox, []
        for command in [*commands, *late]:
            if isinstance(command, _Submit):
                for tracker in command.trackers:
                    self._trackers.setdefault(tracker.rid, tracker)
            elif isinstance(command, _FlushCache) and not command.done.done():
                command.done.set_exception(self._closed_error())
        self._fail(list(self._trackers.values()), error)

    def _apply(self, command: _Submit | _Abort | _FlushCache) -> None:
        if isinstance(command, _FlushCache):
            try:
                freed = self._scheduler.flush_cache()
                self._take_snapshot()  # before the caller hears: its next read sees the cache empty
                command.done.set_result(freed)
            except RuntimeError as error:
                command.done.set_exception(error)
        elif isinstance(command, _Submit):
            for tracker in command.trackers:
                self._trackers[tracker.rid] = tracker
                self._scheduler.add_request(tracker.req)
        else:
            tracker = self._trackers.get(command.rid)
            if tracker is not None and not tracker.req.finished:
                tracker.abort_requested = True
                self._scheduler.abort(command.rid)

    def _step(self) -> None:
        try:
            self._scheduler.step()
        except WorkerFailedError:
            raise
        except Exception as error:
            # The scheduler released the failed batch and marked it aborted; those are the
            # requests to fail, unless the caller had asked for the abort anyway.
            failed = [
                t for t in self._trackers.values()
                if t.req.finish_reason is FinishReason.ABORT and not t.abort_requested
            ]
            _log.error("engine step failed for %d request(s): %r", len(failed), error)
            self._fail(failed or list(self._trackers.values()), error)

    def publish(self) -> None:
        """Loop thread only: hand each request its delta since the last iteration (finishing what
        a stop string ended), then the snapshot.  Public so that a benchmark can time it
        (bench/host_overhead.py wraps it on the instance)."""
        now = time.perf_counter()
        new_tokens = 0
        deltas = []
        for tracker in list(self._trackers.values()):
            delta = tracker.collect(now)
            if delta is None:
                continue
            new_tokens += len(delta.token_ids)
            if tracker.stop_string_matched and not tracker.req.finished:
                # Release the KV before anyone hears the request is over.
                self._scheduler.finish(tracker.rid, FinishReason.STOP)
            if delta.finished:
                # Forgotten (unfinished set, finish counters) before the caller hears of it: a
                # client that reads the metrics right after its answer must see it finished.
                self._forget(tracker, delta.finish_reason)
            deltas.append((tracker, delta))
        self.stats.record_tokens(now, new_tokens)
        self._take_snapshot()
        for tracker, delta in deltas:
            if not tracker.sink(delta) and not delta.finished:  # the consumer's event loop is gone
                self._scheduler.abort(tracker.rid)
                self._forget(tracker, "abort")
        if self._trackers and not self._scheduler.has_unfinished():
            # Nothing left to step yet requests are unfinished: never spin on them.
            self._fail(list(self._trackers.values()), RuntimeError("the scheduler lost track of these requests"))

    def _fail(self, trackers: list[RequestTracker], error: BaseException) -> None:
        for tracker in trackers:
            if not tracker.req.finished:
                self._scheduler.abort(tracker.rid)
            self._forget(tracker, "error")
        self._take_snapshot()
        for tracker in trackers:
            tracker.sink(error)

    def _take_snapshot(self) -> None:
        self._snapshot = LoopSnapshot.take(self._scheduler, self._runner)

    def _forget(self, tracker: RequestTracker, reason: str) -> None:
        self._trackers.pop(tracker.rid, None)
        with self._wakeup:
            self._unfinished.discard(tracker.rid)
        self.stats.record_finish(reason)

    def _abort_everything(self, commands: list[_Submit | _Abort | _FlushCache]) -> None:
        for command in commands:
            if isinstance(command, _FlushCache):
                command.done.set_exception(EngineClosedError("the engine was shut down"))
            elif isinstance(command, _Submit):
                for tracker in command.trackers:
                    tracker.req.finish_reason = FinishReason.ABORT  # never reached the scheduler
                    self._trackers[tracker.rid] = tracker
        for tracker in self._trackers.values():
            if not tracker.req.finished:
                self._scheduler.abort(tracker.rid)
        self.publish()
