"""What the two piecewise prefill backends share: the bucketed core (capture/bucketed.py) in the
TOKENS phase, with the forward cut into pieces.

EXTEND and MIXED batches are padded up to the smallest token bucket that holds them (padded
tokens take the caller's fill values; the per-request layout stays the real one, so attention
never reads them), run through that bucket's pieces, and sliced back to the real tokens.  A
batch above the largest bucket, or one that would be more than `max_padding` padding (default
0.05), runs eager, counted.

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

from capture.backend import CaptureEnv
from capture.batch import BucketableBatch, Phase
from capture.bucketed import BucketedBackend, BucketRunner
from capture.errors import CaptureConfigError
from capture.recorders import create_recorder
from capture.segments import GraphRecorder, SegmentedGraph, record_segments

PieceForward = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
GRAPH_KINDS = ("auto", "compile", "cuda_graph", "tape")


class PiecewiseBackend(BucketedBackend):
    """The TOKENS phase with the forward cut into pieces; subclasses say how it is cut."""

    phase = Phase.TOKENS
    extra_options: frozenset[str] = frozenset({"graph"})
    # How a recording finds its graphs (capture.segments.record_segments): between the breaks, or
    # around the pieces the forward hands over itself.
    implicit_segments = True

    def __init__(self, env: CaptureEnv, options: Mapping[str, Any], config_path: str = "capture.extend"):
        super().__init__(env, options, config_path)
        self.graph_kind = _resolve_graph_kind(self.options.get("graph", "auto"), env.device, f"{config_path}.graph")
        # None: the compiled pieces are called directly.  Shared by every bucket (one CUDA pool).
        self.recorder: GraphRecorder | None = None
        if self.graph_kind != "compile":
            self.recorder = create_recorder(self.graph_kind, env.device, f"{config_path}.graph")
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

    def _before_capture(self) -> None:
        self._forward = self._build_forward()

    def _ready(self) -> bool:
        return self._forward is not None

    def _capture_bucket(self, bucket: int, dummy: BucketableBatch) -> BucketRunner:
        with self.env.forward_scope(dummy):
            # Compiles this bucket's pieces; before a recording, also the warm-up that keeps lazy
            # initialisation (kernels, handles, allocator growth) out of the graphs.
            self._run_pieces(dummy)
            if self.recorder is None:
                return self._run_pieces
            recorded = record_segments(self.recorder, lambda: self._run_pieces(dummy), implicit=self.implicit_segments)
        self._recorded[bucket] = recorded
        return lambda fb: recorded.replay()


def _resolve_graph_kind(kind: Any, device: torch.device, option: str) -> str:
    if kind not in GRAPH_KINDS:
        raise CaptureConfigError(f"{option}={kind!r} is unknown; choose one of {list(GRAPH_KINDS)}")
    if kind == "auto":
        return "cuda_graph" if device.type == "cuda" else "compile"
    return kind
