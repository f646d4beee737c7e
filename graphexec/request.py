"""One generation request and how it ended."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch

from graphexec.sampling_params import SamplingParams


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
    # Row in ReqToTokenPool while the request holds KV; None before admission and after release.
    req_pool_idx: int | None = None
    # Tokens whose KV is already in the pool (prefix-cache hit or earlier prefill chunks).
    num_cached_tokens: int = 0
    # Leading tokens whose KV slots belong to the prefix cache (matched at admission), and the
    # cache node that ends them, locked while this request holds them.
    num_prefix_tokens: int = 0
    prefix_node: Any = None
    # Prompt tokens reused from the prefix cache at admission (kept after release, for usage).
    num_reused_tokens: int = 0
    # Tokens with a KV slot mapped in req_to_token; ahead of num_cached_tokens while a forward
    # that will fill them is in flight.  Release frees exactly these.
    num_allocated_tokens: int = 0
    finish_reason: FinishReason | None = None
    # The token that ended the request when it is a stop token; kept out of output_ids.
    matched_stop_token: int | None = None
    generator: torch.Generator | None = None
    output_logprobs: list[dict] = field(default_factory=list)

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
        """Upper bound on KV slots this request can ever hold (used to reserve capacity)."""
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
        self.output_ids.append(token_id)
        if len(self.output_ids) >= params.max_new_tokens or self.seq_len >= self.max_context:
            self.finish_reason = FinishReason.LENGTH
