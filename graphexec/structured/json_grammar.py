"""The llguidance grammar a JSON schema compiles from: one line, ", " and ": " separators, and with
`strict`, no object property or array item the schema does not name.

llguidance follows JSON Schema, where an object takes properties beyond those it names and an
array with prefixItems takes more items, unless the schema says otherwise; strict output closes
them: every object schema with properties or patternProperties and no additionalProperties gets
additionalProperties false, every prefixItems without items gets items false.  An object schema
naming nothing ({"type": "object"}) stays any object.  llguidance intersects the members of an allOf
with each other and with their parent, so closing any of them would refuse the properties the others
name: a schema with several allOf members, and those members, stay open (the schemas inside them
are still closed).

Keywords llguidance does not implement (uniqueItems, not, if/then/else, unknown formats, ...) are
ignored by default ("lenient"), as OpenAI-compatible servers commonly do: the output still has the
schema's structure, and a client's pydantic-made schema is not refused for one decorative keyword.
The schema's own top-level "x-guidance" options still apply ("lenient": false turns those keywords
into a 400 naming them), except the formatting ones.

`lark_json` gives the same JSON as a %json{...} item of a Lark grammar, for grammars that embed
JSON in other text (tool calls: graphexec/server/tool_grammar.py).  llguidance is imported only to
compile, so building such a grammar's text needs none.
"""

from __future__ import annotations

import json

# Compact, one-line JSON; llguidance's default is any whitespace between tokens.  Applied over any
# x-guidance options the schema carries, so every reply is formatted the same way (JSON text: an
# immutable constant).
_FORMAT = json.dumps({"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "})

# Keywords whose value is one schema, a list of schemas, or a map of name -> schema.
_ONE_SCHEMA = ("additionalProperties", "items", "not", "if", "then", "else", "contains", "propertyNames")
_SCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems", "items")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def json_schema_grammar(schema: str, *, strict: bool) -> str:
    """The llguidance grammar for a JSON value valid under `schema` (JSON text of an object)."""
    import llguidance  # here: lark_json, for grammars built outside the engine, needs only json

    value = _prepared(json.loads(schema), strict=strict)
    return llguidance.LLMatcher.grammar_from_json_schema(value, overrides=_FORMAT)


def lark_json(schema: dict, *, strict: bool) -> str:
    """`%json{...}`: `schema` embedded in a Lark grammar (StructuredSpec.lark), formatted and closed
    as json_schema_grammar does; inside Lark the format travels in the schema's x-guidance."""
    value = _prepared(json.loads(json.dumps(schema)), strict=strict)  # a deep copy: closed in place
    value["x-guidance"] |= json.loads(_FORMAT)
    return "%json " + json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _prepared(value: dict, *, strict: bool) -> dict:
    """`value` (modified in place) lenient unless it says otherwise, and closed when `strict`."""
    if isinstance(value.get("x-guidance"), dict):
        value["x-guidance"] = {"lenient": True, **value["x-guidance"]}
    else:
        value["x-guidance"] = {"lenient": True}
    if strict:
        _close(value)
    return value


def _close(schema: object, *, merged: bool = False) -> None:
    """Close `schema` and every schema inside it, in place (see the module docstring); `merged`: it
    is one of several allOf members."""
    if not isinstance(schema, dict):
        return
    for key in _ONE_SCHEMA:
        if isinstance(schema.get(key), dict):
            _close(schema[key])
    for key in _SCHEMA_LISTS:
        if isinstance(schema.get(key), list):
            for inner in schema[key]:
                _close(inner)
    for key in _SCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            for inner in schema[key].values():
                _close(inner)
    members = schema.get("allOf")
    several = isinstance(members, list) and len(members) > 1
    for member in members if isinstance(members, list) else ():
        _close(member, merged=several)
    if merged or several:
        return
    if "properties" in schema or "patternProperties" in schema:
        schema.setdefault("additionalProperties", False)
    if "prefixItems" in schema:
        schema.setdefault("items", False)
