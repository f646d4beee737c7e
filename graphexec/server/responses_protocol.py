"""The request body of POST /v1/responses (OpenAI's Responses API), validated strictly.

Stateless: nothing is stored, so `store` is accepted and changes nothing, and what needs a stored
response or conversation (`previous_response_id`) is a 400 naming the field.  `input` is a string
(one user message) or a list of items: messages (roles user, system, developer, assistant; text
parts only), and the function calls and their outputs of an earlier turn.  Items and parts are
told apart by their `type` in functions of their own (`_by_type`), so an error names the exact
place (`input[2].content[0].text`), where a pydantic union would name the union's branch.
Fields OpenAI has and this server does not implement are accepted only at their neutral value,
as in protocol.py.  How the body becomes a chat conversation is responses_input.py's.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PlainValidator, TypeAdapter, ValidationInfo, field_validator

from graphexec.sampling_params import SamplingParams
from graphexec.server.openapi import MAX_TOKENS, MODEL, limit
from graphexec.server.protocol import MAX_CHAT_TOP_LOGPROBS, WHOLE
from graphexec.server.response_format import JsonSchemaFormat
from graphexec.structured.spec import StructuredSpec

# The `include` value that asks for the output text's logprobs; OpenAI's others name outputs
# this server never makes (tool results, images, reasoning), so asking for them adds nothing.
LOGPROBS_INCLUDE = "message.output_text.logprobs"
_INCLUDABLE = Literal[
    "message.output_text.logprobs",
    "reasoning.encrypted_content",
    "file_search_call.results",
    "web_search_call.results",
    "web_search_call.action.sources",
    "message.input_image.image_url",
    "computer_call_output.output.image_url",
    "code_interpreter_call.outputs",
]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


def _by_type(models: Mapping[str, type[BaseModel]], untyped: str | None = None) -> Callable[[object], BaseModel]:
    """A validator choosing the model by the object's `type` (`untyped`'s model when it has none)."""
    names = ", ".join(models)

    def validate(value: object) -> BaseModel:
        if isinstance(value, BaseModel):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"must be an object with a type ({names})")
        kind = value.get("type", untyped)
        if kind not in models:
            raise ValueError(f"type {kind!r} is not supported here; this server takes {names}")
        return models[kind].model_validate(value)

    return validate


# ---- message content --------------------------------------------------------------------------


class InputText(_Strict):
    type: Literal["input_text"]
    text: str


class OutputText(_Strict):
    """An earlier answer's text, as this server returned it (a client sends back `output` items)."""

    type: Literal["output_text"]
    text: str
    annotations: list[dict[str, Any]] = Field(default_factory=list)  # ignored: none are made here
    logprobs: list[dict[str, Any]] | None = None  # ignored


TextPart = InputText | OutputText
_text_part = _by_type({"input_text": InputText, "output_text": OutputText})


def _content(value: object) -> str | list[TextPart]:
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise ValueError('must be a string or a list of {"type": "input_text", "text": ...} parts')
    return _PARTS.validate_python(value)


class MessageItem(_Strict):
    """A message; `type` may be left out (OpenAI's "easy" input message).  A developer message
    is a system message to the chat template."""

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Annotated[str | list[TextPart], PlainValidator(_content, json_schema_input_type=str | list[TextPart])]
    # An output item sent back keeps its id, status and phase; none of them matters here.
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None
    phase: Literal["commentary", "final_answer"] | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


# ---- function calls of earlier turns --------------------------------------------------------


class FunctionCallItem(_Strict):
    """A call the model made in an earlier turn (an `output` item sent back)."""

    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str  # JSON text, as the model wrote it
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallOutputItem(_Strict):
    """What the client's function returned for `call_id`."""

    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: Annotated[str | list[TextPart], PlainValidator(_content, json_schema_input_type=str | list[TextPart])]
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(p.text for p in self.output)


InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem
_input_item = _by_type(
    {"message": MessageItem, "function_call": FunctionCallItem, "function_call_output": FunctionCallOutputItem},
    untyped="message",
)


def _input(value: object) -> str | list[InputItem]:
    if isinstance(value, str):
        return value
    if not isinstance(value, list) or not value:
        raise ValueError("must be a string or a non-empty list of input items")
    return _ITEMS.validate_python(value)


# Built from the functions above: a ValidationError they raise keeps its place (`input[2].role`).
_PARTS = TypeAdapter(list[Annotated[TextPart, PlainValidator(_text_part)]])
_ITEMS = TypeAdapter(list[Annotated[InputItem, PlainValidator(_input_item)]])


# ---- output format, tools ---------------------------------------------------------------------


class TextFormatText(_Strict):
    type: Literal["text"]


class TextFormatJsonObject(_Strict):
    type: Literal["json_object"]


class TextFormatJsonSchema(JsonSchemaFormat):
    """Chat's `response_format.json_schema`, flattened into `text.format` as the Responses API has it."""

    type: Literal["json_schema"]


TextFormat = TextFormatText | TextFormatJsonObject | TextFormatJsonSchema
_text_format = _by_type(
    {"text": TextFormatText, "json_object": TextFormatJsonObject, "json_schema": TextFormatJsonSchema}
)


class TextConfig(_Strict):
    format: Annotated[TextFormat, PlainValidator(_text_format, json_schema_input_type=TextFormat)] = Field(
        default_factory=lambda: TextFormatText(type="text")
    )
    verbosity: Literal["medium"] | None = None  # OpenAI's default; the others steer reasoning models


class ResponsesFunctionTool(_Strict):
    type: Literal["function"]
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments
    strict: bool | None = None


class ResponsesToolChoice(_Strict):
    type: Literal["function"]
    name: str


ToolChoice = Literal["none", "auto", "required"] | ResponsesToolChoice


def _tool_choice(value: object) -> str | ResponsesToolChoice:
    if value in ("none", "auto", "required"):
        return value
    if isinstance(value, dict) and value.get("type") == "function":
        return ResponsesToolChoice.model_validate(value)
    raise ValueError('must be "none", "auto", "required" or {"type": "function", "name": ...}')


class ResponsesStreamOptions(_Strict):
    # Padding against length side channels on OpenAI's network; the events here carry none either way.
    include_obfuscation: bool = True


def _nothing_stored(value: object) -> None:
    if value is not None:
        raise ValueError("this server stores no responses; send the whole conversation in input")
    return None


def _no_reasoning(value: object) -> None:
    if value is not None:
        raise ValueError("this server's models do not reason; leave reasoning null")
    return None


_Tool = Annotated[
    ResponsesFunctionTool,
    PlainValidator(_by_type({"function": ResponsesFunctionTool}), json_schema_input_type=ResponsesFunctionTool),
]
_EXAMPLE = {"model": "smollm2-135m", "input": "What is the capital of France?", "max_output_tokens": 16}
_InputField = str | Annotated[list[InputItem], Field(min_length=1)]


class ResponsesRequest(_Strict):
    """POST /v1/responses.  None means the server's default, as on the other routes: the
    `sampling` config group, and the room left after the input for max_output_tokens."""

    model_config = ConfigDict(json_schema_extra={"examples": [_EXAMPLE]})

    model: str = Field(json_schema_extra=limit(MODEL))  # another model's name is a 404
    input: Annotated[str | list[InputItem], PlainValidator(_input, json_schema_input_type=_InputField)]
    instructions: str | None = Field(None, description="A system message in front of input.")
    max_output_tokens: Annotated[int, Field(ge=1, json_schema_extra=limit(MAX_TOKENS)), WHOLE] | None = Field(
        None, description="Omitted: the room left after the input."
    )
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_CHAT_TOP_LOGPROBS), WHOLE] | None = None
    include: list[_INCLUDABLE] | None = Field(
        None,
        description=f'"{LOGPROBS_INCLUDE}" returns logprobs (top_logprobs alternatives each); the others add nothing.',
    )
    text: TextConfig | None = None
    stream: bool = False
    stream_options: ResponsesStreamOptions | None = None
    store: bool | None = Field(None, description="Accepted; nothing is stored (the response says store: false).")
    background: Literal[False] | None = None
    previous_response_id: Annotated[None, PlainValidator(_nothing_stored, json_schema_input_type=None)] = Field(
        None, description="Nothing is stored, so only null: send the whole conversation in input."
    )
    metadata: dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]] | None = Field(
        None, max_length=16
    )
    user: str | None = None
    tools: list[_Tool] = Field(default_factory=list)
    tool_choice: Annotated[ToolChoice, PlainValidator(_tool_choice, json_schema_input_type=ToolChoice)] = "auto"
    parallel_tool_calls: bool = True
    truncation: Literal["disabled"] | None = Field(None, description="An input over the context is a 400, never cut.")
    reasoning: Annotated[None, PlainValidator(_no_reasoning, json_schema_input_type=None)] = None

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice_names_a_tool(
        cls, value: str | ResponsesToolChoice, info: ValidationInfo
    ) -> str | ResponsesToolChoice:
        # tools is declared first, so it is already validated (absent from data if invalid).
        tools = info.data.get("tools", [])
        if value == "required" and not tools:
            raise ValueError('"required" needs tools')
        if isinstance(value, ResponsesToolChoice) and value.name not in {t.name for t in tools}:
            raise ValueError(f"names function {value.name!r}, which is not among tools")
        return value

    @property
    def n(self) -> int:
        return 1  # one answer per request: the Responses API has no n

    @property
    def logprobs(self) -> int | None:
        """Alternatives per token when the output text's logprobs are asked for; else None."""
        if self.include is None or LOGPROBS_INCLUDE not in self.include:
            return None
        return self.top_logprobs or 0

    def requested_max_tokens(self) -> tuple[str, int | None]:
        return "max_output_tokens", self.max_output_tokens

    def structured_spec(self) -> StructuredSpec | None:
        fmt = self.text.format if self.text is not None else None
        if isinstance(fmt, TextFormatJsonObject):
            return StructuredSpec.json_object(param="text.format")
        if isinstance(fmt, TextFormatJsonSchema):
            return StructuredSpec.json_schema(fmt.schema_, param="text.format.schema")
        return None

    def to_sampling_params(self, defaults: SamplingParams, max_new_tokens: int) -> SamplingParams:
        changes = {
            "max_new_tokens": max_new_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "logprobs": self.logprobs,
            "structured": self.structured_spec(),
        }
        return defaults.replace(**{k: v for k, v in changes.items() if v is not None})
