"""Breakable capture: the forward cut at annotated break points (attention by default).

On CUDA the design is SGLang's Breakable CUDA Graph: capture proceeds segment by segment, each
break point ends a segment, runs eagerly and writes into a persistent boundary buffer, and replay
interleaves segment graphs with the eager breaks.  (TODO(gpu): the CUDA segment capture is not
written yet; no GPU has been available to run it.  On CUDA this backend currently refuses to
start rather than pretend.)

On CPU there is no graph recorder without a compiler, so the closest honest analogue is: every
segment compiled by inductor (static shapes per token bucket), the break points excluded from
compilation (`capture.break_points.breaking`), so Dynamo ends a segment at each one and runs it
eagerly before resuming in the next compiled segment.  Same cut, same eager breaks; the
boundary "buffers" are the tensors Dynamo hands from one segment to the next.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from capture.backend import CaptureEnv
from capture.break_points import ATTENTION, DEBUG, break_point, breaking
from capture.piecewise import PieceForward, PiecewiseBackend
from graphexec.errors import ConfigError
from graphexec.forward_batch import ForwardBatch


class BreakableBackend(PiecewiseBackend):
    name = "breakable"
    extra_options = frozenset({"breaks"})

    def __init__(self, env: CaptureEnv, options: Mapping[str, Any], config_path: str = "capture.extend"):
        super().__init__(env, options, config_path)
        if env.device.type == "cuda":
            raise ConfigError(
                f"{config_path}.backend=breakable has no CUDA segment capture yet; use eager for extend on CUDA"
            )
        breaks = self.options.get("breaks", [ATTENTION])
        if not breaks or not all(isinstance(b, str) for b in breaks):
            raise ConfigError(f"{config_path}.breaks must be a non-empty list of break-point names, got {breaks}")
        self.breaks = frozenset(breaks)
        self.segments_compiled = 0  # graphs handed to inductor, all buckets together
        # When a list, every compiled graph appends "segment" each time it runs (tests, debugging).
        self.trace: list[str] | None = None

    def _build_forward(self) -> PieceForward:
        from torch._inductor.compile_fx import compile_fx

        def count_and_compile(gm: torch.fx.GraphModule, example_inputs):
            self.segments_compiled += 1
            compiled = compile_fx(gm, example_inputs)

            def run(*args):
                if self.trace is not None:
                    self.trace.append("segment")
                return compiled(*args)

            return run

        model = self.env.model
        if DEBUG in self.breaks:
            # One break around everything: no compiled segment at all, eager through this path.
            model = break_point(DEBUG)(model)

        # Graph breaks make Dynamo mark the frames it had to leave as skipped for every later
        # compile in the process; compiling a frame of our own keeps that mark off the model's
        # forward, which full_graph and tc_piecewise must still trace whole.
        def segmented_forward(input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
            return model(input_ids, positions)

        return torch.compile(segmented_forward, backend=count_and_compile, fullgraph=False, dynamic=False)

    def _run(self, fb: ForwardBatch) -> torch.Tensor:
        with breaking(self.breaks):
            return self._forward(fb.input_ids, fb.positions)
