"""Logits processing before sampling: logit_bias, min_tokens, and the three repetition penalties.

Boundary: `LogitsPenalties.build` turns each sampling row's params and token history into a few
compact tensors once per batch (host work proportional to the histories of the rows that use a
penalty), and `apply` runs them on the whole [B, V] logits as three batched sparse updates: no
loop over rows, tokens or the vocabulary.  It knows nothing of requests or the scheduler: a row's
history is anything with `prompt_ids`, `output_ids` and `eos_token_ids` (the scheduler's `Req` is
one).

Semantics and order follow vLLM (see `SamplingParams`): bias and min_tokens bans, then the
repetition penalty over prompt and output tokens, then frequency and presence over output tokens.
"""

from __future__ import annotations

import array
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from graphexec.sampling_params import SamplingParams


class TokenHistory(Protocol):
    """What a row's logits processing reads of its request."""

    @property
    def prompt_ids(self) -> Sequence[int]: ...

    @property
    def output_ids(self) -> Sequence[int]: ...

    @property
    def eos_token_ids(self) -> Sequence[int]: ...


@dataclass(frozen=True, eq=False)
class _Additions:
    """Values to add at flat positions row * V + token id of the [B, V] logits; a position may
    repeat, and then its values add up (that is how frequency counts occurrences)."""

    index: Tensor  # [N] int64
    values: Tensor  # [N] float32

    @classmethod
    def build(cls, index: Tensor, values: Tensor, device: torch.device | str) -> _Additions | None:
        """From host tensors; None when there is nothing to add."""
        if index.numel() == 0:
            return None
        return cls(index.to(device, non_blocking=True), values.to(device, non_blocking=True))

    def add_to(self, flat_logits: Tensor) -> None:
        flat_logits.index_add_(0, self.index, self.values)


# eq=False: tensors don't support the element-wise == a generated __eq__ would call.
@dataclass(frozen=True, eq=False)
class LogitsPenalties:
    """One batch's logits processing, as three sparse batched updates of a copy of the logits.

    Every penalty touches only tokens a row has seen, so the work is proportional to the rows'
    histories, not to B * V: no [B, V] temporary is built besides the copy that keeps the raw
    logits intact for logprobs.  (A first version built dense [B, V] counts and masks: five
    full-size passes per step, each as slow as the copy.)  Rows without options get no entries,
    so their logits stay bit-for-bit as they were.
    """

    vocab_size: int
    before: _Additions | None  # logit_bias, and -inf for what min_tokens bans
    repetition_index: Tensor | None  # [M] flat positions seen in prompt or output (may repeat)
    repetition_factor: Tensor | None  # [M] that row's repetition_penalty
    after: _Additions | None  # -frequency per output occurrence, -presence per distinct output token

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        histories: Sequence[TokenHistory | None] | None,
        vocab_size: int,
        device: torch.device | str,
    ) -> LogitsPenalties | None:
        """None when no row processes its logits: the sampler's fast path, which copies nothing
        and builds no tensor.  `histories` may be None (or hold None) only for rows that need no
        history (logit_bias alone)."""
        if not any(p.processes_logits for p in params):
            return None

        def history(row: int) -> TokenHistory:
            found = None if histories is None else histories[row]
            if found is None:
                raise ValueError(f"sampling row {row} uses penalties or min_tokens but has no token history")
            return found

        before = _Additions.build(*_bias_and_bans(params, history, vocab_size), device)
        after, seen = _history_updates(params, history, vocab_size)
        if before is None and after is None and seen.numel() == 0:
            return None  # e.g. only min_tokens, and every such row has reached it
        factor = _column(params, "repetition_penalty")[_row_of(seen, vocab_size)]
        return cls(
            vocab_size=vocab_size,
            before=before,
            after=_Additions.build(*after, device) if after is not None else None,
            repetition_index=seen.to(device, non_blocking=True) if seen.numel() else None,
            repetition_factor=factor.to(device, non_blocking=True) if seen.numel() else None,
        )

    def apply(self, logits: Tensor) -> Tensor:
        """Processed float32 logits [B, V], a new tensor: the caller's logits stay raw."""
        if logits.shape[-1] != self.vocab_size:
            raise ValueError(f"logits have {logits.shape[-1]} columns, penalties were built for {self.vocab_size}")
        processed = torch.empty(logits.shape, dtype=torch.float32, device=logits.device).copy_(logits)
        flat = processed.view(-1)
        if self.before is not None:
            self.before.add_to(flat)
        if self.repetition_index is not None:
            seen = flat[self.repetition_index]
            # HF/vLLM convention: shrink a positive logit, grow a negative one: both less likely.
            flat[self.repetition_index] = torch.where(
                seen > 0, seen / self.repetition_factor, seen * self.repetition_factor
            )
        if self.after is not None:
            self.after.add_to(flat)
        return processed


def _needs_history(params: SamplingParams) -> bool:
    return bool(params.presence_penalty or params.frequency_penalty or params.repetition_penalty != 1.0)


def _column(params: Sequence[SamplingParams], name: str) -> Tensor:
    return torch.tensor([getattr(p, name) for p in params], dtype=torch.float32)


def _history_updates(params, history, vocab_size: int) -> tuple[tuple[Tensor, Tensor] | None, Tensor]:
    """What frequency and presence subtract (flat positions, values; None if nothing), and the
    flat positions the repetition penalty rescales.  Each output history becomes a tensor once;
    every penalty then selects the rows that use it."""
    frequency, presence, repetition = (
        _column(params, name) for name in ("frequency_penalty", "presence_penalty", "repetition_penalty")
    )
    outputs = _flat_index(
        [history(r).output_ids if _needs_history(p) else () for r, p in enumerate(params)], vocab_size
    )
    rows = _row_of(outputs, vocab_size)
    counted = frequency[rows] != 0
    # Presence counts a token once: deduplicated per row on the host (a set of one request's
    # outputs is far cheaper than torch.unique's sort of the whole batch's).
    distinct = _flat_index(
        [set(history(r).output_ids) if p.presence_penalty else () for r, p in enumerate(params)], vocab_size
    )
    index = torch.cat([outputs[counted], distinct])
    values = -torch.cat([frequency[rows[counted]], presence[_row_of(distinct, vocab_size)]])
    prompts = _flat_index(
        [history(r).prompt_ids if p.repetition_penalty != 1.0 else () for r, p in enumerate(params)], vocab_size
    )
    # Repeats are harmless here: every copy of a position reads the same logit before any write.
    seen = torch.cat([prompts, outputs[repetition[rows] != 1.0]])
    return ((index, values) if index.numel() else None), seen


def _row_of(flat_index: Tensor, vocab_size: int) -> Tensor:
    return torch.div(flat_index, vocab_size, rounding_mode="floor")


def _flat_index(per_row: Sequence[Iterable[int]], vocab_size: int) -> Tensor:
    """Host int64 tensor of row * vocab_size + token id for every token of every row, in order."""
    ids, counts = array.array("q"), array.array("q")
    for tokens in per_row:
        start = len(ids)
        ids.extend(tokens)
        counts.append(len(ids) - start)
    if not ids:
        return torch.zeros(0, dtype=torch.int64)
    # array -> frombuffer is ~4x faster than torch.tensor(list) for a history of Python ints.
    rows = torch.repeat_interleave(torch.arange(len(counts)), torch.frombuffer(counts, dtype=torch.int64))
    return rows * vocab_size + torch.frombuffer(ids, dtype=torch.int64)


def _bias_and_bans(params, history, vocab_size: int) -> tuple[Tensor, Tensor]:
    """Flat positions and values to add first: each logit_bias entry, and -inf for each id that
    min_tokens bans while the row has fewer outputs than min_tokens."""
    per_row: list[list[int]] = []
    values: list[float] = []
    for row, p in enumerate(params):
        ids = []
        for token_id, bias in p.logit_bias:
            if token_id >= vocab_size:
                # The engine refuses these at submission; a direct caller gets the same message.
                raise ValueError(f"logit_bias token id {token_id} is outside the vocabulary [0, {vocab_size})")
            ids.append(token_id)
            values.append(bias)
        if p.min_tokens and len(history(row).output_ids) < p.min_tokens:
            banned = set(p.stop_token_ids)
            if not p.ignore_eos:
                banned.update(history(row).eos_token_ids)
            # An id past the vocabulary can never be sampled, so there is nothing to ban.
            in_vocab = sorted(t for t in banned if t < vocab_size)
            ids.extend(in_vocab)
            values.extend([-math.inf] * len(in_vocab))
        per_row.append(ids)
    return _flat_index(per_row, vocab_size), torch.tensor(values, dtype=torch.float32)
