"""One request's position in its grammar: which tokens may come next, and each sampled token
accepted exactly once.

Only the engine loop's thread touches it after submission.  Tokens reach it from
`Req.append_token`, the one place a sampled token is recorded, so a retracted request resumed
by recompute (its last token fed again as input, not sampled again) never advances it twice,
and prompt-chunk rows, which sample nothing, never reach it.
"""

from __future__ import annotations

from collections.abc import Sequence

import llguidance
import torch


class RequestGrammar:
    def __init__(self, compiled: llguidance.LLMatcher, stop_token_ids: Sequence[int], eos_token_ids: Sequence[int]):
        """`compiled`: the cache's matcher, copied here; `stop_token_ids`: where the grammar may end
        (EOS and the request's own stop tokens); `eos_token_ids`: those llguidance already knows."""
        self._matcher = compiled.deep_copy()
        self._stops = frozenset(stop_token_ids)
        # The request's own stop tokens are unknown to the vocabulary llguidance was built with, so
        # their bits are set here, where the grammar may end, and cleared elsewhere: sampling one
        # ends the request, which must not happen mid-grammar even if the token is also text.
        self._extra_stops = _bits_by_word(sorted(self._stops - set(eos_token_ids)))
        self._terminated = False
        self.num_accepted = 0

    def accept(self, token_id: int) -> bool:
        """Advance past a sampled token; False if the grammar does not allow it (nothing changes)."""
        if self._terminated:
            return False
        if token_id in self._stops:
            if not self._matcher.is_accepting():
                return False
            self._terminated = True
        # try_consume_tokens, unlike consume_token, leaves a refused token's matcher as it was.
        elif self._matcher.try_consume_tokens([token_id]) != 1:
            return False
        self.num_accepted += 1
        return True

    def fill_row(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into bitmask[row] (an int32 [rows, words] CPU tensor, C
        contiguous; bit set = allowed)."""
        # llguidance writes through a raw pointer: the checks that keep it inside the tensor (it
        # checks the row's size against its vocabulary itself).
        if bitmask.dtype != torch.int32 or bitmask.device.type != "cpu" or not bitmask.is_contiguous():
            raise ValueError("the bitmask must be a contiguous int32 CPU tensor")
        if not 0 <= row < bitmask.shape[0]:
            raise IndexError(f"row {row} is outside a bitmask of {bitmask.shape[0]} rows")
        row_bytes = bitmask.shape[1] * 4
        self._matcher.unsafe_compute_mask_ptr(bitmask.data_ptr() + row * row_bytes, row_bytes)
        if self._extra_stops:
            words = bitmask[row].numpy().view("uint32")
            allowed = self.is_completed
            for word, bits in self._extra_stops:
                if allowed:
                    words[word] |= bits
                else:
                    words[word] &= 0xFFFFFFFF ^ bits

    def valid_draft_length(self, tokens: Sequence[int]) -> int:
        """How many leading draft tokens the grammar would accept from here, stopping before the
        first stop token (nothing after one is verified); the matcher is left as it was."""
        if self._terminated:
            return 0
        text = list(tokens[: next((i for i, t in enumerate(tokens) if t in self._stops), len(tokens))])
        return self._matcher.validate_tokens(text) if text else 0

    def after(self, tokens: Sequence[int]) -> _AfterDraft:
        """This grammar as a verify row sees it: as if `tokens` (valid drafts) were accepted."""
        return _AfterDraft(self, tuple(tokens))

    def fill_row_after(self, tokens: tuple[int, ...], bitmask: torch.Tensor, row: int) -> None:
        """`fill_row` as it would be after accepting `tokens` (valid drafts); the matcher is left
        as it was."""
        consumed = self._matcher.try_consume_tokens(list(tokens))
        try:
            if consumed != len(tokens):
                raise RuntimeError(f"a verified draft left the grammar after {consumed} of {len(tokens)} tokens")
            self.fill_row(bitmask, row)
        finally:
            self._matcher.rollback(consumed)

    @property
    def is_completed(self) -> bool:
        """The text so far is a whole match (a stop token may come next)."""
        return self._terminated or self._matcher.is_accepting()

    @property
    def is_terminated(self) -> bool:
        """A stop token was accepted: nothing more may follow."""
        return self._terminated


class _AfterDraft:
    """A RowGrammar for verify row i of a constrained request: the request's grammar advanced by
    the i draft tokens before the row while its mask is written, then rolled back."""

    def __init__(self, grammar: RequestGrammar, tokens: tuple[int, ...]):
        self._grammar = grammar
        self._tokens = tokens

    def fill_row(self, bitmask: torch.Tensor, row: int) -> None:
        self._grammar.fill_row_after(self._tokens, bitmask, row)


def _bits_by_word(token_ids: list[int]) -> tuple[tuple[int, int], ...]:
    """(32-bit word, its bits) for each word holding any of `token_ids`."""
    words: dict[int, int] = {}
    for token in token_ids:
        words[token // 32] = words.get(token // 32, 0) | 1 << token % 32
    return tuple(words.items())
