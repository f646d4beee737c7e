"""What the two piecewise prefill backends share: the bucketed core (capture/bucketed.py) in the
TOKENS phase, with the forward cut into pieces.

EXTEND and MIXED batches are padded up to the smallest token bucket that holds them (padded
tokens take the caller's fill values; the per-request layout stays the real one, so attention
never reads them), run through that bucket's pieces, and sliced back to the real tokens.  A
batch above the largest bucket, or one that would be more than `max_padding` padding (default
0.05), runs eager, counted.

The `graph` option picks the mechanism (capture/bucketed.py): `compile` calls the compiled
pieces directly (the CPU default); `cuda_graph` records each bucket's forward once as CUDA graphs
between the breaks, in the engine's one pool, and replays them (the CUDA default); `tape` is that
recording on any device; `eager` runs the plain model on the padded batch (debug).
Subclasses only say how the forward is cut into pieces (`_build_forward`, `_run_pieces`).
"""

from __future__ import annotations

from abc import abstractmethod
from typing import Any, Callable, Mapping

import torch

from capture.backend import CaptureEnv
from capture.batch import BucketableBatch, Phase
from capture.bucketed import BucketedBackend, BucketRunner
from capture.options import PiecewiseOptions

PieceForward = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class PiecewiseBackend(BucketedBackend):
    """The TOKENS phase with the forward cut into pieces; subclasses say how it is cut."""

    phase = Phase.TOKENS
    options_type = PiecewiseOptions

    def __init__(self, env: CaptureEnv, options: PiecewiseOptions | Mapping[str, Any], config_path: str = "capture.extend"):
        super().__init__(env, options, config_path)
        self._forward: PieceForward | None = None

    @abstractmethod
    def _build_forward(self) -> PieceForward:
        """The cut-up forward: (input_ids, positions) -> hidden, pieces compiled, breaks eager."""

    def _run_pieces(self, fb: BucketableBatch) -> torch.Tensor:
        """Run the pieced forward on a padded batch (subclasses wrap it in their break scope)."""
        return self._forward(fb.input_ids, fb.positions)

    def _before_capture(self) -> None:
        self._forward = self._build_forward()

    def _bucket_forward(self, bucket: int) -> BucketRunner:
        return self._run_pieces
