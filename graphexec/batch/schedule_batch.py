"""The scheduler's plan for one forward: which requests, how many new tokens each, which KV slots.

A plan without side effects: built from the requests' state and the rows and slots the KV cache
manager gave them; building one changes nothing.  Everything here is host-side (Python lists plus
the slot tensor); `ForwardBatch.init_new` turns it into device tensors without mutating it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from graphexec.batch.forward_mode import ForwardMode
from graphexec.batch.request import Req


@dataclass(frozen=True)
class ScheduleBatch:
    forward_mode: ForwardMode
    reqs: tuple[Req, ...]
    input_ids: list[int]
    req_pool_indices: list[int]
    # Tokens whose KV already exists before this forward, per request.
    prefix_lens: list[int]
    # New tokens computed in this forward, per request (all 1 in decode).
    extend_lens: list[int]
    # prefix_lens + extend_lens: the KV length each request has after this forward.
    seq_lens: list[int]
    # Slot each new token's K/V is written to, in input order.
    out_cache_loc: torch.Tensor
    # Per request: does this forward produce its next token?  False for a prompt chunk that
    # does not reach the end of its prompt.
    samples: tuple[bool, ...]

    @property
    def batch_size(self) -> int:
        return len(self.reqs)

    @classmethod
    def extend(
        cls,
        reqs: Sequence[Req],
        extend_lens: Sequence[int],
        rows: Sequence[int],
        out_cache_loc: torch.Tensor,
        mixed: bool = False,
    ) -> "ScheduleBatch":
        """Each request computes its next `extend_lens[i]` tokens after those already computed;
        `mixed` marks decode requests riding along as one-token extends."""
        input_ids: list[int] = []
        prefix_lens = [r.num_computed_tokens for r in reqs]
        for req, prefix, extend in zip(reqs, prefix_lens, extend_lens):
            input_ids.extend(req.all_ids[prefix : prefix + extend])
        seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
        return cls(
            forward_mode=ForwardMode.MIXED if mixed else ForwardMode.EXTEND,
            reqs=tuple(reqs),
            input_ids=input_ids,
            req_pool_indices=list(rows),
            prefix_lens=prefix_lens,
            extend_lens=list(extend_lens),
            seq_lens=seq_lens,
            out_cache_loc=out_cache_loc,
            samples=tuple(s == r.seq_len for s, r in zip(seq_lens, reqs)),
        )

    @classmethod
    def decode(cls, reqs: Sequence[Req], rows: Sequence[int], out_cache_loc: torch.Tensor) -> "ScheduleBatch":
        """One new token per request: the last sampled one, at the old length L; seq_lens becomes L + 1."""
        old_lens = [req.num_computed_tokens for req in reqs]
        return cls(
            forward_mode=ForwardMode.DECODE,
            reqs=tuple(reqs),
            input_ids=[req.output_ids[-1] for req in reqs],
            req_pool_indices=list(rows),
            prefix_lens=old_lens,
            extend_lens=[1] * len(reqs),
            seq_lens=[n + 1 for n in old_lens],
            out_cache_loc=out_cache_loc,
            samples=(True,) * len(reqs),
        )
