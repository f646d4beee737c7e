"""Tool calling for one request: the functions it offers, what `tool_choice` asks of the reply,
and the constraint that holds the reply to it.  The public interface other endpoints reuse:

    ToolSpec                  one function (name, description, parameters, strict)
    ToolChoice                none | auto | required | one named function
    tool_constraint(...)      the StructuredSpec a reply is generated under, or None
    ToolPlan.of(...)          all of it for a chat request, checked (InvalidRequestError naming the field)

What each choice means:

    none      tools are not offered (the template renders none) and replies are not parsed
    auto      tools are offered; the model decides, and its reply is parsed for calls.  A function
              with strict=true is still held to its schema: once the model opens a call, the rest
              of the call is generated under a grammar (tool_grammar.lazy_grammar)
    required  the reply is one or more calls (one if parallel_tool_calls is false), each valid
              under its function's parameters (tool_grammar.forced_grammar), strict or not
    named     the reply is one call of that function, valid under its parameters

Parsing the reply is tool_parsers.py's; rendering tools into the prompt, tool_prompt.py's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from graphexec.errors import InvalidRequestError
from graphexec.server.tool_grammar import NO_PARAMETERS, forced_grammar, lazy_grammar
from graphexec.server.tool_parsers import ParsedReply, ToolCallFormat
from graphexec.server.tool_stream import ToolCallStream
from graphexec.structured.spec import StructuredSpec

ChoiceMode = Literal["none", "auto", "required", "function"]


@dataclass(frozen=True)
class ToolSpec:
    name: str
    description: str | None = None
    parameters: Mapping[str, Any] | None = None
    strict: bool = False

    @property
    def arguments_schema(self) -> Mapping[str, Any]:
        """The schema the arguments are held to (no parameters: an empty object)."""
        return self.parameters if self.parameters is not None else NO_PARAMETERS

    def definition(self) -> dict:
        """OpenAI's tool object, as chat templates (and the injected prompt) show it."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        if self.parameters is not None:
            function["parameters"] = dict(self.parameters)
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolChoice:
    mode: ChoiceMode
    name: str | None = None  # mode "function": the function to call

    @classmethod
    def of(cls, value: object, has_tools: bool) -> ToolChoice:
        """From a request's tool_choice (a string, a validated NamedToolChoice, or None)."""
        if value is None:
            return cls("auto" if has_tools else "none")
        if isinstance(value, str):
            return cls(value)
        return cls("function", value.function.name)


def tool_constraint(
    tools: Sequence[ToolSpec], choice: ToolChoice, parallel: bool, fmt: ToolCallFormat, *, param: str = "tool_choice"
) -> StructuredSpec | None:
    """What the reply is generated under: calls only (required, named), free text whose calls are
    held to the strict functions' schemas (auto with a strict function), or nothing."""
    if choice.mode == "none" or not tools:
        return None
    if choice.mode == "auto":
        if not any(t.strict for t in tools):
            return None
        functions = [(t.name, t.arguments_schema if t.strict else None) for t in tools]
        return StructuredSpec.lark(lazy_grammar(functions, fmt, parallel), param=param)
    chosen = [t for t in tools if choice.mode == "required" or t.name == choice.name]
    one = choice.mode == "function" or not parallel
    return StructuredSpec.lark(forced_grammar([(t.name, t.arguments_schema) for t in chosen], fmt, not one), param=param)


def check_unique_names(names: Sequence[str], field: str) -> None:
    """InvalidRequestError naming the second of two functions with one name (`field` formats
    with the tool's index: chat's nested shape and the Responses API's flat one differ)."""
    seen: dict[str, int] = {}
    for i, name in enumerate(names):
        if name in seen:
            raise InvalidRequestError(
                f"{field.format(i)}: {name!r} is already defined by tools[{seen[name]}]; names must be unique",
                param=field.format(i),
            )
        seen[name] = i


@dataclass(frozen=True)
class ToolPlan:
    """A chat request's tool calling, once its fields are checked."""

    tools: tuple[ToolSpec, ...]
    choice: ToolChoice
    parallel: bool
    format: ToolCallFormat
    # Where tool i's parameters sit in the request (chat's nested shape; the Responses API's is flat).
    parameters_field: str = "tools[{}].function.parameters"

    @classmethod
    def of(cls, body, fmt: ToolCallFormat) -> ToolPlan | None:
        """From a validated ChatCompletionRequest (its ToolFields); None without tools.
        InvalidRequestError for two functions of one name, naming the second."""
        if not body.tools:
            return None
        check_unique_names([t.function.name for t in body.tools], "tools[{}].function.name")
        specs = tuple(
            ToolSpec(t.function.name, t.function.description, t.function.parameters, bool(t.function.strict))
            for t in body.tools
        )
        return cls(specs, ToolChoice.of(body.tool_choice, True), body.parallel_tool_calls, fmt)

    @property
    def offered(self) -> bool:
        """Whether the prompt shows the tools and the reply is read for calls."""
        return self.choice.mode != "none"

    @property
    def names(self) -> frozenset[str]:
        return frozenset(t.name for t in self.tools)

    @property
    def max_calls(self) -> int | None:
        """Calls a reply may make: one without parallel calls (more are read as text)."""
        return None if self.parallel else 1

    def parse(self, text: str) -> ParsedReply:
        """A whole reply read for calls of this request's functions."""
        return self.format.parse(text, self.names, self.max_calls)

    def stream(self) -> ToolCallStream:
        """A reader for one streamed reply, reading as `parse` does."""
        return ToolCallStream(self.format, self.names, self.max_calls)

    def constraint(self) -> StructuredSpec | None:
        param = "tools" if self.choice.mode == "auto" else "tool_choice"
        return tool_constraint(self.tools, self.choice, self.parallel, self.format, param=param)

    def parameter_specs(self) -> list[StructuredSpec]:
        """Each function's parameters as a JSON-schema constraint, to check that it compiles
        (the engine's grammar cache reports a bad one naming tools[i].function.parameters)."""
        return [
            StructuredSpec.json_schema(dict(t.parameters), param=self.parameters_field.format(i))
            for i, t in enumerate(self.tools)
            if t.parameters is not None
        ]

    def with_constraint(self, structured: StructuredSpec | None) -> StructuredSpec | None:
        """The reply's one constraint: this plan's, or the request's response_format (or guided_*),
        not both (InvalidRequestError naming the field of the second)."""
        own = self.constraint()
        if own is None:
            return structured
        if structured is not None:
            raise InvalidRequestError(
                f"{structured.param}: cannot be combined with a constrained tool call ({own.param}: "
                f"tool_choice {self.choice.mode!r}{' with a strict function' if self.choice.mode == 'auto' else ''})",
                param=structured.param,
            )
        return own
