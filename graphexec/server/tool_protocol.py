"""The tool-calling fields of a chat request, validated strictly (protocol.py's rules: unknown
fields refused, strict types): `tools`, `tool_choice`, `parallel_tool_calls`, and the calls an
assistant message carries in a conversation's history.

Checked here, each a 400 naming its field: a tool's type (only "function"), a function's name
(OpenAI's pattern), `parameters` that is not an object schema, `tool_choice` without `tools`, or
naming a function `tools` does not define.  Two functions of one name are refused where the
request is planned (tools.py: the message names the second), and whether a schema compiles is
checked there too, through the engine's grammar cache.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from graphexec.server.response_format import constraint_given

# OpenAI's bounds: a function's name, and how many tools one request may define.
FUNCTION_NAME_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"
MAX_TOOLS = 128


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class FunctionDefinition(_Strict):
    name: str = Field(pattern=FUNCTION_NAME_PATTERN)
    description: str | None = None
    # A JSON Schema of the arguments object; omitted: the function takes no arguments.
    parameters: dict[str, Any] | None = None
    # true: arguments are held to `parameters` whenever the model calls it, under tool_choice
    # "auto" too (README, Tool calling); false or omitted: only under "required" or a named choice.
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _object_schema(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None and value.get("type", "object") != "object":
            raise ValueError('must be a JSON Schema of an object ("type": "object"): arguments are a JSON object')
        return value


class ToolDefinition(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    """Call this function (and only it)."""

    type: Literal["function"]
    function: NamedFunction


class CalledFunction(_Strict):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class MessageToolCall(_Strict):
    """A call in an assistant message of the history (what an earlier reply returned)."""

    id: str
    type: Literal["function"]
    function: CalledFunction


def _choice_needs_tools() -> dict:
    """JSON Schema: a tool_choice other than "none" comes with `tools` (as `_tool_choice` checks)."""
    choosing = {"required": ["tool_choice"], "properties": {"tool_choice": {"not": {"enum": ["none", None]}}}}
    with_tools = {"required": ["tools"], "properties": {"tools": {"type": "array"}}}
    return {"not": {"allOf": [choosing, {"not": with_tools}]}}


def _constrained_with_response_format() -> dict:
    """JSON Schema: a constrained call (tool_choice required or named, or under auto a strict
    function) with an output constraint of response_format's kind, which ToolPlan refuses."""
    forced = {"required": ["tool_choice"], "properties": {"tool_choice": {"anyOf": [{"const": "required"}, {"type": "object"}]}}}
    strict = {"properties": {"function": {"required": ["strict"], "properties": {"strict": {"const": True}}}}}
    auto_strict = {
        "required": ["tools"],
        "properties": {"tools": {"type": "array", "contains": strict}, "tool_choice": {"enum": ["auto", None]}},
    }
    return {"not": {"allOf": [{"anyOf": [forced, auto_strict]}, constraint_given()]}}


# For ChatCompletionRequest's published schema (its `allOf`).
TOOL_RULES = [_choice_needs_tools(), _constrained_with_response_format()]


class ToolFields(BaseModel):
    """Mixed into the chat request body (whose schema adds TOOL_RULES)."""

    tools: list[ToolDefinition] | None = Field(None, min_length=1, max_length=MAX_TOOLS)
    # Omitted: "auto" with tools, "none" without (OpenAI's defaults).
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    # false: at most one call per reply.
    parallel_tool_calls: bool = True

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, value: object, info: ValidationInfo) -> object:
        # tools is declared first, so it is already validated (absent from data if invalid).
        tools = info.data.get("tools")
        if value in (None, "none"):
            return value
        if not tools:
            raise ValueError('requires tools (only "none" is allowed without them)')
        if isinstance(value, NamedToolChoice) and value.function.name not in {t.function.name for t in tools}:
            raise ValueError(f"names function {value.function.name!r}, which tools does not define")
        return value
