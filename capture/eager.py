"""The eager backend: plain module calls, any shape, any mode.  Always available, always correct."""

from __future__ import annotations

import torch

from capture.backend import CaptureBackend, PreparedForward
from capture.options import EagerOptions


class EagerRunner(CaptureBackend):
    name = "eager"
    options_type = EagerOptions

    def can_run(self, fb) -> bool:
        return True

    def prepare(self, fb) -> PreparedForward:
        def run() -> torch.Tensor:
            self.stats.executions += 1
            return self.env.model(fb.input_ids, fb.positions)

        return PreparedForward(fb, run)
