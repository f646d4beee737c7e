"""Hidden rows → next-token logits, pruned to the rows that sample before the LM head runs.

In extend only each request's last new token samples (9 input rows → 2 logits rows in seed 001's
example), so the vocab-sized matmul runs on batch_size rows, never on num_tokens rows.
"""

from __future__ import annotations

from typing import Callable

import torch

from graphexec.batch.forward_batch import ForwardBatch


class LogitsProcessor:
    def __init__(self, compute_logits: Callable[[torch.Tensor], torch.Tensor]):
        self.compute_logits = compute_logits

    def __call__(self, hidden: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        # `hidden` holds real rows only: capture backends slice their padding off (capture/bucketed.py).
        return self.compute_logits(hidden[fb.sample_row_indices()])
