"""The one interface every capture backend implements, what it is given, and the counters it keeps.

The caller drives: it asks a backend which buckets to capture (`capture_plan`) and captures
each inside its own forward scope (`capture_bucket`); per forward it asks `takes` (which counts a
batch the backend cannot run as a fallback), then `prepare` (the padded batch to open its scope
for) and runs what `prepare` returned inside that scope.  A backend never calls back into its
caller, and only a backend moves its counters (`BackendStats`).
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, TypeVar

import torch
from capture.batch import BucketableBatch, Phase
from capture.measure import BucketDecision
from capture.memory import memory_in_use
from capture.option_parser import options_for
from capture.options import CaptureOptions
from capture.padding import PaddingPolicy
from capture.recorders import Recorders

T = TypeVar("T")


# (input_ids, positions) -> final hidden rows.  Attention metadata reaches the model through the
# forward context, so this is the whole signature a graph needs to capture.  The model also takes
# an optional `layer_runner=` keyword (see LlamaForCausalLM.forward) for regional compilation.
ModelCallable = Callable[..., torch.Tensor]


@dataclass(frozen=True)
class CaptureEnv:
    """What the caller (graphexec's ModelRunner) hands a backend.  No scheduler, no requests, no
    attention internals."""

    model: ModelCallable
    device: torch.device
    padding: PaddingPolicy
    # A batch with no rows, per phase: what padding fills up into a capture batch.
    empty_batches: Mapping[Phase, BucketableBatch]
    # Qualified names of the ops a traced forward is cut at (tc_piecewise's default split_ops):
    # the caller's break-point ops, registered by the caller.
    split_ops: tuple[str, ...] = ()
    # Custom ops a graph records by what they launch, not as a call: ops whose implementation
    # reads per-forward state on the host (graphexec: attention).  A CUDA graph does this by
    # nature; the op tape needs telling (capture/op_tape.py).
    traced_ops: tuple[str, ...] = ()
    # The graph recorders of every backend built with this env: one per kind, so all CUDA graphs
    # of an engine (decode and prefill, every bucket) share one memory pool.
    recorders: Recorders = field(default_factory=Recorders)


@dataclass(frozen=True)
class PreparedForward:
    """One forward, ready to run: the caller opens its forward scope for `batch` (the padded batch
    the graphs run on), then calls `run()`, which returns the real rows only."""

    batch: BucketableBatch
    run: Callable[[], torch.Tensor]


@dataclass
class BackendStats:
    """What a backend did, for benchmarks and /metrics: its one set of counters, moved only by the
    backend (and the helpers it owns, such as its AotRegion)."""

    capture_seconds: dict[int, float] = field(default_factory=dict)  # per bucket
    capture_bytes: dict[int, int] = field(default_factory=dict)  # per bucket (device or host RSS)
    executions: int = 0  # forwards run (graph replays for graph backends)
    fallbacks: int = 0  # forwards handed to eager because this backend could not run them
    padded_rows: int = 0  # rows added to reach a bucket, summed over executions
    # Per bucket of a bucketed backend: pending | compiling | interim | ready | dropped (BUCKET_STATES).
    states: dict[int, str] = field(default_factory=dict)
    # Per decided bucket: kept or dropped, and the timings behind it (capture/measure.py).
    decisions: dict[int, BucketDecision] = field(default_factory=dict)
    # Per bucket that became ready: seconds from the backend's creation (about the weights being
    # loaded) until it could serve.
    ready_after_seconds: dict[int, float] = field(default_factory=dict)
    # Per bucket that served from a stand-in while its graph was built elsewhere (the `interim`
    # state): seconds from the backend's creation until the stand-in served, and its timing
    # against eager (never part of the plan: the graph that replaces it is timed on its own).
    interim_after_seconds: dict[int, float] = field(default_factory=dict)
    interim_decisions: dict[int, BucketDecision] = field(default_factory=dict)
    # Compiled code persisted across starts (full_graph `compile.aot`, capture/aot_region.py): what
    # each ready bucket runs ("artifact" loaded, "compiled" ahead of time here, "dynamo" when it
    # could not be), layers compiled ahead of time in this process, artifacts written, loaded,
    # and stored ones rejected (damaged, foreign, stale) and rebuilt.
    origins: dict[int, str] = field(default_factory=dict)
    aot_compiles: int = 0
    artifacts_saved: int = 0
    artifacts_loaded: int = 0
    artifacts_rejected: int = 0
    # Graphs handed to a compiler, all buckets together: breakable's segments, tc_piecewise's
    # distinct pieces (identical pieces compile once).
    compiles: int = 0
    # Per bucket of tc_piecewise: compiled pieces in its graph, and split-op calls between them.
    pieces: dict[int, int] = field(default_factory=dict)
    splits: dict[int, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {
            "capture_seconds": dict(self.capture_seconds),
            "capture_bytes": dict(self.capture_bytes),
            "executions": self.executions,
            "fallbacks": self.fallbacks,
            "padded_rows": self.padded_rows,
            "aot_compiles": self.aot_compiles,
            "artifacts_saved": self.artifacts_saved,
            "artifacts_loaded": self.artifacts_loaded,
            "artifacts_rejected": self.artifacts_rejected,
            "compiles": self.compiles,
            "buckets": {
                bucket: {
                    "state": state,
                    "ready_after_s": self.ready_after_seconds.get(bucket),
                    "interim_after_s": self.interim_after_seconds.get(bucket),
                    "interim": self.interim_decisions[bucket].as_dict() if bucket in self.interim_decisions else None,
                    "origin": self.origins.get(bucket),
                    "pieces": self.pieces.get(bucket),
                    "splits": self.splits.get(bucket),
                }
                | (self.decisions[bucket].as_dict() if bucket in self.decisions else {})
                for bucket, state in sorted(self.states.items())
            },
        }


# What a bucket of a bucketed backend is doing: not captured yet (it runs eager meanwhile), being
# captured, serving from a stand-in while its graph is built elsewhere (capture/bucketed.py,
# `interim`), serving from its graph, or measured no faster than eager (it runs eager for good).
BUCKET_STATES = ("pending", "compiling", "interim", "ready", "dropped")


class CaptureBackend(ABC):
    """Captured once at start-up (`capture_plan` / `capture_bucket`), then `can_run(fb)` /
    `prepare(fb)` per forward."""

    name: str = ""
    # What this backend takes (capture/options.py).
    options_type: type[CaptureOptions] = CaptureOptions

    def __init__(
        self, env: CaptureEnv, options: CaptureOptions | Mapping[str, Any] | None = None, config_path: str = "capture"
    ):
        self.env = env
        # Where this backend's options live in the config, so errors can name them.
        self.config_path = config_path
        if options is None or isinstance(options, Mapping):
            # Config data (the caller's eager backend, tests, benchmarks) goes through the one check.
            options = options_for(self.name, options, config_path, device=env.device)
        if not isinstance(options, self.options_type):
            raise TypeError(f"{self.name} takes {self.options_type.__name__}, not {type(options).__name__}")
        self.options = options
        self.stats = BackendStats()

    # Rows of fixed-address decode metadata this backend's graphs replay against (0: none).  The
    # caller switches its attention backend to static metadata for that many rows before capture.
    static_metadata_rows: int = 0

    def capture_plan(self) -> Iterator[tuple[int, BucketableBatch]]:
        """The buckets to capture ahead of serving, each with the batch to capture it on, behind
        a progress bar.  Backends with nothing to capture yield nothing."""
        return iter(())

    def capture_bucket(self, bucket: int, batch: BucketableBatch) -> None:
        """Make `bucket` runnable, inside the caller's forward scope for `batch`."""
        raise NotImplementedError(f"{self.name} captures nothing")

    def _measured(self, bucket: int, capture: Callable[[], T]) -> T:
        """Run one bucket's capture, recording its seconds and memory in the stats."""
        before, t0 = memory_in_use(self.env.device), time.perf_counter()
        result = capture()
        self.stats.capture_seconds[bucket] = time.perf_counter() - t0
        self.stats.capture_bytes[bucket] = max(0, memory_in_use(self.env.device) - before)
        return result

    @abstractmethod
    def can_run(self, fb: BucketableBatch) -> bool: ...

    def takes(self, fb: BucketableBatch) -> bool:
        """Whether this backend runs fb.  One it cannot run is counted as a fallback here, where the
        counters live: the caller runs it eagerly instead."""
        if self.can_run(fb):
            return True
        self.stats.fallbacks += 1
        return False

    @abstractmethod
    def prepare(self, fb: BucketableBatch) -> PreparedForward:
        """fb ready to run.  `run()` returns the hidden rows of fb's fb.num_token_non_padded real
        tokens, and nothing else: a backend that pads slices its padding off (capture/bucketed.py
        does it, once)."""
