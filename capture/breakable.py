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
from capture.break_points import DEBUG, break_point, breaking
from capture.options import BreakableOptions
from capture.own_frame import own_forward
from capture.piecewise import PieceForward, PiecewiseBackend


class BreakableBackend(PiecewiseBackend):
    name = "breakable"
    options: BreakableOptions
    options_type = BreakableOptions

    def __init__(self, env: CaptureEnv, options: BreakableOptions | Mapping[str, Any], config_path: str = "capture.extend"):
        super().__init__(env, options, config_path)
        # When a list, every compiled graph appends "segment" each time it runs (tests, debugging).
        self.trace: list[str] | None = None

    def _build_forward(self) -> PieceForward:
        model = self.env.model
        if DEBUG in self.options.breaks:
            # One break around everything: no compiled or recorded work, eager through this path.
            model = break_point(DEBUG)(model)
        if self.recorder is not None:
            return model  # recorded as it runs: the graphs between breaks need no compiler
        return self._compiled_segments(model)

    def _compiled_segments(self, model: PieceForward) -> PieceForward:
        from torch._inductor.compile_fx import compile_fx

        def count_and_compile(gm: torch.fx.GraphModule, example_inputs):
            self.stats.compiles += 1
            compiled = compile_fx(gm, example_inputs)

            def run(*args):
                if self.trace is not None:
                    self.trace.append("segment")
                return compiled(*args)

            return run

        return torch.compile(own_forward(model), backend=count_and_compile, fullgraph=False, dynamic=False)

    def _run_pieces(self, fb: BucketableBatch) -> torch.Tensor:
        with breaking(self.options.breaks):
            return self._forward(fb.input_ids, fb.positions)
