"""The request fields that constrain the output's shape, and their translation to a StructuredSpec.

OpenAI's `response_format` (`text`, `json_object`, `json_schema`) and vLLM's extensions
`guided_json`, `guided_regex` and `guided_choice`; at most one constraint per request.  Shapes
are checked here (a 400 naming the field); whether a schema or regex compiles is checked when
the server prepares the request (Engine.prepare_grammar), against the same field name.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from graphexec.errors import InvalidRequestError
from graphexec.structured.spec import StructuredSpec

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
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_iff_json_schema(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError('json_schema is required with type "json_schema", and only with it')
        return self


class StructuredOutputFields(BaseModel):
    """Mixed into the completion and chat request bodies."""

    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = Field(None, min_length=1)
    guided_choice: list[str] | None = Field(None, min_length=1)

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
