"""The bucketed-capture core every graph backend is built on: buckets, static inputs, padding, the
capture loop, and `execute` = pad → run → slice.

A backend is this core with a *phase* and a way to make one bucket runnable:

  phase    ROWS (decode: a bucket counts requests, every per-row field pads) or TOKENS (extend and
           mixed: a bucket counts tokens, only per-token fields pad; the per-request layout stays
           the real one).
  bucket   `_capture_bucket(bucket, dummy)` returns the runner of one bucket: compiled code called
           directly, recorded graphs replayed, or the model itself (debug).

The core pads, runs and slices back exactly once: callers get the real rows only.  A batch runs
here only if a bucket holds it with at most `max_padding` of the bucket as padding; otherwise
`can_run` is False and the caller falls back to eager (and counts it).  Options common to every
bucketed backend: buckets, lazy (capture a bucket on first use), progress, max_padding.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import Any, Callable, Mapping

import torch

from capture.backend import CaptureBackend, CaptureEnv
from capture.batch import BucketableBatch, Phase
from capture.buckets import bucket_for, validate_buckets
from capture.errors import CaptureConfigError
from capture.padding import StaticInputs

BucketRunner = Callable[[BucketableBatch], torch.Tensor]
COMMON_OPTIONS = frozenset({"buckets", "lazy", "progress", "max_padding"})
# Decode pads whole requests, which cost little next to the weights every row reads; a prefill
# pads tokens, and its compute grows with them, so by default a batch that would be more than
# 5 % padding runs eager (configs/capture/graph_first.yaml; bench=prefill measured why).
DEFAULT_MAX_PADDING = {Phase.ROWS: 1.0, Phase.TOKENS: 0.05}


class BucketedBackend(CaptureBackend):
    phase: Phase
    # Backend-specific options, besides COMMON_OPTIONS.
    extra_options: frozenset[str] = frozenset()

    def __init__(self, env: CaptureEnv, options: Mapping[str, Any], config_path: str):
        super().__init__(env, options, config_path)
        known = COMMON_OPTIONS | self.extra_options
        unknown = sorted(set(self.options) - known)
        if unknown:
            raise CaptureConfigError(f"{config_path}.{unknown[0]} is not a {self.name} option; known: {sorted(known)}")
        self.buckets = validate_buckets(self.options.get("buckets"), f"{config_path}.buckets")
        self.lazy = bool(self.options.get("lazy", False))
        self.max_padding = _padding_limit(
            self.options.get("max_padding", DEFAULT_MAX_PADDING[self.phase]), f"{config_path}.max_padding"
        )
        self.buffers = StaticInputs(self.buckets[-1], env.device)
        self._runners: dict[int, BucketRunner] = {}

    # -- what a backend says ---------------------------------------------------------------------

    @abstractmethod
    def _capture_bucket(self, bucket: int, dummy: BucketableBatch) -> BucketRunner:
        """Make `bucket` runnable (compile, record, ...) using `dummy`, a batch of padding rows
        only, already in the static buffers; returns what runs a padded batch of that bucket."""

    def _before_capture(self) -> None:
        """Once, before the first bucket is captured (eagerly or lazily)."""

    def _ready(self) -> bool:
        """False until the backend can capture at all (e.g. before its forward is built)."""
        return True

    # Each bucket is a legitimate compile of the same code (more than one with regional or
    # piecewise compilation), so capture lifts Dynamo's recompile limits.
    recompile_limit = 4096

    # -- the core --------------------------------------------------------------------------------

    def capture(self) -> None:
        self._before_capture()
        if not self.lazy:
            self._capture_each(self.buckets, f"{self.name} ({self.mechanism})", self._capture_timed)

    @property
    def mechanism(self) -> str:
        return str(getattr(self, "graph_kind", "compile"))

    def _capture_timed(self, bucket: int) -> BucketRunner:
        dummy = self.buffers.dummy_batch(bucket, self.env.padding, self.phase, self.env.empty_batch(self.phase))
        limit = self.recompile_limit
        with torch._dynamo.config.patch(recompile_limit=limit, accumulated_recompile_limit=max(65536, limit)):
            runner = self._measured(bucket, lambda: self._capture_bucket(bucket, dummy))
        self._runners[bucket] = runner
        return runner

    def size_of(self, fb: BucketableBatch) -> int:
        """What a bucket counts: requests (ROWS) or tokens (TOKENS)."""
        return fb.batch_size if self.phase is Phase.ROWS else fb.num_tokens

    def can_run(self, fb: BucketableBatch) -> bool:
        if fb.phase is not self.phase or not self._ready():
            return False
        size = self.size_of(fb)
        bucket = bucket_for(size, self.buckets)
        if bucket is None or bucket - size > self.max_padding * bucket:
            return False
        return self.lazy or bucket in self._runners

    def execute(self, fb: BucketableBatch) -> torch.Tensor:
        size = self.size_of(fb)
        bucket = bucket_for(size, self.buckets)
        runner = self._runners.get(bucket) or self._capture_timed(bucket)
        padded = self._pad(fb, bucket)
        with self.env.forward_scope(padded):
            hidden = runner(padded)
        self.stats.executions += 1
        self.stats.padded_rows += bucket - size
        return hidden[: fb.num_token_non_padded]

    def _pad(self, fb: BucketableBatch, bucket: int) -> BucketableBatch:
        if self.phase is Phase.ROWS:
            return self.buffers.load(fb, bucket, self.env.padding)
        return self.buffers.load_tokens(fb, bucket, self.env.padding)


def _padding_limit(value: Any, option: str) -> float:
    """The largest share of a bucket that may be padding before a batch runs eager instead."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        raise CaptureConfigError(f"{option} must be a fraction in [0, 1], got {value!r}")
    return float(value)
