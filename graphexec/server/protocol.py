"""Request bodies of the OpenAI-compatible API, validated strictly.

These models are the endpoints' bodies, so /openapi.json publishes them as validated here: a
field checked by a function of its own publishes the schema of what that function accepts
(`json_schema_input_type`), and a bound only the app knows (the vocabulary, server.max_n) is
marked with `openapi.limit` for the app to fill in.  Unknown fields are rejected
(`extra="forbid"`) and types are strict (no "8" for 8, no true for 1), so a typo or a wrong type
is a 400 naming the field instead of a silently ignored option.  An integer may be written 8.0:
JSON has one kind of number, and JSON Schema's integer is any number without a fraction.
OpenAI fields graphexec does not implement are accepted only at their neutral value.
Ranges follow OpenAI's where it has one (temperature in [0, 2]); `top_k`, `min_p`, `ignore_eos`,
`repetition_penalty` and `min_tokens` are extensions, as in vLLM and SGLang.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import (
    BaseModel, BeforeValidator, ConfigDict, Field, PlainValidator, ValidationInfo, WithJsonSchema, field_validator,
)

from graphexec.errors import InvalidRequestError
from graphexec.sampling_params import MAX_LOGIT_BIAS, MAX_STOP_STRINGS, SamplingParams
from graphexec.server.openapi import (
    CHOICES, MAX_TOKENS, MIN_TOKENS, MODEL, PROMPT_TEXT, PROMPT_TOKENS, PROMPTS, TOKEN_ID, TOKEN_ID_KEY, limit,
)
from graphexec.server.response_format import CONSTRAINT_RULES, StructuredOutputFields
from graphexec.server.tool_protocol import TOOL_RULES, MessageToolCall, ToolFields

# OpenAI's legacy completions API caps logprobs at 5; chat's top_logprobs at 20.
MAX_COMPLETION_LOGPROBS = 5
MAX_CHAT_TOP_LOGPROBS = 20


def _whole(value: object) -> object:
    """8.0 as 8 (JSON Schema's integer); anything else goes on to the strict int check."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


# After the constraints in an Annotated int (`Annotated[int, Field(ge=1), WHOLE]`): placed before
# them, pydantic would publish the constraints under their Python names (`ge`), not JSON Schema's.
WHOLE = BeforeValidator(_whole)

# A token id; `openapi.TOKEN_ID` bounds it by the vocabulary, which the engine checks.
TokenId = Annotated[int, Field(ge=0, json_schema_extra=limit(TOKEN_ID)), WHOLE]


def _prompt(value: object) -> str | list[int] | list[str] | list[list[int]]:
    """One prompt (text or token ids) or several (texts or token-id lists), as lm-eval sends them."""
    if isinstance(value, str):
        return value
    ids = _token_ids(value)
    if ids is not None:
        return ids
    if isinstance(value, list) and value:
        if all(isinstance(v, str) for v in value):
            return value
        if all(isinstance(v, list) for v in value):
            lists = [_token_ids(v) for v in value]
            bad = next((i for i, ids in enumerate(lists) if ids is None), None)
            if bad is None:
                return lists
            raise ValueError(f"prompt[{bad}] must be a list of token ids (integers)")
    raise ValueError(
        "must be a string, a list of token ids (integers), a list of strings or a list of token-id lists"
    )


def _token_ids(value: object) -> list[int] | None:
    """`value` as token ids (8.0 is 8), or None if it is not a list of integers."""
    if not isinstance(value, list):
        return None
    if not _all_ints(value):
        value = [_whole(v) for v in value]  # a copy only when some id is written as a float
    return value if _all_ints(value) else None


def _all_ints(values: list) -> bool:
    return all(isinstance(v, int) and not isinstance(v, bool) for v in values)


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


def _message_content(value: object, info: ValidationInfo) -> str | None:
    """`_content`; null (or omitted) only in an assistant message that carries tool_calls."""
    if value is None:
        if info.data.get("role") == "assistant" and info.data.get("tool_calls"):
            return None
        raise ValueError("field required (it may be null only in an assistant message with tool_calls)")
    return _content(value)


def _logit_bias(value: object) -> dict[int, float] | None:
    """OpenAI's {"50256": -100}: JSON keys are strings, so token ids arrive as digit strings.
    The biases' range is SamplingParams' to check."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError('must be an object mapping token ids to biases, e.g. {"50256": -100}')
    bias = {}
    # The schema says the same (_LOGIT_BIAS_SCHEMA); the biases' range is SamplingParams' to check.
    for key, number in value.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit()):
            raise ValueError(f"keys must be token ids (non-negative integers as strings), got {key!r}")
        if isinstance(number, bool) or not isinstance(number, (int, float)):
            raise ValueError(f"bias of token {key} must be a number, got {number!r}")
        bias[int(key)] = number
    return bias


_LOGIT_BIAS_SCHEMA = {
    "anyOf": [
        {
            "type": "object",
            "description": 'Token ids (as strings: JSON keys are strings) to biases, e.g. {"50256": -100}',
            "propertyNames": {"pattern": "^[0-9]+$", **limit(TOKEN_ID_KEY)},
            "additionalProperties": {"type": "number", "minimum": -MAX_LOGIT_BIAS, "maximum": MAX_LOGIT_BIAS},
        },
        {"type": "null"},
    ]
}


def _stop(value: object) -> str | list[str] | None:
    """A stop string or a list of them (`StopField`), each non-empty."""
    if value is None:
        return None
    strings = [value] if isinstance(value, str) else value
    if not isinstance(strings, list) or not all(isinstance(s, str) for s in strings):
        raise ValueError("must be a string or a list of strings")
    if len(strings) > MAX_STOP_STRINGS:
        raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are supported, got {len(strings)}")
    if any(not s for s in strings):
        raise ValueError("stop strings must be non-empty")
    return value


# What `_stop` accepts, for the published schema.
_StopString = Annotated[str, Field(min_length=1)]
StopField = _StopString | Annotated[list[_StopString], Field(max_length=MAX_STOP_STRINGS)] | None

# top_k: -1 (disabled) or at least 1, as `_GenerationRequest._top_k` checks.
_TOP_K_SCHEMA = {"anyOf": [{"type": "integer", "const": -1}, {"type": "integer", "minimum": 1}]}


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

# What the validators refuse across fields, in JSON Schema (`requested_max_tokens`;
# `_needs_logprobs`, and chat's max_tokens, which counts only without max_completion_tokens).
# best_of equal to n, and min_tokens within max_tokens, it cannot say.
_COMPLETION_RULES = [
    *CONSTRAINT_RULES,
    {"not": {"required": ["max_tokens"], "properties": {"max_tokens": {"const": 0}, "echo": {"const": False}}}},
]
_CHAT_RULES = [
    *CONSTRAINT_RULES,
    {
        "not": {
            "required": ["top_logprobs"],
            "properties": {"top_logprobs": {"type": "integer"}, "logprobs": {"const": False}},
        }
    },
    {
        "anyOf": [
            {"required": ["max_completion_tokens"], "properties": {"max_completion_tokens": {"type": "integer"}}},
            {"properties": {"max_tokens": limit(MAX_TOKENS)}},
        ]
    },
]

# What `prompt` may be, for the published schema (`_prompt` does the validating; an empty list of
# ids, or one of a prompt's length or more, is refused by the engine).
_PromptText = Annotated[str, Field(json_schema_extra=limit(PROMPT_TEXT))]
_PromptIds = Annotated[list[TokenId], Field(min_length=1, json_schema_extra=limit(PROMPT_TOKENS))]
PromptField = (
    _PromptText
    | _PromptIds
    | Annotated[list[_PromptText], Field(min_length=1, json_schema_extra=limit(PROMPTS))]
    | Annotated[list[_PromptIds], Field(min_length=1, json_schema_extra=limit(PROMPTS))]
)


class StreamOptions(_Strict):
    include_usage: bool = False  # a last chunk with the usage of the whole response
    # vLLM's: every chunk carries its choice's usage so far (load generators such as guidellm ask).
    continuous_usage_stats: bool = False


# What ChatMessage's validators check across its fields, in JSON Schema.
_MESSAGE_RULES = [
    {
        "anyOf": [
            {"required": ["content"], "properties": {"content": {"not": {"type": "null"}}}},
            {"required": ["tool_calls"], "properties": {"role": {"const": "assistant"}, "tool_calls": {"type": "array", "minItems": 1}}},
        ]
    },
    {
        "anyOf": [
            {"required": ["tool_call_id"], "properties": {"role": {"const": "tool"}, "tool_call_id": {"type": "string"}}},
            {"properties": {"role": {"not": {"const": "tool"}}, "tool_call_id": {"type": "null"}}},
        ]
    },
    {"anyOf": [{"properties": {"role": {"const": "assistant"}}}, {"properties": {"tool_calls": {"type": "null"}}}]},
]


class ChatMessage(_Strict):
    """One message of a conversation.  An assistant message may carry the calls an earlier reply
    made (`tool_calls`, content then optional); a "tool" message answers one of them
    (`tool_call_id`).  Templates that know nothing of tools get both as text (tool_prompt.py)."""

    model_config = ConfigDict(json_schema_extra={"allOf": _MESSAGE_RULES})

    role: Literal["system", "user", "assistant", "tool"]
    # Before content, whose validator reads them.
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = Field(None, validate_default=True)
    content: Annotated[
        str | None, PlainValidator(_message_content, json_schema_input_type=str | list[TextPart] | None)
    ] = Field(None, validate_default=True)
    name: str | None = None

    @field_validator("tool_calls")
    @classmethod
    def _calls_are_the_assistants(cls, value: list | None, info: ValidationInfo) -> list | None:
        if value is not None and info.data.get("role") != "assistant":
            raise ValueError("only an assistant message carries tool_calls")
        return value

    @field_validator("tool_call_id")
    @classmethod
    def _tool_call_id(cls, value: str | None, info: ValidationInfo) -> str | None:
        if info.data.get("role") == "tool" and value is None:
            raise ValueError('field required in a "tool" message (the id of the call it answers)')
        if info.data.get("role") not in ("tool", None) and value is not None:
            raise ValueError('only a "tool" message has a tool_call_id')
        return value

    def template_dict(self) -> dict:
        """The message as chat templates take it (content may be None next to tool_calls)."""
        message = {"role": self.role, "content": self.content}
        if self.tool_calls:
            message["tool_calls"] = [call.model_dump() for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


class _GenerationRequest(_Strict, StructuredOutputFields):
    """Fields shared by /v1/completions and /v1/chat/completions.  None means "the server's
    default": the `sampling` config group, except max_tokens, whose default is the room the
    request has left after its prompt (the server decides it: graphexec/server/limits.py)."""

    model: str = Field(json_schema_extra=limit(MODEL))  # another model's name is a 404
    # Chat's; its bound is in _CHAT_RULES, since max_completion_tokens overrides it.
    max_tokens: Annotated[int, Field(ge=1), WHOLE] | None = Field(
        None, description="Omitted: the room left after the prompt."
    )
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: Annotated[int, WithJsonSchema(_TOP_K_SCHEMA), WHOLE] | None = None
    min_p: float | None = Field(None, ge=0, le=1)
    seed: Annotated[int, Field(ge=0, lt=2**64), WHOLE] | None = None
    stop: Annotated[str | list[str] | None, PlainValidator(_stop, json_schema_input_type=StopField)] = None
    ignore_eos: bool | None = None
    # Choices per prompt, at most server.max_n.
    n: Annotated[int, Field(ge=1, json_schema_extra=limit(CHOICES)), WHOLE] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0)
    logit_bias: Annotated[
        dict[int, float] | None, PlainValidator(_logit_bias), WithJsonSchema(_LOGIT_BIAS_SCHEMA)
    ] = None
    min_tokens: Annotated[int, Field(ge=0, json_schema_extra=limit(MIN_TOKENS)), WHOLE] | None = None
    user: str | None = None

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, value: int | None) -> int | None:
        if value is not None and value != -1 and value < 1:
            raise ValueError("must be -1 (disabled) or >= 1")
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
    model_config = ConfigDict(json_schema_extra={"examples": [_COMPLETION_EXAMPLE], "allOf": _COMPLETION_RULES})

    prompt: Annotated[PromptField, PlainValidator(_prompt, json_schema_input_type=PromptField)]
    # 0 only with echo: the prompt's logprobs alone.
    max_tokens: Annotated[int, Field(ge=0, json_schema_extra=limit(MAX_TOKENS)), WHOLE] | None = Field(
        None,
        description="Omitted: 16, OpenAI's default (operators change it with server.completions_max_tokens), "
        "never more than the room left after the prompt. 0 is allowed only with echo=true.",
    )
    logprobs: Annotated[int, Field(ge=0, le=MAX_COMPLETION_LOGPROBS), WHOLE] | None = None
    # The prompt in front of the completion text and, with logprobs, one entry per prompt token
    # (null for the first) in front of the completion's: what lm-eval scores loglikelihoods from.
    echo: bool = False
    # Accepted only equal to n: no server-side ranking of candidates.
    best_of: Annotated[int, Field(ge=1, json_schema_extra=limit(CHOICES)), WHOLE] | None = None

    @field_validator("best_of")
    @classmethod
    def _best_of(cls, value: int | None, info: ValidationInfo) -> int | None:
        # n is declared first, so it is already validated (absent from data if invalid).
        if value is not None and value != info.data.get("n", 1):
            raise ValueError("only best_of equal to n is supported (every candidate is returned; none is ranked)")
        return value

    def prompts(self) -> list[str | list[int]]:
        """The prompts, one choice (or n) each: a single prompt is a list of one."""
        # Validated: a list of ints (or none) is one prompt's ids; lists of texts or of id lists are several.
        if isinstance(self.prompt, str) or not self.prompt or isinstance(self.prompt[0], int):
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


class ChatCompletionRequest(_GenerationRequest, ToolFields):
    model_config = ConfigDict(json_schema_extra={"examples": [_CHAT_EXAMPLE], "allOf": [*_CHAT_RULES, *TOOL_RULES]})

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Annotated[int, Field(ge=1, json_schema_extra=limit(MAX_TOKENS)), WHOLE] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_CHAT_TOP_LOGPROBS), WHOLE] | None = None

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

    def chat_messages(self) -> list[dict]:
        return [m.template_dict() for m in self.messages]
