"""The eager backend: plain module calls, any shape, any mode.  Always available, always correct."""

from __future__ import annotations

import torch

from capture.backend import CaptureBackend


class EagerRunner(CaptureBackend):
    name = "eager"

    def can_run(self, fb) -> bool:
        return True

    def execute(self, fb) -> torch.Tensor:
        self.stats.executions += 1
        with self.env.forward_scope(fb):
            return self.env.model(fb.input_ids, fb.positions)
