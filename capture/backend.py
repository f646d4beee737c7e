"""The one interface every capture backend implements, and the counters it keeps."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping

import torch

if TYPE_CHECKING:
    from graphexec.forward_batch import ForwardBatch

# (input_ids, positions) -> final hidden rows.  Attention metadata reaches the model through the
# forward context, so this is the whole signature a graph needs to capture.
ModelCallable = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class BackendStats:
    """What a backend did, for benchmarks and /metrics."""

    capture_seconds: dict[int, float] = field(default_factory=dict)  # per bucket
    capture_bytes: dict[int, int] = field(default_factory=dict)  # per bucket
    executions: int = 0  # forwards run (replays for graph backends)
    fallbacks: int = 0  # forwards handed to eager because this backend could not run them
    padded_rows: int = 0  # rows added to reach a bucket, summed over executions


class CaptureBackend(ABC):
    """`capture()` once at start-up, then `can_run(fb)` / `execute(fb)` per forward."""

    name: str = ""

    def __init__(self, model: ModelCallable, device: torch.device, options: Mapping[str, Any]):
        self.model = model
        self.device = device
        self.options = dict(options)
        self.stats = BackendStats()

    def capture(self) -> None:
        """Build graphs ahead of serving.  Backends with nothing to capture keep this no-op."""

    @abstractmethod
    def can_run(self, fb: "ForwardBatch") -> bool: ...

    @abstractmethod
    def execute(self, fb: "ForwardBatch") -> torch.Tensor:
        """Hidden rows for fb's tokens: exactly fb.num_token_non_padded rows of real output first."""
