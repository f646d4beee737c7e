"""Logits processing before sampling: logit_bias, min_tokens, and the three repetition penalties.

Boundary: `LogitsPenalties.build` turns each sampling row's params and token history into a few
compact tensors once per batch (host work proportional to the histories of the rows that use a
penalty), and `apply` runs them on the whole [B, V] logits with batched tensor ops: no loop over
rows, tokens or the vocabulary.  It knows nothing of requests or the scheduler: a row's history is
anything with `prompt_ids`, `output_ids` and `eos_token_ids` (the scheduler's `Req` is one).

Semantics and order follow vLLM (see `SamplingParams`): bias and min_tokens bans, then the
repetition penalty over prompt and output tokens, then frequency and presence over output tokens.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
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


def _needs_history(params: SamplingParams) -> bool:
    return bool(params.presence_penalty or params.frequency_penalty or params.repetition_penalty != 1.0)


@dataclass(frozen=True)
class _Occurrences:
    """Token occurrences as flat (row, token id) pairs; a token repeated in a row repeats here."""

    rows: Tensor  # [N] int64
    ids: Tensor  # [N] int64

    @classmethod
    def build(cls, per_row: Sequence[Sequence[int]], device: torch.device | str) -> _Occurrences:
        rows = [row for row, ids in enumerate(per_row) for _ in range(len(ids))]
        ids = [token for row_ids in per_row for token in row_ids]
        as_tensor = lambda values: torch.tensor(values, dtype=torch.int64).to(device, non_blocking=True)
        return cls(as_tensor(rows), as_tensor(ids))

    def flat_index(self, vocab_size: int) -> Tensor:
        return self.rows * vocab_size + self.ids


# eq=False: tensors don't support the element-wise == a generated __eq__ would call.
@dataclass(frozen=True, eq=False)
class LogitsPenalties:
    """One batch's logits processing; rows that use none of it are left exactly as they are.

    The per-row penalty columns are [B, 1] so that each op covers the whole batch; neutral values
    (presence 0, frequency 0, repetition 1) leave a row's logits bit-for-bit unchanged.
    """

    vocab_size: int
    # logit_bias entries and min_tokens bans (-inf), added with accumulation, so a banned id that
    # also has a bias stays -inf.
    additive: _Occurrences | None
    additive_values: Tensor | None  # [N] float32
    output: _Occurrences | None  # generated tokens of rows with a penalty
    prompt: _Occurrences | None  # prompt tokens of rows with a repetition penalty
    presence: Tensor | None  # [B, 1] float32
    frequency: Tensor | None  # [B, 1] float32
    repetition: Tensor | None  # [B, 1] float32

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        histories: Sequence[TokenHistory | None] | None,
        vocab_size: int,
        device: torch.device | str,
    ) -> LogitsPenalties | None:
        """None when no row processes its logits: the sampler's fast path, which builds no
        [B, V] tensor at all.  `histories` may be None (or hold None) only for rows that need no
        history (logit_bias alone)."""
        if not any(p.processes_logits for p in params):
            return None
        rows = range(len(params))

        def history(row: int) -> TokenHistory:
            found = None if histories is None else histories[row]
            if found is None:
                raise ValueError(f"sampling row {row} uses penalties or min_tokens but has no token history")
            return found

        additive, values = _additive_entries(params, history, vocab_size)
        penalised = {row for row in rows if _needs_history(params[row])}
        repeating = {row for row in rows if params[row].repetition_penalty != 1.0}
        if not values and not penalised:
            return None  # only min_tokens, and every such row has reached it

        def column(name: str) -> Tensor | None:
            if not any(getattr(p, name) for p in params):
                return None
            values = [[float(getattr(p, name))] for p in params]
            return torch.tensor(values, dtype=torch.float32).to(device, non_blocking=True)

        return cls(
            vocab_size=vocab_size,
            additive=_Occurrences.build(additive, device) if values else None,
            additive_values=torch.tensor(values, dtype=torch.float32).to(device) if values else None,
            output=_Occurrences.build([history(r).output_ids if r in penalised else () for r in rows], device)
            if penalised
            else None,
            prompt=_Occurrences.build([history(r).prompt_ids if r in repeating else () for r in rows], device)
            if repeating
            else None,
            presence=column("presence_penalty"),
            frequency=column("frequency_penalty"),
            repetition=None if not repeating else column("repetition_penalty"),
        )

    def apply(self, logits: Tensor) -> Tensor:
        """Processed float32 logits [B, V], a new tensor: the caller's logits stay raw."""
        processed = logits.to(torch.float32, copy=True)
        flat = processed.view(-1)
        if self.additive is not None:
            flat.index_put_((self.additive.flat_index(self.vocab_size),), self.additive_values, accumulate=True)
        if self.output is None:
            return processed
        # One scatter-add counts every row's generated tokens.
        counts = torch.zeros_like(processed)
        ones = torch.ones_like(self.output.ids, dtype=counts.dtype)
        counts.view(-1).index_add_(0, self.output.flat_index(self.vocab_size), ones)
        in_output = counts > 0
        if self.prompt is not None:
            seen = in_output.clone()
            seen.view(-1)[self.prompt.flat_index(self.vocab_size)] = True
            # HF/vLLM convention: shrink a positive logit, grow a negative one, toward less likely.
            penalised = torch.where(processed > 0, processed / self.repetition, processed * self.repetition)
            processed = torch.where(seen, penalised, processed)
        if self.frequency is not None:
            processed -= counts * self.frequency
        if self.presence is not None:
            processed -= in_output * self.presence
        return processed


def _additive_entries(params, history, vocab_size: int) -> tuple[list[list[int]], list[float]]:
    """Per row, the (token id, value) pairs to add: logit_bias, then -inf for each id min_tokens
    bans while the row has fewer outputs than min_tokens."""
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
    return per_row, values
