"""The vocabulary split across tensor-parallel ranks: the embedding lookup and the LM head.

Each rank holds the rows [start, stop) of the embedding (and of the LM head, or reads the tied
embedding's rows).  Embedding: a token outside the rank's rows looks up row 0 and is zeroed, and
the all-reduce sums the one rank that had it.  LM head: each rank's logits for its rows, padded
with -inf to the common shard width, gathered along the vocabulary and cut back to vocab_size.
With one rank both are the plain lookup and projection.
"""

from __future__ import annotations

import torch
from torch import nn

from graphexec.models.tp_layout import TPLayout
from graphexec.parallel.group import TPGroup


def embed(embedding: nn.Module, input_ids: torch.Tensor, layout: TPLayout, tp: TPGroup) -> torch.Tensor:
    if not layout.is_sharded:
        return embedding(input_ids)
    start, stop = layout.vocab
    local = input_ids - start
    mine = (local >= 0) & (local < stop - start)
    rows = embedding(torch.where(mine, local, torch.zeros_like(local)))
    return tp.all_reduce(rows * mine.unsqueeze(-1).to(rows.dtype))


def gather_logits(local: torch.Tensor, layout: TPLayout, tp: TPGroup) -> torch.Tensor:
    """[rows, vocab_rows] of this rank -> [rows, vocab_size] on every rank (fp32)."""
    local = local.float()
    if not layout.is_sharded:
        return local
    pad = layout.vocab_shard - layout.vocab_rows
    if pad:
        local = nn.functional.pad(local, (0, pad), value=float("-inf"))
    return tp.all_gather(local, dim=-1)[:, : layout.config.vocab_size]
