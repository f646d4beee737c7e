"""The bucketed-capture core every graph backend is built on: buckets, static inputs, padding, the
capture loop, and a forward = pad → run → slice.

A backend is this core with a *phase* and a *mechanism*:

  phase      ROWS (decode: a bucket counts requests, every per-row field pads) or TOKENS (extend
             and mixed: a bucket counts tokens, only per-token fields pad; the per-request layout
             stays the real one).
  mechanism  the `graph` option, the same set for every backend:
               compile     the backend's compiled forward, called directly (the CPU default)
               cuda_graph  that forward recorded as CUDA graphs between its breaks, replayed
                           (capture/segments.py over capture/recorders.py; the CUDA default)
               tape        the same recording with capture/op_tape.py: CUDA-graph semantics on
                           any device (tests, debugging)
               eager       debug: padding and static buffers, the plain model inside
  A backend says only what its forward is (`_bucket_forward`) and how a recording finds its
  graphs (`implicit_segments`): full_graph's whole forward is one graph with zero breaks,
  breakable's graphs lie between its breaks, tc_piecewise hands over its pieces.

The core pads, runs and slices back exactly once: callers get the real rows only.  A batch runs
here only if a bucket holds it with at most `max_padding` of the bucket as padding; otherwise
`can_run` is False and the caller falls back to eager (`takes` counts it).  The options common to
every bucketed backend (capture/options.py `BucketedOptions`): graph, buckets, lazy (capture a
bucket on first use), progress, max_padding, keep, min_speedup.

A graph must pay for itself: with `keep: faster` each captured bucket is timed against the eager
forward on its capture batch (capture/measure.py) and dropped unless it is `min_speedup` times
faster; a dropped bucket runs eager.  Decisions taken earlier (a stored plan,
capture/plan_store.py) are handed in with `preset`: a bucket decided dropped is never compiled,
one decided kept is compiled (or its stored artifact loaded, capture/artifacts.py) without timing
it again.  `keep: all` keeps every graph (benchmarks, GPUs).

A bucket whose graph another process builds (`builds_apart`) may serve from a stand-in meanwhile,
one that process builds first in a fraction of the time (full_graph: the regional layer for a whole
forward's package, `compile.interim_buckets`): once told it is built (`interim_built`), the caller
captures the bucket again, which loads the stand-in, times it against eager and, if it is faster,
serves it in the `interim` state; the bucket stays pending, and its next capture (once its graph is
stored) replaces the stand-in with the graph, timed and decided on its own.  A stand-in decides
nothing that is kept: the plan holds only the graph's decision.

The caller may capture ahead of serving (`capture_plan`, largest bucket first) or one bucket at a
time while serving (`pending_buckets`, smallest first: B=1 decode is the most used).
"""

from __future__ import annotations

import logging
import time
from abc import abstractmethod
from typing import Callable, ContextManager, Iterator, Mapping

import torch
from tqdm import tqdm

from capture.artifacts import ArtifactStore
from capture.backend import CaptureBackend, CaptureEnv, PreparedForward
from capture.batch import BucketableBatch, Phase
from capture.buckets import bucket_for
from capture.measure import BucketDecision, decide, time_interleaved
from capture.options import BucketedOptions
from capture.padding import StaticInputs
from capture.recorders import RECORDERS
from capture.segments import GraphRecorder, SegmentedGraph, record_segments

_log = logging.getLogger(__name__)
BucketRunner = Callable[[BucketableBatch], torch.Tensor]
# Runs of a bucket's forward before it is recorded: lazy initialisation (kernels, handles,
# allocator growth, compilation) must happen outside the graphs.
_WARMUPS_BEFORE_RECORDING = 2


class BucketedBackend(CaptureBackend):
    phase: Phase
    options: BucketedOptions
    options_type = BucketedOptions
    # How a recording finds its graphs (capture.segments.record_segments): between the breaks, or
    # around the pieces the forward hands over itself.
    implicit_segments = True

    def __init__(self, env: CaptureEnv, options: BucketedOptions | Mapping, config_path: str):
        super().__init__(env, options, config_path)
        self.mechanism = mechanism_on(self.options.graph, env.device)
        # Shared by every backend of the engine (one CUDA pool); None unless the mechanism records.
        self.recorder: GraphRecorder | None = None
        if self.mechanism in RECORDERS:
            self.recorder = env.recorders.get(self.mechanism, env.device, f"{config_path}.graph", env.traced_ops)
        # Its own attribute, not read through the options: a benchmark offers a copy of this
        # backend fewer buckets (bench/padding.py).
        self.buckets = self.options.buckets
        self.buffers = StaticInputs(self.buckets[-1], env.device)
        self._created_at = time.perf_counter()
        self.stats.states.update({bucket: "pending" for bucket in self.buckets})
        # Decisions handed in from a stored plan (bucket -> decision), honoured without measuring.
        self._preset: dict[int, BucketDecision] = {}
        # Where compiled code persists across starts (handed in with `preset`); None: nowhere.
        self.artifacts: ArtifactStore | None = None
        self._runners: dict[int, BucketRunner] = {}
        # Buckets whose stand-in another process built (`interim_built`), and those whose stand-in
        # was tried here (each is tried once, kept or not).
        self._interim_built: set[int] = set()
        self._interim_tried: set[int] = set()
        self._recorded: dict[int, SegmentedGraph] = {}
        self._prepared = False
        if self.phase is Phase.ROWS and self.recorder is not None:
            # A recorded decode graph replays attention inside it, against fixed metadata buffers.
            self.static_metadata_rows = self.buckets[-1]

    # -- what a backend says ---------------------------------------------------------------------

    @abstractmethod
    def _bucket_forward(self, bucket: int) -> BucketRunner:
        """What runs a padded batch of `bucket` under this backend's mechanism before any
        recording: compiled code (compiled for the bucket on its first call), or the forward a
        recorder records."""

    def _before_capture(self) -> None:
        """Once, before the first bucket is captured (eagerly or lazily)."""

    def _interim_possible(self, bucket: int) -> bool:
        """Whether `bucket`, built apart, has a stand-in that builds in a fraction of its graph's time."""
        return False

    def _interim_stored(self, bucket: int) -> bool:
        """Whether `bucket`'s stand-in is stored, ready to load."""
        return False

    def interim_compiled_with(self, bucket: int) -> str:
        """What building `bucket`'s stand-in produces (`compiled_with`, for stand-ins)."""
        return f"interim {bucket}"

    def _make_interim_runner(self, bucket: int, batch: BucketableBatch) -> BucketRunner:
        """`bucket`'s stand-in, run once on `batch` (built and saved, or loaded)."""
        raise NotImplementedError(f"{self.name} has no stand-in graphs")

    # Each bucket is a legitimate compile of the same code (more than one with regional or
    # piecewise compilation), so capture lifts Dynamo's recompile limits.
    recompile_limit = 4096

    # -- capture ---------------------------------------------------------------------------------

    def preset(self, decisions: Mapping[int, BucketDecision], artifacts: ArtifactStore | None = None) -> None:
        """Decisions taken before (a stored plan): dropped buckets are never compiled, kept ones
        are compiled without being timed again.  Buckets not in the plan are ignored.  `artifacts`:
        the plan's compiled-code store, for a backend that persists its compiled code."""
        self.artifacts = artifacts
        self._preset = {b: d for b, d in decisions.items() if b in self.buckets}
        for bucket, decision in self._preset.items():
            if not decision.kept:
                self._drop(bucket, decision)

    def capture_plan(self) -> Iterator[tuple[int, BucketableBatch]]:
        # Each capture pass starts from a fresh forward (a break marked since the last pass cuts it).
        self._before_capture()
        self._prepared = True
        if self.options.lazy:
            return
        # Every bucket not dropped, captured again if it was before (a new break marked since).
        todo = [b for b in self.buckets if self.stats.states[b] != "dropped"]
        for bucket in self._progress(todo, f"{self.name} ({self.mechanism})"):
            yield bucket, self.dummy_batch(bucket)

    def pending_buckets(self) -> list[int]:
        """Buckets neither captured nor dropped, smallest first (the order of expected use); none
        when `lazy` (a bucket is captured on its first batch)."""
        if self.options.lazy:
            return []
        return [b for b in self.buckets if self.stats.states[b] in ("pending", "compiling", "interim")]

    def dummy_batch(self, bucket: int) -> BucketableBatch:
        """A batch of padding rows only, in the static buffers: what a bucket is captured on."""
        return self.buffers.dummy_batch(bucket, self.env.padding, self.phase, self.env.empty_batches[self.phase])

    def capture_bucket(self, bucket: int, batch: BucketableBatch) -> None:
        """Make `bucket` runnable on `batch` (a padded batch of that bucket, in the static buffers),
        inside the caller's forward scope for it; seconds and memory go to the stats."""
        self._prepare_once()
        if self.stats.states[bucket] == "dropped":
            return
        if self.interim_waiting(bucket):
            self._capture_interim(bucket, batch)
            return
        self.stats.states[bucket] = "compiling"
        try:
            runner = self._build(bucket, batch)
        except BaseException:
            self.stats.states[bucket] = "pending"
            raise
        decision = self._decide(bucket, batch, runner)
        if not decision.kept:
            self._drop(bucket, decision)
            return
        self.stats.decisions[bucket] = decision
        self._runners[bucket] = runner
        self.stats.states[bucket] = "ready"
        self.stats.ready_after_seconds[bucket] = round(time.perf_counter() - self._created_at, 3)

    def build(self, bucket: int, batch: BucketableBatch, interim: bool = False) -> None:
        """Compile `bucket` (with `interim`, its stand-in) on `batch` as `capture_bucket` would,
        saving what persists (`builds_apart`), but neither time it nor swap it in: what a process
        that builds for another one runs."""
        self._prepare_once()
        if interim:
            with self._compile_limits(bucket):
                self._make_interim_runner(bucket, batch)
        else:
            self._build(bucket, batch)

    def interims_to_build(self) -> list[int]:
        """The pending buckets built apart whose stand-in is still to be built, smallest first.
        Those whose stand-in is stored already count as built (`interim_built`)."""
        todo = []
        for bucket in BucketedBackend.pending_buckets(self):
            if not (self.builds_apart(bucket) and self._interim_possible(bucket)):
                continue
            if self._interim_stored(bucket):
                self.interim_built(bucket)
            else:
                todo.append(bucket)
        return todo

    def interim_built(self, bucket: int) -> None:
        """Another process has built (and stored) `bucket`'s stand-in: the next capture loads it."""
        self._interim_built.add(bucket)

    def interim_waiting(self, bucket: int) -> bool:
        """Whether capturing `bucket` now would load its stand-in: built, stored, not tried yet,
        and its graph still being built elsewhere."""
        return (bucket in self._interim_built and bucket not in self._interim_tried
                and self.stats.states[bucket] in ("pending", "compiling")
                and self.builds_apart(bucket) and self._interim_stored(bucket))

    def _capture_interim(self, bucket: int, batch: BucketableBatch) -> None:
        """Load `bucket`'s stand-in and serve it (`interim`) if it times faster than eager; the
        bucket stays pending either way."""
        self._interim_tried.add(bucket)
        try:
            with self._compile_limits(bucket):
                runner = self._make_interim_runner(bucket, batch)
        except Exception as error:  # noqa: BLE001 - a stand-in is optional: the bucket's graph still comes
            _log.warning("%s bucket %d: its stand-in failed (%r); it runs eager until its graph is built",
                         self.config_path, bucket, error)
            return
        decision = self._timed(batch, runner)
        self.stats.interim_decisions[bucket] = decision
        if decision.kept:
            self._runners[bucket] = runner
            self.stats.states[bucket] = "interim"
            self.stats.interim_after_seconds[bucket] = round(time.perf_counter() - self._created_at, 3)

    def builds_apart(self, bucket: int) -> bool:
        """Whether another process running this same backend (same options, same artifact store)
        could compile `bucket` and save it where this one's capture then only loads it, and has
        not yet.  False for a backend whose compiled code does not persist."""
        return False

    def only_loads(self, bucket: int) -> bool:
        """Whether capturing `bucket` would only load stored compiled code that needs no compiler
        imported: milliseconds, so a request need not be kept from waiting on it."""
        return False

    def load_needs_compiler(self, bucket: int) -> bool:
        """Whether loading `bucket`'s stored compiled code (once saved) imports Dynamo and inductor."""
        return True

    def pending_only_load(self) -> bool:
        """Whether every pending bucket `only_loads` (cheap: the loop asks between requests)."""
        return all(self.only_loads(b) for b in BucketedBackend.pending_buckets(self))

    def compiled_with(self, bucket: int) -> str:
        """What compiling `bucket` produces: buckets with the same answer share one compile, so
        one process must build them, in order (the first compiles, the others reuse it)."""
        return str(bucket)

    def compiling_elsewhere(self, bucket: int) -> None:
        """Another process is compiling `bucket` for this one (its state says so until captured)."""
        if self.stats.states.get(bucket) == "pending":
            self.stats.states[bucket] = "compiling"

    def _build(self, bucket: int, batch: BucketableBatch) -> BucketRunner:
        with self._compile_limits(bucket):
            return self._measured(bucket, lambda: self._make_runner(bucket, batch))

    def _compile_limits(self, bucket: int) -> ContextManager:
        """Dynamo's recompile limits lifted for `bucket`'s compile (see `recompile_limit`)."""
        limit = self.recompile_limit
        return torch._dynamo.config.patch(recompile_limit=limit, accumulated_recompile_limit=max(65536, limit))

    def _decide(self, bucket: int, batch: BucketableBatch, runner: BucketRunner) -> BucketDecision:
        """The preset decision, else `keep=all`, else the graph timed against eager on `batch`."""
        if bucket in self._preset:
            return self._preset[bucket]
        return self._timed(batch, runner)

    def _timed(self, batch: BucketableBatch, runner: BucketRunner) -> BucketDecision:
        """`runner` timed against eager on `batch` (kept without timing under `keep=all`)."""
        if self.options.keep == "all" or self.mechanism == "eager":
            return BucketDecision(kept=True, reason="keep=all")
        eager_ms, graph_ms = time_interleaved(lambda: self._run_model(batch), lambda: runner(batch))
        return decide(eager_ms, graph_ms, self.options.min_speedup)

    def drop(self, bucket: int, reason: str) -> None:
        """Run `bucket` eager from now on (its capture failed, say)."""
        self._drop(bucket, BucketDecision(kept=False, reason=reason))

    def _drop(self, bucket: int, decision: BucketDecision) -> None:
        self.stats.decisions[bucket] = decision
        self.stats.states[bucket] = "dropped"
        self._runners.pop(bucket, None)
        self._recorded.pop(bucket, None)

    def _progress(self, buckets: list[int], label: str) -> Iterator[int]:
        """Buckets in capture order, largest first (on CUDA the smaller graphs then reuse the
        shared pool's blocks), behind a progress bar unless `progress: false`."""
        bar = tqdm(sorted(buckets, reverse=True), desc=f"capture {label}", unit="bucket", disable=not self.options.progress)
        for bucket in bar:
            bar.set_postfix(bucket=bucket)
            yield bucket
        bar.close()

    def _prepare_once(self) -> None:
        if not self._prepared:
            self._before_capture()
            self._prepared = True

    def _make_runner(self, bucket: int, batch: BucketableBatch) -> BucketRunner:
        if self.mechanism == "eager":
            return self._run_model
        forward = self._bucket_forward(bucket)
        if self.recorder is None:
            if not self._adopt_without_a_run(bucket):
                forward(batch)  # compiles this bucket's static shape
            return forward
        for _ in range(_WARMUPS_BEFORE_RECORDING):
            forward(batch)
        recorded = record_segments(self.recorder, lambda: forward(batch), implicit=self.implicit_segments)
        self._recorded[bucket] = recorded
        return lambda fb: recorded.replay()

    def _adopt_without_a_run(self, bucket: int) -> bool:
        """Make `bucket` ready without running it once on its capture batch (where it compiles, or
        where what was loaded for it is first checked) if code that already ran can serve it; True
        when it did."""
        return False

    def segments_of(self, bucket: int) -> SegmentedGraph | None:
        """The recorded graphs and breaks of a bucket (None unless the mechanism records)."""
        return self._recorded.get(bucket)

    def _run_model(self, fb: BucketableBatch) -> torch.Tensor:
        return self.env.model(fb.input_ids, fb.positions)

    # -- per forward -----------------------------------------------------------------------------

    def size_of(self, fb: BucketableBatch) -> int:
        """What a bucket counts: requests (ROWS) or tokens (TOKENS)."""
        return fb.batch_size if self.phase is Phase.ROWS else fb.num_tokens

    def can_run(self, fb: BucketableBatch) -> bool:
        if fb.phase is not self.phase:
            return False
        size = self.size_of(fb)
        bucket = bucket_for(size, self.buckets)
        if bucket is None or bucket - size > self.options.max_padding * bucket:
            return False
        if self.options.lazy:
            return self.stats.states[bucket] != "dropped"
        return bucket in self._runners

    def prepare(self, fb: BucketableBatch) -> PreparedForward:
        size = self.size_of(fb)
        bucket = bucket_for(size, self.buckets)
        padded = self._pad(fb, bucket)

        def run() -> torch.Tensor:
            if bucket not in self._runners:  # lazy: captured (and maybe dropped) on this very batch
                self.capture_bucket(bucket, padded)
            hidden = self._runners.get(bucket, self._run_model)(padded)
            self.stats.executions += 1
            self.stats.padded_rows += bucket - size
            return hidden[: fb.num_token_non_padded]

        return PreparedForward(padded, run)

    def _pad(self, fb: BucketableBatch, bucket: int) -> BucketableBatch:
        if self.phase is Phase.ROWS:
            return self.buffers.load(fb, bucket, self.env.padding)
        return self.buffers.load_tokens(fb, bucket, self.env.padding)


def mechanism_on(graph: str, device: torch.device) -> str:
    """What `graph` (checked by capture/option_parser.py) runs on `device`: auto resolved."""
    if graph == "auto":
        return "cuda_graph" if device.type == "cuda" else "compile"
    return graph
