"""One generation request and how it ended."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from graphexec.sampling_params import SamplingParams

if TYPE_CHECKING:
    from graphexec.structured.request_grammar import RequestGrammar


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS or one of the request's stop token ids
    LENGTH = "length"  # max_new_tokens or the model's context limit
    ABORT = "abort"


@dataclass(eq=False)
class Req:
    """Scheduler-side state of a request.  Mutated only by the scheduler thread."""

    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    eos_token_ids: tuple[int, ...]
    max_context: int
    output_ids: list[int] = field(default_factory=list)
    # Leading tokens (prompt, then output) whose KV is computed: a prefix-cache hit, earlier prompt
    # chunks, decode steps.  Back to 0 when the request is retracted; where the KV lives, and
    # which slots the prefix cache owns, is the KV cache manager's business.
    num_computed_tokens: int = 0
    # Prompt tokens the prefix cache supplied at first admission (kept, for usage).
    num_reused_tokens: int = 0
    # Times the scheduler took this request's KV back under memory pressure (it then resumed).
    num_retractions: int = 0
    finish_reason: FinishReason | None = None
    # The token that ended the request when it is a stop token; kept out of output_ids.
    matched_stop_token: int | None = None
    generator: torch.Generator | None = None
    output_logprobs: list[dict] = field(default_factory=list)
    # The matcher of params.structured; it sees each sampled token once, here in append_token.
    grammar: RequestGrammar | None = None
    # One entry per prompt position when params.prompt_logprobs is set (position 0: None, nothing
    # predicts it); filled chunk by chunk as the prompt is prefilled.
    prompt_logprobs: list[dict | None] | None = None

    def __post_init__(self) -> None:
        if self.params.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = [None] * len(self.prompt_ids)

    @property
    def prompt_logprobs_pending(self) -> bool:
        """Whether prompt positions still lack their entry (so no cached prefix may stand in)."""
        return self.prompt_logprobs is not None and None in self.prompt_logprobs[1:]

    @property
    def seq_len(self) -> int:
        """Tokens of this request that carry (or are about to carry) KV."""
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def max_total_tokens(self) -> int:
        """Upper bound on the tokens (so KV slots) this request can ever hold."""
        return min(len(self.prompt_ids) + self.params.max_new_tokens, self.max_context)

    def append_token(self, token_id: int) -> None:
        """Record a sampled token and decide whether the request is done."""
        params = self.params
        is_stop = token_id in params.stop_token_ids or (
            not params.ignore_eos and token_id in self.eos_token_ids
        )
        if is_stop:
            self.matched_stop_token = token_id
            self.finish_reason = FinishReason.STOP
            return
        if self.grammar is not None and not self.grammar.accept(token_id):
            # The mask lets only allowed tokens through, so this is an engine fault; the output
            # could never match any more, so the request ends rather than run on unconstrained.
            self.finish_reason = FinishReason.ABORT
            return
        self.output_ids.append(token_id)
        if len(self.output_ids) >= params.max_new_tokens or self.seq_len >= self.max_context:
            self.finish_reason = FinishReason.LENGTH
