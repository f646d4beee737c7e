"""What the two piecewise prefill backends share: token-count buckets, padding, capture loop.

EXTEND and MIXED batches are padded up to the smallest token bucket that holds them (padded
tokens: input id 0, position 0, the dummy KV slot; the per-request layout stays the real one, so
attention never reads them and zeroes their output rows), run through that bucket's pieces, and
sliced back to the real tokens.  A batch above the largest bucket, or one that would be more
than `max_padding` padding, runs eager, counted.

What runs a bucket is chosen by the `graph` option:
  compile     the pieces are compiled code, called directly (the CPU default);
  cuda_graph  each bucket's forward is recorded once as CUDA graphs between the breaks
              (capture/segments.py), all buckets in one memory pool, and replayed (CUDA default);
  tape        the same recording with capture/op_tape.py: the CUDA path's logic, on any device.
Subclasses only say how the forward is cut into pieces (`_build_forward`, `_run_pieces`).
"""

from __future__ import annotations

from abc import abstractmethod
from typing import Any, Callable, Mapping

import torch

from capture.backend import CaptureBackend, CaptureEnv
from capture.buckets import bucket_for, validate_buckets
from capture.padding import StaticInputs
from capture.recorders import create_recorder
from capture.segments import GraphRecorder, SegmentedGraph, record_segments
from capture.errors import CaptureConfigError
from capture.batch import BucketableBatch, Phase

PieceForward = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
_COMMON_OPTIONS = {"buckets", "progress", "lazy", "max_padding", "graph"}
GRAPH_KINDS = ("auto", "compile", "cuda_graph", "tape")


class PiecewiseBackend(CaptureBackend):
    extra_options: frozenset[str] = frozenset()
    # How a recording finds its graphs (capture.segments.record_segments): between the breaks, or
    # around the pieces the forward hands over itself.
    implicit_segments = True

    def __init__(self, env: CaptureEnv, options: Mapping[str, Any], config_path: str = "capture.extend"):
        super().__init__(env, options, config_path)
        known = _COMMON_OPTIONS | self.extra_options
        unknown = sorted(set(self.options) - known)
        if unknown:
            raise CaptureConfigError(f"{config_path}.{unknown[0]} is not a {self.name} option; known: {sorted(known)}")
        self.buckets = validate_buckets(self.options.get("buckets"), f"{config_path}.buckets")
        self.lazy = bool(self.options.get("lazy", False))
        self.max_padding = _padding_limit(self.options.get("max_padding", 1.0), f"{config_path}.max_padding")
        self.graph_kind = _resolve_graph_kind(self.options.get("graph", "auto"), env.device, f"{config_path}.graph")
        # None: the compiled pieces are called directly.  Shared by every bucket (one CUDA pool).
        self.recorder: GraphRecorder | None = None
        if self.graph_kind != "compile":
            self.recorder = create_recorder(self.graph_kind, env.device, f"{config_path}.graph")
        self.buffers = StaticInputs(self.buckets[-1], env.device)
        self._captured: set[int] = set()
        self._recorded: dict[int, SegmentedGraph] = {}
        self._forward: PieceForward | None = None

    @abstractmethod
    def _build_forward(self) -> PieceForward:
        """The cut-up forward: (input_ids, positions) -> hidden, pieces compiled, breaks eager."""

    def _run_pieces(self, fb: BucketableBatch) -> torch.Tensor:
        """Run the pieced forward on a padded batch (subclasses wrap it in their break scope)."""
        return self._forward(fb.input_ids, fb.positions)

    def segments_of(self, bucket: int) -> SegmentedGraph | None:
        """The recorded graphs and breaks of a bucket (None unless `graph` records)."""
        return self._recorded.get(bucket)

    def capture(self) -> None:
        self._forward = self._build_forward()
        if not self.lazy:
            self._capture_each(self.buckets, self.name, self._capture_timed)

    def _capture_timed(self, bucket: int) -> None:
        dummy = self.buffers.dummy_batch(bucket, self.env.padding, Phase.TOKENS, self.env.empty_batch(Phase.TOKENS))

        def run_dummy() -> None:
            with self.env.forward_scope(dummy):
                # Compiles this bucket's pieces; before a recording, also the warm-up that keeps
                # lazy initialisation (kernels, handles, allocator growth) out of the graphs.
                self._run_pieces(dummy)
                if self.recorder is not None:
                    self._recorded[bucket] = record_segments(
                        self.recorder, lambda: self._run_pieces(dummy), implicit=self.implicit_segments
                    )

        # Every segment of every layer is a legitimate compile of shared code: lift the limit.
        with torch._dynamo.config.patch(recompile_limit=4096, accumulated_recompile_limit=65536):
            self._measured(bucket, run_dummy)
        self._captured.add(bucket)

    def can_run(self, fb: BucketableBatch) -> bool:
        if not fb.forward_mode.is_extend() or self._forward is None:
            return False
        bucket = bucket_for(fb.num_tokens, self.buckets)
        if bucket is None or (bucket - fb.num_tokens) > self.max_padding * bucket:
            return False
        return self.lazy or bucket in self._captured

    def execute(self, fb: BucketableBatch) -> torch.Tensor:
        bucket = bucket_for(fb.num_tokens, self.buckets)
        if bucket not in self._captured:
            self._capture_timed(bucket)
        padded = self.buffers.load_tokens(fb, bucket, self.env.padding)
        with self.env.forward_scope(padded):
            recorded = self._recorded.get(bucket)
            hidden = self._run_pieces(padded) if recorded is None else recorded.replay()
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
        raise CaptureConfigError(f"{option} must be a fraction in [0, 1], got {value!r}")
    return float(value)


def _resolve_graph_kind(kind: Any, device: torch.device, option: str) -> str:
    if kind not in GRAPH_KINDS:
        raise CaptureConfigError(f"{option}={kind!r} is unknown; choose one of {list(GRAPH_KINDS)}")
    if kind == "auto":
        return "cuda_graph" if device.type == "cuda" else "compile"
    return kind
