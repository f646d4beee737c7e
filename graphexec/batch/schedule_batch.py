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
class DraftedHistory:
    """A verify row's token history (sampling/penalties.py's TokenHistory): its request's ids
    with the draft tokens before the row counted as outputs."""

    prompt_ids: list[int]
    output_ids: list[int]
    eos_token_ids: tuple[int, ...]


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
    # prefix_lens + extend_lens: the KV length each request has after this forward; in
    # TARGET_VERIFY per row (each row's own length), so the rows' count.
    seq_lens: list[int]
    # Slot each new token's K/V is written to, in input order.
    out_cache_loc: torch.Tensor
    # Per request: does this forward produce its next token?  False for a prompt chunk that
    # does not reach the end of its prompt.
    samples: tuple[bool, ...]
    # TARGET_VERIFY only: per request, the draft tokens it verifies (its rows are its last token
    # then each draft token); None in every other mode.
    drafts: tuple[tuple[int, ...], ...] | None = None

    @property
    def batch_size(self) -> int:
        """Rows of the forward: one per request, except in TARGET_VERIFY (one per token)."""
        return len(self.seq_lens)

    def _rows(self) -> list[tuple[Req, tuple[int, ...]]]:
        """Per row: its request and the draft tokens before it (() outside TARGET_VERIFY)."""
        if self.drafts is None:
            return [(req, ()) for req in self.reqs]
        return [(req, draft[:i]) for req, draft in zip(self.reqs, self.drafts) for i in range(len(draft) + 1)]

    def row_owners(self) -> list[Req]:
        """The request of each row (each sampled row of TARGET_VERIFY samples for its request)."""
        return [req for req, _ in self._rows()]

    def row_samples(self) -> tuple[bool, ...]:
        """Per row, whether it samples: `samples`, except in TARGET_VERIFY (every row samples)."""
        return self.samples if self.drafts is None else (True,) * self.batch_size

    def row_histories(self) -> list[Req | DraftedHistory]:
        """Per row, the token history its penalties and min_tokens see: the request's, and in
        TARGET_VERIFY row i the request's with its first i draft tokens as outputs."""
        return [
            DraftedHistory(req.prompt_ids, req.output_ids + list(before), req.eos_token_ids)
            if before and req.params.processes_logits  # (a copy of the outputs: only where it is read)
            else req
            for req, before in self._rows()
        ]

    def row_grammars(self) -> list:
        """Per row, the grammar its token must fit (None: free); in TARGET_VERIFY row i the
        request's grammar as it stands after the first i draft tokens."""
        return [
            req.grammar.after(before) if before and req.grammar is not None else req.grammar
            for req, before in self._rows()
        ]

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

    @classmethod
    def verify(
        cls, reqs: Sequence[Req], drafts: Sequence[Sequence[int]], rows: Sequence[int], out_cache_loc: torch.Tensor
    ) -> "ScheduleBatch":
        """Each request's last sampled token (at its old length L) and its drafts (at L + 1, ...),
        one decode row per token: row i of a request has length L + i + 1, so it attends to the
        cached KV and the rows before it.  A request with no draft is a plain decode row."""
        input_ids: list[int] = []
        row_ids: list[int] = []
        seq_lens: list[int] = []
        for req, draft, row in zip(reqs, drafts, rows):
            old = req.num_computed_tokens
            input_ids += [req.output_ids[-1], *draft]
            row_ids += [row] * (len(draft) + 1)
            seq_lens += range(old + 1, old + len(draft) + 2)
        return cls(
            forward_mode=ForwardMode.TARGET_VERIFY,
            reqs=tuple(reqs),
            input_ids=input_ids,
            req_pool_indices=row_ids,
            prefix_lens=[req.num_computed_tokens for req in reqs],
            extend_lens=[len(d) + 1 for d in drafts],
            seq_lens=seq_lens,
            out_cache_loc=out_cache_loc,
            samples=(True,) * len(reqs),
            drafts=tuple(tuple(d) for d in drafts),
        )
