"""A tensor-parallel group as the model sees it: this rank, the group size, and the collectives.

The collectives are torch's functional ones (`torch.distributed._functional_collectives`), which
Dynamo traces: under `full_graph` and the piecewise pieces the all-reduce is a node of the
compiled graph (inductor on CPU, captured into the CUDA graph with NCCL on GPU), not a graph break.
With one rank every collective is the identity and no process group exists.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True, eq=False)
class TPGroup:
    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = None  # None iff size == 1

    def __post_init__(self) -> None:
        if (self.group is None) != (self.size == 1) or not 0 <= self.rank < self.size:
            raise ValueError(f"TPGroup(rank={self.rank}, size={self.size}) needs a process group iff size > 1")

    @property
    def is_parallel(self) -> bool:
        return self.size > 1

    @property
    def is_driver(self) -> bool:
        """Rank 0: owns the scheduler, samples, and is the only rank that needs full logits."""
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of x over the ranks (a new tensor; traceable)."""
        if self.group is None:
            return x
        from torch.distributed import _functional_collectives as fc

        return fc.all_reduce(x, "sum", self.group)

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """The ranks' x concatenated along `dim`, in rank order (traceable)."""
        if self.group is None:
            return x
        from torch.distributed import _functional_collectives as fc

        # Waited here: the logits are gathered outside any graph, and a rank that discards them
        # (every rank but 0) would otherwise leave the collective unwaited.
        return fc.wait_tensor(fc.all_gather_single(x.contiguous(), dim % x.dim(), self.group))


SINGLE = TPGroup()
