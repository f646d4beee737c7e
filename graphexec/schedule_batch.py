"""The scheduler's plan for one forward: which requests, how many new tokens each, which KV slots.

Everything here is host-side (Python lists plus the slot tensor); `ForwardBatch.init_new` turns it
into device tensors without mutating it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from graphexec.forward_mode import ForwardMode
from graphexec.kv_pool import TokenToKVPool
from graphexec.req_to_token_pool import ReqToTokenPool
from graphexec.request import Req


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
    def prepare_for_extend(
        cls,
        reqs: list[Req],
        req_pool: ReqToTokenPool,
        kv_pool: TokenToKVPool,
        extend_lens: list[int] | None = None,
        mixed: bool = False,
    ) -> "ScheduleBatch":
        """Give each request a table row (first time only) and slots for its next `extend_lens`
        uncached tokens (default: all of them).  `mixed` marks decode requests riding along as
        one-token extends."""
        if extend_lens is None:
            extend_lens = [r.seq_len - r.num_cached_tokens for r in reqs]
        input_ids: list[int] = []
        prefix_lens, rows = [], []
        new_slots = kv_pool.alloc(sum(extend_lens))
        offset = 0
        for req, extend in zip(reqs, extend_lens):
            if req.req_pool_idx is None:
                req.req_pool_idx = req_pool.alloc()
            prefix = req.num_cached_tokens
            req_pool.write(req.req_pool_idx, prefix, new_slots[offset : offset + extend])
            req.num_allocated_tokens = prefix + extend
            offset += extend
            input_ids.extend(req.all_ids[prefix : prefix + extend])
            prefix_lens.append(prefix)
            rows.append(req.req_pool_idx)
        seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
        return cls(
            forward_mode=ForwardMode.MIXED if mixed else ForwardMode.EXTEND,
            reqs=tuple(reqs),
            input_ids=input_ids,
            req_pool_indices=rows,
            prefix_lens=prefix_lens,
            extend_lens=list(extend_lens),
            seq_lens=seq_lens,
            out_cache_loc=new_slots,
            samples=tuple(s == r.seq_len for s, r in zip(seq_lens, reqs)),
        )

    @classmethod
    def prepare_for_decode(
        cls, reqs: list[Req], req_pool: ReqToTokenPool, kv_pool: TokenToKVPool
    ) -> "ScheduleBatch":
        """One new token per request: its slot goes at the old length L, then seq_lens becomes L + 1."""
        new_slots = kv_pool.alloc(len(reqs))
        old_lens = [req.num_cached_tokens for req in reqs]
        for req, old_len, slot in zip(reqs, old_lens, new_slots):
            req_pool.write(req.req_pool_idx, old_len, slot.view(1))
            req.num_allocated_tokens = old_len + 1
        return cls(
            forward_mode=ForwardMode.DECODE,
            reqs=tuple(reqs),
            input_ids=[req.output_ids[-1] for req in reqs],
            req_pool_indices=[req.req_pool_idx for req in reqs],
            prefix_lens=old_lens,
            extend_lens=[1] * len(reqs),
            seq_lens=[n + 1 for n in old_lens],
            out_cache_loc=new_slots,
            samples=(True,) * len(reqs),
        )
