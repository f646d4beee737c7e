"""Request bodies of the OpenAI-compatible API, validated strictly.

Unknown fields are rejected (`extra="forbid"`) and types are strict (no "8" for 8, no true for 1),
so a typo or a wrong type is a 400 naming the field instead of a silently ignored option.
OpenAI fields graphexec does not implement are accepted only at their neutral value.
Ranges follow OpenAI's where it has one (temperature in [0, 2]); `top_k`, `min_p` and
`ignore_eos` are extensions, as in vLLM and SGLang.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, PlainValidator, ValidationInfo, field_validator

from graphexec.sampling_params import MAX_STOP_STRINGS, SamplingParams
from graphexec.server.response_format import StructuredOutputFields

# OpenAI's legacy completions API caps logprobs at 5; chat's top_logprobs at 20.
MAX_COMPLETION_LOGPROBS = 5
MAX_CHAT_TOP_LOGPROBS = 20


def _prompt(value: object) -> str | list[int]:
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        raise ValueError("batched prompts (a list of strings) are not supported; send one prompt per request")
    if isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return value
    raise ValueError("must be a string or a list of token ids (integers)")


def _content(value: object) -> str:
    """A message's text: a string, or a list of {"type": "text", "text": ...} parts joined."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) and len(p) == 2
        for p in value
    ):
        return "".join(p["text"] for p in value)
    raise ValueError('must be a string or a list of {"type": "text", "text": "..."} parts')


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant"]
    content: Annotated[str, PlainValidator(_content)]
    name: str | None = None


class _GenerationRequest(_Strict, StructuredOutputFields):
    """Fields shared by /v1/completions and /v1/chat/completions.  None means "the server's
    default": the `sampling` config group, except max_tokens, whose default is the room the
    request has left after its prompt (the server decides it: graphexec/server/limits.py)."""

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = None
    min_p: float | None = Field(None, ge=0, le=1)
    seed: int | None = Field(None, ge=0, lt=2**64)
    stop: str | list[str] | None = None
    ignore_eos: bool | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: str | None = None

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, value: int | None) -> int | None:
        if value is not None and value != -1 and value < 1:
            raise ValueError("must be -1 (disabled) or >= 1")
        return value

    @field_validator("stop")
    @classmethod
    def _stop(cls, value: str | list[str] | None) -> str | list[str] | None:
        strings = [value] if isinstance(value, str) else value or []
        if len(strings) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are supported, got {len(strings)}")
        if any(not s for s in strings):
            raise ValueError("stop strings must be non-empty")
        return value

    @field_validator("n")
    @classmethod
    def _n(cls, value: int) -> int:
        if value != 1:
            raise ValueError("only n=1 is supported")
        return value

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, value: float) -> float:
        if value != 0:
            raise ValueError("penalties are not supported; only 0 is accepted")
        return value

    def sampling_params(self, defaults: SamplingParams, max_new_tokens: int, logprobs: int | None) -> SamplingParams:
        changes = {
            "max_new_tokens": max_new_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "seed": self.seed,
            "stop": [self.stop] if isinstance(self.stop, str) else self.stop,
            "ignore_eos": self.ignore_eos,
            "logprobs": logprobs,
            "structured": self.structured_spec(),
        }
        return defaults.replace(**{k: v for k, v in changes.items() if v is not None})

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_GenerationRequest):
    prompt: Annotated[str | list[int], PlainValidator(_prompt)]
    logprobs: int | None = Field(None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    echo: Literal[False] = False

    def requested_max_tokens(self) -> tuple[str, int | None]:
        """The field that sets the completion's length, and its value (None: omitted)."""
        return "max_tokens", self.max_tokens

    def to_sampling_params(self, defaults: SamplingParams, max_new_tokens: int) -> SamplingParams:
        return self.sampling_params(defaults, max_new_tokens, self.logprobs)


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_CHAT_TOP_LOGPROBS)

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_needs_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        # logprobs is declared first, so it is already validated (absent from data if invalid).
        if value is not None and info.data.get("logprobs") is not True:
            raise ValueError("requires logprobs=true")
        return value

    def requested_max_tokens(self) -> tuple[str, int | None]:
        """max_completion_tokens (OpenAI's newer name) wins over max_tokens when both are set."""
        if self.max_completion_tokens is not None:
            return "max_completion_tokens", self.max_completion_tokens
        return "max_tokens", self.max_tokens

    def to_sampling_params(self, defaults: SamplingParams, max_new_tokens: int) -> SamplingParams:
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self.sampling_params(defaults, max_new_tokens, logprobs)

    def chat_messages(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": m.content} for m in self.messages]
