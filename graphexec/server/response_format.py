"""The request fields that constrain the output's shape, and their translation to a StructuredSpec.

OpenAI's `response_format` (`text`, `json_object`, `json_schema`) and vLLM's extensions
`guided_json`, `guided_regex` and `guided_choice`; at most one constraint per request.  Shapes
are checked here (a 400 naming the field); whether a schema or regex compiles is checked when
the server prepares the request (Engine.prepare_grammar), against the same field name.
"""

from __future__ import annotations

from itertools import combinations
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from graphexec.errors import InvalidRequestError
from graphexec.structured.spec import MAX_CHOICES, MAX_SPEC_CHARS, StructuredSpec

_SCHEMA_PARAM = "response_format.json_schema.schema"


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)

    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    # `schema` would shadow BaseModel.schema; the JSON field keeps OpenAI's name.
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    # Output is always held to the schema; strict=false is accepted and changes nothing.
    strict: bool | None = None


class ResponseFormat(BaseModel):
    # The schema says what `_schema_iff_json_schema` checks.
    model_config = ConfigDict(
        extra="forbid",
        strict=True,
        json_schema_extra={
            "anyOf": [
                {
                    "properties": {"type": {"const": "json_schema"}, "json_schema": {"type": "object"}},
                    "required": ["json_schema"],
                },
                {"properties": {"type": {"enum": ["text", "json_object"]}, "json_schema": {"type": "null"}}},
            ]
        },
    )

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_iff_json_schema(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError('json_schema is required with type "json_schema", and only with it')
        return self


_CONSTRAINTS = ("response_format", "guided_json", "guided_regex", "guided_choice")


def _given(name: str) -> dict:
    """JSON Schema: the request sets output constraint `name` (a response_format other than text)."""
    if name == "response_format":
        value = {"type": "object", "required": ["type"], "properties": {"type": {"enum": ["json_object", "json_schema"]}}}
    else:
        value = {"not": {"type": "null"}}
    return {"required": [name], "properties": {name: value}}


def constraint_given() -> dict:
    """JSON Schema: the request sets some output constraint (tool_protocol's rules use it)."""
    return {"anyOf": [_given(name) for name in _CONSTRAINTS]}


# For the request models' schemas, as JSON Schema's `not`: what `structured_spec` refuses (two
# constraints at once) and SamplingParams (a constraint with ignore_eos: the grammar decides the end).
CONSTRAINT_RULES = [
    {"not": {"anyOf": [{"allOf": [_given(a), _given(b)]} for a, b in combinations(_CONSTRAINTS, 2)]}},
    {
        "not": {
            "allOf": [
                {"required": ["ignore_eos"], "properties": {"ignore_eos": {"const": True}}},
                {"anyOf": [_given(name) for name in _CONSTRAINTS]},
            ]
        }
    },
]


class StructuredOutputFields(BaseModel):
    """Mixed into the completion and chat request bodies (whose schemas add CONSTRAINT_RULES).
    The bounds are StructuredSpec's, so that a body the schema admits is not refused there."""

    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = Field(None, min_length=1, max_length=MAX_SPEC_CHARS)
    guided_choice: Annotated[
        list[Annotated[str, Field(min_length=1)]], Field(min_length=1, max_length=MAX_CHOICES)
    ] | None = None

    def structured_spec(self) -> StructuredSpec | None:
        """The constraint these fields ask for; InvalidRequestError naming the field if malformed."""
        given = [name for name in ("guided_json", "guided_regex", "guided_choice") if getattr(self, name) is not None]
        if self.response_format is not None and self.response_format.type != "text":
            given.insert(0, "response_format")
        if len(given) > 1:
            raise InvalidRequestError(
                f"{given[1]}: at most one output constraint per request, got {' and '.join(given)}", param=given[1]
            )
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            return StructuredSpec.json_object(param="response_format")
        if fmt is not None and fmt.type == "json_schema":
            return StructuredSpec.json_schema(fmt.json_schema.schema_, param=_SCHEMA_PARAM)
        if self.guided_json is not None:
            return StructuredSpec.json_schema(self.guided_json, param="guided_json")
        if self.guided_regex is not None:
            return StructuredSpec.regex(self.guided_regex, param="guided_regex")
        if self.guided_choice is not None:
            return StructuredSpec.choice(self.guided_choice, param="guided_choice")
        return None
