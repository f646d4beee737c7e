"""What a caller gets back: a finished request (`RequestOutput`) and a streamed step (`RequestDelta`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    text: str  # without a matched stop string and anything after it
    token_ids: list[int]  # generated ids only; a stop token that ended the request is not included
    finish_reason: str  # "stop" | "length" | "abort"
    logprobs: list[dict] | None = None
    # Seconds from submission to the first generated token (None if none was generated).
    ttft: float | None = None
    # Mean seconds between generated tokens after the first (None with fewer than two tokens).
    tpot: float | None = None
    # Seconds from submission to the end.
    latency: float | None = None
    # Prompt tokens whose KV was reused from the prefix cache rather than computed.
    cached_tokens: int = 0
    # With SamplingParams.prompt_logprobs: one entry per prompt token, None for the first.
    prompt_logprobs: list[dict | None] | None = None
    # The stop token (EOS or a stop_token_id) that ended the request: generated, so counted in
    # completion_tokens (as vLLM and OpenAI bill it), but in neither token_ids nor text.
    stop_token_id: int | None = None

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def completion_tokens(self) -> int:
        """Tokens the model generated: token_ids, plus the stop token that ended the request."""
        return len(self.token_ids) + (self.stop_token_id is not None)


@dataclass(frozen=True)
class RequestDelta:
    """What one request produced since its previous delta.  The last delta has `finish_reason`
    and the whole request as `output`; joining every delta's text gives `output.text`.
    """

    request_id: str
    token_ids: list[int]
    text: str  # whole characters only: a character split across tokens arrives complete
    logprobs: list[dict] | None = None  # one entry per token in token_ids, when asked for
    finish_reason: str | None = None
    output: RequestOutput | None = None
    # With SamplingParams.prompt_logprobs, on the request's first delta only: one entry per prompt
    # token (None for the first), complete since the prefill is done by then (unless aborted first).
    prompt_logprobs: list[dict | None] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
