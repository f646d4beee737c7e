"""Breakable capture: the forward cut at annotated break points (attention by default).

On CUDA (`graph: cuda_graph`, the default there) this is SGLang's Breakable CUDA Graph, with no
compiler involved: capture runs the plain forward segment by segment; each break point ends the
segment's CUDA graph, runs eagerly, leaves its output as the boundary buffer the next segment is
recorded against, and opens the next graph in the same memory pool (capture/segments.py).
Replay interleaves the segment graphs with the eager breaks.  `graph: tape` runs exactly that
path with the device-independent op tape instead of CUDA graphs (tests, debugging).

On CPU there is no graph recorder that buys speed, so the default (`graph: compile`) is the
closest honest analogue: every segment compiled by inductor (static shapes per token bucket),
the break points excluded from compilation (`capture.break_points.breaking`), so Dynamo ends a
segment at each one and runs it eagerly before resuming in the next compiled segment.  Same cut,
same eager breaks; the boundary "buffers" are the tensors Dynamo hands from one segment to the
next.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from capture.backend import CaptureEnv
from capture.batch import BucketableBatch
from capture.break_points import ATTENTION, DEBUG, break_point, breaking
from capture.errors import CaptureConfigError
from capture.piecewise import PieceForward, PiecewiseBackend


class BreakableBackend(PiecewiseBackend):
    name = "breakable"
    extra_options = PiecewiseBackend.extra_options | {"breaks"}

    def __init__(self, env: CaptureEnv, options: Mapping[str, Any], config_path: str = "capture.extend"):
        super().__init__(env, options, config_path)
        breaks = self.options.get("breaks", [ATTENTION])
        if not breaks or not all(isinstance(b, str) for b in breaks):
            raise CaptureConfigError(f"{config_path}.breaks must be a non-empty list of break-point names, got {breaks}")
        self.breaks = frozenset(breaks)
        self.segments_compiled = 0  # graphs handed to inductor, all buckets together
        # When a list, every compiled graph appends "segment" each time it runs (tests, debugging).
        self.trace: list[str] | None = None

    def _build_forward(self) -> PieceForward:
        model = self.env.model
        if DEBUG in self.breaks:
            # One break around everything: no compiled or recorded work, eager through this path.
            model = break_point(DEBUG)(model)
        if self.recorder is not None:
            return model  # recorded as it runs: the graphs between breaks need no compiler
        return self._compiled_segments(model)

    def _compiled_segments(self, model: PieceForward) -> PieceForward:
        from torch._inductor.compile_fx import compile_fx

        def count_and_compile(gm: torch.fx.GraphModule, example_inputs):
            self.segments_compiled += 1
            compiled = compile_fx(gm, example_inputs)

            def run(*args):
                if self.trace is not None:
                    self.trace.append("segment")
                return compiled(*args)

            return run

        # Graph breaks make Dynamo mark the frames it had to leave as skipped for every later
        # compile in the process; compiling a frame of our own keeps that mark off the model's
        # forward, which full_graph and tc_piecewise must still trace whole.
        def segmented_forward(input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
            return model(input_ids, positions)

        return torch.compile(segmented_forward, backend=count_and_compile, fullgraph=False, dynamic=False)

    def _run_pieces(self, fb: BucketableBatch) -> torch.Tensor:
        with breaking(self.breaks):
            return self._forward(fb.input_ids, fb.positions)
