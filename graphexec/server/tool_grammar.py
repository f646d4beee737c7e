"""The grammars that hold tool calls to their functions' schemas, in llguidance's Lark dialect
(compiled by the engine's grammar cache like any StructuredSpec).

A call is written as its format writes it (tool_parsers.py), so the constrained text is read
back by the same parser as a free one:

    hermes  <tool_call>\\n{"name": "<one of the functions>", "arguments": <its schema>}\\n</tool_call>
    llama3  {"name": "<one of the functions>", "parameters": <its schema>}

`forced_grammar`: the reply is calls and nothing else (tool_choice "required" or a named
function): one call, or with parallel calls allowed and a format that has a separator (hermes),
one to MAX_PARALLEL_CALLS joined by it.  `lazy_grammar` (tool_choice "auto" with a strict function): free text,
but once the model opens a call (hermes: writes <tool_call>, anywhere; llama3: starts the reply
with "{") the call is held to the grammar; the newlines around a hermes call are optional there.
Each function's arguments are one %json embedding of its own schema (so "$ref": "#/$defs/..."
resolves as in the schema alone), formatted and closed as response_format's JSON is; a function
the grammar does not hold to its schema (not strict, under auto) takes any JSON object.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from graphexec.server.tool_parsers import ToolCallFormat
from graphexec.structured.json_grammar import lark_json

# Calls per reply when several are allowed: a small model sampled at high temperature can keep
# adding calls until max_tokens cuts the last one; the bound keeps the reply whole.
MAX_PARALLEL_CALLS = 8
# Any JSON object: the arguments of a function held only to the call's shape.
_ANY_OBJECT = {"type": "object"}
# No arguments: a function without `parameters` (closed: strict output admits only {}).
NO_PARAMETERS = {"type": "object", "properties": {}}


def forced_grammar(functions: Sequence[tuple[str, dict]], fmt: ToolCallFormat, parallel: bool) -> str:
    """Calls only: `functions` are (name, arguments schema) the call may choose from."""
    call = f"{_literal(fmt.begin)} {_alternatives(functions)} {_literal(fmt.end)}".strip()
    several = parallel and fmt.separator is not None
    start = f"call ({_literal(fmt.separator)} call){{0,{MAX_PARALLEL_CALLS - 1}}}" if several else "call"
    return "\n".join(["%llguidance {}", f"start: {start}", f"call: {call}", *_function_rules(functions, fmt)])


def lazy_grammar(functions: Sequence[tuple[str, dict | None]], fmt: ToolCallFormat, parallel: bool = True) -> str:
    """Free text with calls held to `functions` ((name, schema), or None for any object); without
    `parallel` only the first call is held (a later one is text to the parser too)."""
    held = [(name, schema if schema is not None else _ANY_OBJECT) for name, schema in functions]
    if fmt.trigger is None:  # the call is the whole reply, after optional whitespace
        lines = [
            "start: TEXT | call | WS call",
            f"call: {_alternatives(held)}",
            "WS: /\\s+/",
            "TEXT: /\\s*([^\\s{](.|\\n)*)?/",  # empty, blank, or not a call: its first non-blank is not "{"
        ]
    else:
        opening = fmt.begin[len(fmt.trigger) :]
        lines = [
            f"start: tagged{'*' if parallel else '?'} TEXT",
            f"tagged: trigger {_optional(opening)} {_alternatives(held)} {_optional(fmt.end[: -len(fmt.close_tag)])} "
            f"{_literal(fmt.close_tag)}",
            f"trigger[lazy]: TEXT {_literal(fmt.trigger)}",
            "TEXT: /(.|\\n)*/",
        ]
    return "\n".join(["%llguidance {}", *lines, *_function_rules(held, fmt)])


def _function_rules(functions: Sequence[tuple[str, dict]], fmt: ToolCallFormat) -> list[str]:
    """fn_i: the literal head naming function i, its arguments' %json, the closing brace."""
    rules = []
    for i, (name, schema) in enumerate(functions):
        head = "{" + json.dumps("name") + ": " + json.dumps(name, ensure_ascii=False) + ", " + json.dumps(fmt.arguments_key) + ": "
        strict = schema is not _ANY_OBJECT
        rules.append(f"fn_{i}: {_literal(head)} {lark_json(schema, strict=strict)} {_literal('}')}")
    return rules


def _alternatives(functions: Sequence[tuple[str, dict]]) -> str:
    return "(" + " | ".join(f"fn_{i}" for i in range(len(functions))) + ")"


def _literal(text: str) -> str:
    """A Lark string literal (llguidance reads it as a JSON string); empty text is no item."""
    return json.dumps(text, ensure_ascii=False) if text else ""


def _optional(text: str) -> str:
    return f"{_literal(text)}?" if text else ""
