"""What the two piecewise prefill backends share: token-count buckets, padding, capture loop.

EXTEND and MIXED batches are padded up to the smallest token bucket that holds them (padded
tokens: input id 0, position 0, the dummy KV slot; the per-request layout stays the real one, so
attention never reads them and zeroes their output rows), run through that bucket's pieces, and
sliced back to the real tokens.  A batch above the largest bucket, or one that would be more
than `max_padding` padding, runs eager, counted.
Subclasses only say how the forward is cut into pieces (`_build_forward`).
"""

from __future__ import annotations

from abc import abstractmethod
from typing import Any, Callable, Mapping

import torch

from capture.backend import CaptureBackend, CaptureEnv
from capture.buckets import bucket_for, validate_buckets
from capture.padding import StaticInputs
from graphexec.errors import ConfigError
from graphexec.forward_batch import ForwardBatch
from graphexec.forward_mode import ForwardMode

PieceForward = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
_COMMON_OPTIONS = {"buckets", "progress", "lazy", "max_padding"}


class PiecewiseBackend(CaptureBackend):
    extra_options: frozenset[str] = frozenset()

    def __init__(self, env: CaptureEnv, options: Mapping[str, Any], config_path: str = "capture.extend"):
        super().__init__(env, options, config_path)
        known = _COMMON_OPTIONS | self.extra_options
        unknown = sorted(set(self.options) - known)
        if unknown:
            raise ConfigError(f"{config_path}.{unknown[0]} is not a {self.name} option; known: {sorted(known)}")
        self.buckets = validate_buckets(self.options.get("buckets"), f"{config_path}.buckets")
        self.lazy = bool(self.options.get("lazy", False))
        self.max_padding = _padding_limit(self.options.get("max_padding", 1.0), f"{config_path}.max_padding")
        self.buffers = StaticInputs(self.buckets[-1], env.device)
        self._captured: set[int] = set()
        self._forward: PieceForward | None = None

    @abstractmethod
    def _build_forward(self) -> PieceForward:
        """The cut-up forward: (input_ids, positions) -> hidden, pieces compiled, breaks eager."""

    def _run(self, fb: ForwardBatch) -> torch.Tensor:
        """Run the pieced forward on a padded batch (subclasses wrap it in their break scope)."""
        return self._forward(fb.input_ids, fb.positions)

    def capture(self) -> None:
        self._forward = self._build_forward()
        if not self.lazy:
            self._capture_each(self.buckets, self.name, self._capture_timed)

    def _capture_timed(self, bucket: int) -> None:
        dummy = self.buffers.dummy_batch(bucket, self.env.padding, ForwardMode.EXTEND)

        def run_dummy() -> None:
            with self.env.forward_scope(dummy):
                self._run(dummy)

        # Every segment of every layer is a legitimate compile of shared code: lift the limit.
        with torch._dynamo.config.patch(recompile_limit=4096, accumulated_recompile_limit=65536):
            self._measured(bucket, run_dummy)
        self._captured.add(bucket)

    def can_run(self, fb: ForwardBatch) -> bool:
        if not fb.forward_mode.is_extend() or self._forward is None:
            return False
        bucket = bucket_for(fb.num_tokens, self.buckets)
        if bucket is None or (bucket - fb.num_tokens) > self.max_padding * bucket:
            return False
        return self.lazy or bucket in self._captured

    def execute(self, fb: ForwardBatch) -> torch.Tensor:
        bucket = bucket_for(fb.num_tokens, self.buckets)
        if bucket not in self._captured:
            self._capture_timed(bucket)
        padded = self.buffers.load_tokens(fb, bucket, self.env.padding)
        with self.env.forward_scope(padded):
            hidden = self._run(padded)
        self.stats.executions += 1
        self.stats.padded_rows += bucket - fb.num_tokens
        return hidden[: fb.num_token_non_padded]


def _padding_limit(value: Any, option: str) -> float:
    """The largest share of a bucket that may be padding before a batch runs eager instead.

    Prefill compute grows with the padded token count, so on a CPU, where a captured prefill is
    only a few percent faster than eager, padding 300 tokens up to 1024 costs far more than the
    graph saves; the ModelRunner counts such a batch as a fallback.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        raise ConfigError(f"{option} must be a fraction in [0, 1], got {value!r}")
    return float(value)
