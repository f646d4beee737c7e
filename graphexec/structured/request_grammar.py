"""One request's position in its grammar: which tokens may come next, and each sampled token
accepted exactly once.

Only the engine loop's thread touches it after submission.  Tokens reach it from
`Req.append_token`, the one place a sampled token is recorded, so a retracted request resumed
by recompute (its last token fed again as input, not sampled again) never advances it twice,
and prompt-chunk rows, which sample nothing, never reach it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import xgrammar as xgr


class RequestGrammar:
    def __init__(self, compiled: xgr.CompiledGrammar, stop_token_ids: Sequence[int]):
        # The request's own stop tokens are where the grammar may end; xgrammar allows them only
        # once the grammar is complete (and then, when nothing else fits, only them).
        self._matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=list(stop_token_ids))
        self.num_accepted = 0

    def accept(self, token_id: int) -> bool:
        """Advance past a sampled token; False if the grammar does not allow it (nothing changes)."""
        accepted = self._matcher.accept_token(token_id)
        self.num_accepted += accepted
        return accepted

    def fill_row(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into bitmask[row] (bit set = allowed)."""
        self._matcher.fill_next_token_bitmask(bitmask, row)

    @property
    def is_completed(self) -> bool:
        """The text so far is a whole match (a stop token may come next)."""
        return self._matcher.is_completed()

    @property
    def is_terminated(self) -> bool:
        """A stop token was accepted: nothing more may follow."""
        return self._matcher.is_terminated()
