"""The one interface every capture backend implements, what it is given, and the counters it keeps."""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Iterable, Mapping, TypeVar

import torch
from tqdm import tqdm

from capture.batch import BucketableBatch, Phase
from capture.memory import memory_in_use
from capture.padding import PaddingPolicy

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
    # Enter to run a forward over this batch: sets the forward context and prepares the attention
    # backend's metadata for it (outside any graph).
    forward_scope: Callable[[BucketableBatch], ContextManager[None]]
    padding: PaddingPolicy
    # A batch with no rows in the given phase: what padding fills up into a capture batch.
    empty_batch: Callable[[Phase], BucketableBatch]
    # Switch the attention backend to fixed-address, fixed-shape decode metadata for batches of up
    # to this many rows: what a CUDA graph replays against.
    enable_static_metadata: Callable[[int], None]
    # Qualified names of the ops a traced forward is cut at (tc_piecewise's default split_ops):
    # the caller's break-point ops, registered by the caller.
    split_ops: tuple[str, ...] = ()


@dataclass
class BackendStats:
    """What a backend did, for benchmarks and /metrics."""

    capture_seconds: dict[int, float] = field(default_factory=dict)  # per bucket
    capture_bytes: dict[int, int] = field(default_factory=dict)  # per bucket (device or host RSS)
    executions: int = 0  # forwards run (graph replays for graph backends)
    fallbacks: int = 0  # forwards handed to eager because this backend could not run them
    padded_rows: int = 0  # rows added to reach a bucket, summed over executions

    def as_dict(self) -> dict[str, Any]:
        return {
            "capture_seconds": dict(self.capture_seconds),
            "capture_bytes": dict(self.capture_bytes),
            "executions": self.executions,
            "fallbacks": self.fallbacks,
            "padded_rows": self.padded_rows,
        }


class CaptureBackend(ABC):
    """`capture()` once at start-up, then `can_run(fb)` / `execute(fb)` per forward."""

    name: str = ""

    def __init__(self, env: CaptureEnv, options: Mapping[str, Any], config_path: str = "capture"):
        self.env = env
        self.options = dict(options)
        # Where this backend's options live in the config, so errors can name them.
        self.config_path = config_path
        self.stats = BackendStats()

    def capture(self) -> None:
        """Build graphs ahead of serving.  Backends with nothing to capture keep this no-op."""

    def _capture_each(self, buckets: Iterable[int], label: str, capture_one: Callable[[int], object]) -> None:
        """Capture every bucket, largest first (on CUDA the smaller graphs then reuse the shared
        pool's blocks), behind a progress bar unless `progress: false`."""
        bar = tqdm(
            sorted(buckets, reverse=True),
            desc=f"capture {label}",
            unit="bucket",
            disable=not self.options.get("progress", True),
        )
        for bucket in bar:
            bar.set_postfix(bucket=bucket)
            capture_one(bucket)
        bar.close()

    def _measured(self, bucket: int, capture: Callable[[], T]) -> T:
        """Run one bucket's capture, recording its seconds and memory in the stats."""
        before, t0 = memory_in_use(self.env.device), time.perf_counter()
        result = capture()
        self.stats.capture_seconds[bucket] = time.perf_counter() - t0
        self.stats.capture_bytes[bucket] = max(0, memory_in_use(self.env.device) - before)
        return result

    @abstractmethod
    def can_run(self, fb: BucketableBatch) -> bool: ...

    @abstractmethod
    def execute(self, fb: BucketableBatch) -> torch.Tensor:
        """Hidden rows of fb's fb.num_token_non_padded real tokens, and nothing else: a backend that
        pads slices its padding off before returning (capture/bucketed.py does it, once)."""
