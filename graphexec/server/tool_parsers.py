"""Tool calls as chat formats write them: reading a reply's text back into calls, and writing past
calls into a conversation for templates that know nothing of tools.

Two formats (`server.tool_parser`; `auto` picks one from the chat template, `resolve_format`):

    hermes  <tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>, any number of them
            with text around (Hermes 2 Pro, Qwen 2.5/3, and the prompt graphexec injects into
            templates that ignore tools)
    llama3  the whole reply is one JSON object {"name": ..., "parameters": {...}} ("arguments"
            also read), optionally after <|python_tag|>; several are separated by ";"

A call that does not parse (bad JSON, no name, arguments not an object, a function the request
did not offer) is not a call: its text stays in `content`, so a model's malformed attempt reaches
the client as text, never as an error.  So do calls past `max_calls` (parallel_tool_calls=false:
one): a tagged format's later blocks stay text, and a whole reply holding more is all text.  This module knows no request, template or engine.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Collection
from dataclasses import dataclass, field

FORMATS = ("hermes", "llama3")
PARSER_OPTIONS = ("auto", *FORMATS)  # server.tool_parser

# What marks a Llama 3 template (its tool turns are "ipython"; built-in tools start <|python_tag|>).
_LLAMA3_MARKS = ("<|python_tag|>", "ipython")
PYTHON_TAG = "<|python_tag|>"


def new_call_id() -> str:
    """OpenAI's shape: "call_" and 24 random characters."""
    return "call_" + secrets.token_hex(12)


@dataclass(frozen=True)
class ToolCall:
    """One call of a reply: `arguments` is the JSON text of an object (OpenAI sends a string)."""

    name: str
    arguments: str
    id: str = field(default_factory=new_call_id)

    def as_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ParsedReply:
    """A reply split into its text and its calls.  Without calls, `content` is the text as
    generated; with calls, it is the text around them, or None if that is only whitespace."""

    content: str | None
    calls: tuple[ToolCall, ...] = ()


def call_from_json(text: str, names: Collection[str] | None, keys: tuple[str, ...]) -> ToolCall | None:
    """The call `text` holds ({"name": ..., <key>: {...}} for the first of `keys` present), or None."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return _call_from_value(value, names, keys)


def _call_from_value(value: object, names: Collection[str] | None, keys: tuple[str, ...]) -> ToolCall | None:
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    if names is not None and value["name"] not in names:
        return None
    key = next((k for k in keys if k in value), None)
    arguments = {} if key is None else value[key]
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))


def _arguments_value(arguments: str) -> object:
    """A past call's arguments as the object they encode (templates print them with tojson)."""
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


@dataclass(frozen=True)
class ToolCallFormat:
    """How one chat format writes calls.  `begin`/`end` wrap each call (hermes), `trigger` is the
    text that opens a call anywhere in a reply (None: a call is the whole reply, llama3), and
    `separator` joins several calls (None: one call per reply when graphexec constrains it)."""

    name: str
    arguments_key: str
    begin: str
    end: str
    trigger: str | None
    separator: str | None
    instructions: str

    @property
    def close_tag(self) -> str:
        """What closes a call opened by `trigger` ("</tool_call>")."""
        return self.end.strip()

    @property
    def keys(self) -> tuple[str, ...]:
        """The arguments' keys read, the format's own first."""
        return (self.arguments_key, *(k for k in ("arguments", "parameters") if k != self.arguments_key))

    def parse(self, text: str, names: Collection[str] | None = None, max_calls: int | None = None) -> ParsedReply:
        """`text` split into content and calls; `names`: the functions offered (None: any);
        `max_calls`: how many calls a reply may make (None: any number)."""
        if self.trigger:
            return _parse_tagged(self, text, names, max_calls)
        return _parse_whole(self, text, names, max_calls)

    def parse_block(self, inner: str, names: Collection[str] | None) -> ToolCall | None:
        """One call from the text between `begin` and `end` (a tagged format's block)."""
        return call_from_json(inner.strip(), names, self.keys)

    def call_text(self, name: str, arguments: str) -> str:
        """A past call as this format writes it, for a template that does not render tool calls."""
        call = json.dumps({"name": name, self.arguments_key: _arguments_value(arguments)}, ensure_ascii=False)
        return self.begin + call + self.end

    def calls_text(self, calls: list[tuple[str, str]]) -> str:
        return (self.separator or "; ").join(self.call_text(name, arguments) for name, arguments in calls)


def _parse_tagged(fmt: ToolCallFormat, text: str, names: Collection[str] | None, max_calls: int | None) -> ParsedReply:
    pattern = re.compile(re.escape(fmt.trigger) + "(.*?)" + re.escape(fmt.close_tag), re.DOTALL)
    calls, outside, last = [], [], 0
    for match in pattern.finditer(text):
        call = fmt.parse_block(match.group(1), names) if max_calls is None or len(calls) < max_calls else None
        if call is None:
            continue  # stays in the content, as written
        outside.append(text[last : match.start()])
        last = match.end()
        calls.append(call)
    if not calls:
        return ParsedReply(text)
    outside.append(text[last:])
    content = "".join(outside)
    return ParsedReply(content if content.strip() else None, tuple(calls))


def _parse_whole(fmt: ToolCallFormat, text: str, names: Collection[str] | None, max_calls: int | None) -> ParsedReply:
    body = text.strip().removeprefix(PYTHON_TAG).strip()
    decoder, calls = json.JSONDecoder(), []
    while body.startswith("{"):
        try:
            value, at = decoder.raw_decode(body)
        except ValueError:
            return ParsedReply(text)
        call = _call_from_value(value, names, fmt.keys)
        if call is None:
            return ParsedReply(text)
        calls.append(call)
        rest = body[at:].lstrip()
        if max_calls is not None and len(calls) > max_calls:
            return ParsedReply(text)
        if not rest:
            return ParsedReply(None, tuple(calls))
        if not rest.startswith(";"):
            return ParsedReply(text)
        body = rest[1:].lstrip()
    return ParsedReply(text)


HERMES = ToolCallFormat(
    name="hermes",
    arguments_key="arguments",
    begin="<tool_call>\n",
    end="\n</tool_call>",
    trigger="<tool_call>",
    separator="\n",
    instructions=(
        "To call a function, reply with its name and arguments as one JSON object between <tool_call> and "
        "</tool_call> tags, one pair of tags per call:\n"
        '<tool_call>\n{"name": <function name>, "arguments": <the arguments as a JSON object>}\n</tool_call>'
    ),
)

LLAMA3 = ToolCallFormat(
    name="llama3",
    arguments_key="parameters",
    begin="",
    end="",
    trigger=None,
    separator=None,
    instructions=(
        "To call a function, reply with nothing but one JSON object of the form "
        '{"name": <function name>, "parameters": <the arguments as a JSON object>}.'
    ),
)

_BY_NAME = {fmt.name: fmt for fmt in (HERMES, LLAMA3)}


def resolve_format(option: str, chat_template: str | None) -> ToolCallFormat:
    """The format `server.tool_parser` names; `auto`: llama3 for a template that speaks Llama 3's
    tool dialect (<|python_tag|>, the ipython role), else hermes."""
    if option != "auto":
        return _BY_NAME[option]
    if chat_template is not None and any(mark in chat_template for mark in _LLAMA3_MARKS):
        return LLAMA3
    return HERMES


def parse_tool_calls(
    text: str, fmt: ToolCallFormat, names: Collection[str] | None = None, max_calls: int | None = None
) -> ParsedReply:
    """The public entry: `text` (a whole reply) as content and calls in format `fmt`."""
    return fmt.parse(text, names, max_calls)
