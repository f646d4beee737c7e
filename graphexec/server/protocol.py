"""Request bodies of the OpenAI-compatible API, validated strictly.

These models are the endpoints' bodies, so /openapi.json publishes them as validated here.
Unknown fields are rejected (`extra="forbid"`) and types are strict (no "8" for 8, no true for 1),
so a typo or a wrong type is a 400 naming the field instead of a silently ignored option.
OpenAI fields graphexec does not implement are accepted only at their neutral value.
Ranges follow OpenAI's where it has one (temperature in [0, 2]); `top_k`, `min_p`, `ignore_eos`,
`repetition_penalty` and `min_tokens` are extensions, as in vLLM and SGLang.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, PlainValidator, ValidationInfo, field_validator

from graphexec.errors import InvalidRequestError
from graphexec.sampling_params import MAX_STOP_STRINGS, SamplingParams
from graphexec.server.response_format import StructuredOutputFields

# OpenAI's legacy completions API caps logprobs at 5; chat's top_logprobs at 20.
MAX_COMPLETION_LOGPROBS = 5
MAX_CHAT_TOP_LOGPROBS = 20


def _prompt(value: object) -> str | list[int] | list[str] | list[list[int]]:
    """One prompt (text or token ids) or several (texts or token-id lists), as lm-eval sends them."""
    if isinstance(value, str) or _is_token_ids(value):
        return value
    if isinstance(value, list) and value:
        if all(isinstance(v, str) for v in value):
            return value
        if all(isinstance(v, list) for v in value):
            bad = next((i for i, v in enumerate(value) if not _is_token_ids(v)), None)
            if bad is None:
                return value
            raise ValueError(f"prompt[{bad}] must be a list of token ids (integers)")
    raise ValueError(
        "must be a string, a list of token ids (integers), a list of strings or a list of token-id lists"
    )


def _is_token_ids(value: object) -> bool:
    return isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)


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


def _logit_bias(value: object) -> dict[int, float] | None:
    """OpenAI's {"50256": -100}: JSON keys are strings, so token ids arrive as digit strings.
    The biases' range is SamplingParams' to check."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError('must be an object mapping token ids to biases, e.g. {"50256": -100}')
    bias = {}
    for key, number in value.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit()):
            raise ValueError(f"keys must be token ids (non-negative integers as strings), got {key!r}")
        if isinstance(number, bool) or not isinstance(number, (int, float)):
            raise ValueError(f"bias of token {key} must be a number, got {number!r}")
        bias[int(key)] = number
    return bias


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class TextPart(_Strict):
    """One part of a message's content (the published schema; `_content` does the validating)."""

    type: Literal["text"]
    text: str


# Requests /openapi.json shows (and tests/test_server_api.py sends); the default model's name.
_COMPLETION_EXAMPLE = {"model": "smollm2-135m", "prompt": "The capital of France is", "max_tokens": 8}
_CHAT_EXAMPLE = {
    "model": "smollm2-135m",
    "messages": [{"role": "user", "content": "What is the capital of France?"}],
    "max_tokens": 16,
}

# What `prompt` may be, for the published schema (`_prompt` does the validating).
PromptField = str | list[int] | list[str] | list[list[int]]


class StreamOptions(_Strict):
    include_usage: bool = False  # a last chunk with the usage of the whole response
    # vLLM's: every chunk carries its choice's usage so far (load generators such as guidellm ask).
    continuous_usage_stats: bool = False


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant"]
    content: Annotated[str, PlainValidator(_content, json_schema_input_type=str | list[TextPart])]
    name: str | None = None


class _GenerationRequest(_Strict, StructuredOutputFields):
    """Fields shared by /v1/completions and /v1/chat/completions.  None means "the server's
    default": the `sampling` config group, except max_tokens, whose default is the room the
    request has left after its prompt (the server decides it: graphexec/server/limits.py)."""

    model: str
    max_tokens: int | None = Field(None, ge=1, description="Omitted: the room left after the prompt.")
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = None
    min_p: float | None = Field(None, ge=0, le=1)
    seed: int | None = Field(None, ge=0, lt=2**64)
    stop: str | list[str] | None = None
    ignore_eos: bool | None = None
    n: int = Field(1, ge=1)  # choices per prompt; the server caps it (server.max_n)
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0)
    logit_bias: Annotated[dict[int, float] | None, PlainValidator(_logit_bias)] = None
    min_tokens: int | None = Field(None, ge=0)
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
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty,
            "logit_bias": self.logit_bias,
            "min_tokens": self.min_tokens,
            "structured": self.structured_spec(),
        }
        return defaults.replace(**{k: v for k, v in changes.items() if v is not None})

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.continuous_usage_stats


class CompletionRequest(_GenerationRequest):
    model_config = ConfigDict(json_schema_extra={"examples": [_COMPLETION_EXAMPLE]})

    prompt: Annotated[PromptField, PlainValidator(_prompt, json_schema_input_type=PromptField)]
    # 0 only with echo: the prompt's logprobs alone.
    max_tokens: int | None = Field(
        None,
        ge=0,
        description="Omitted: 16, OpenAI's default (operators change it with server.completions_max_tokens), "
        "never more than the room left after the prompt. 0 is allowed only with echo=true.",
    )
    logprobs: int | None = Field(None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    # The prompt in front of the completion text and, with logprobs, one entry per prompt token
    # (null for the first) in front of the completion's: what lm-eval scores loglikelihoods from.
    echo: bool = False
    best_of: int | None = None  # accepted only equal to n: no server-side ranking of candidates

    @field_validator("echo")
    @classmethod
    def _echo(cls, value: bool, info: ValidationInfo) -> bool:
        # stream and logprobs are declared first, so they are already validated.
        if value and info.data.get("stream") and info.data.get("logprobs") is not None:
            raise ValueError("echo with logprobs is not supported when streaming; set stream=false")
        return value

    @field_validator("best_of")
    @classmethod
    def _best_of(cls, value: int | None, info: ValidationInfo) -> int | None:
        # n is declared first, so it is already validated (absent from data if invalid).
        if value is not None and value != info.data.get("n", 1):
            raise ValueError("only best_of equal to n is supported (every candidate is returned; none is ranked)")
        return value

    def prompts(self) -> list[str | list[int]]:
        """The prompts, one choice (or n) each: a single prompt is a list of one."""
        if isinstance(self.prompt, str) or _is_token_ids(self.prompt):
            return [self.prompt]
        return list(self.prompt)

    def requested_max_tokens(self) -> tuple[str, int | None]:
        """The field that sets the completion's length, and its value (None: omitted)."""
        if self.max_tokens == 0 and not self.echo:
            raise InvalidRequestError("max_tokens: 0 generates nothing; it is allowed only with echo=true", param="max_tokens")
        return "max_tokens", self.max_tokens

    def to_sampling_params(self, defaults: SamplingParams, max_new_tokens: int) -> SamplingParams:
        params = self.sampling_params(defaults, max_new_tokens, self.logprobs)
        if self.echo and self.logprobs is not None:
            params = params.replace(prompt_logprobs=self.logprobs)
        return params


class ChatCompletionRequest(_GenerationRequest):
    model_config = ConfigDict(json_schema_extra={"examples": [_CHAT_EXAMPLE]})

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
