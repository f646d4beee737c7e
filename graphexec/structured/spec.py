"""What a request's output must match, validated when the request's SamplingParams are built.

Only the shape is checked here (types, sizes, JSON-serialisable schema); whether llguidance can
compile the schema or regex is found when the engine compiles it at submission
(grammar_cache.py), and reported against the same `param`.  No llguidance import: every
SamplingParams imports this module.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from graphexec.errors import InvalidRequestError

# "lark": a grammar in llguidance's Lark dialect, built by graphexec itself (tool calls:
# graphexec/server/tool_grammar.py), never taken from a request as text.
KINDS = ("json_object", "json_schema", "regex", "choice", "lark")

# A schema or regex is compiled on a worker thread and its grammar cached; these bound what one
# request can make the engine hold or spend there.
MAX_SPEC_CHARS = 64 * 1024
MAX_CHOICES = 256


@dataclass(frozen=True)
class StructuredSpec:
    """One constraint.  `value` is the canonical text the grammar is compiled from (the schema as
    compact JSON in the caller's key order, since llguidance emits properties in that order; the
    regex; the choices as a JSON list; the Lark grammar) and, with `kind`, the grammar cache's
    key.  `param` names the request field it came from, for error messages; it takes no part in
    equality."""

    kind: str
    value: str = ""
    param: str = field(default="structured", compare=False)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidRequestError(f"{self.param}: kind must be one of {', '.join(KINDS)}, got {self.kind!r}", param=self.param)
        if not isinstance(self.value, str):
            raise InvalidRequestError(f"{self.param}: value must be a string, got {type(self.value).__name__}", param=self.param)
        if len(self.value) > MAX_SPEC_CHARS:
            raise InvalidRequestError(f"{self.param}: at most {MAX_SPEC_CHARS} characters, got {len(self.value)}", param=self.param)
        if self.kind == "json_object" and self.value:
            raise InvalidRequestError(f"{self.param}: json_object takes no value", param=self.param)
        if self.kind != "json_object" and not self.value:
            raise InvalidRequestError(f"{self.param}: {self.kind} needs a non-empty value", param=self.param)

    @property
    def key(self) -> tuple[str, str]:
        return self.kind, self.value

    @classmethod
    def json_object(cls, *, param: str = "structured") -> StructuredSpec:
        """Any JSON object."""
        return cls("json_object", "", param)

    @classmethod
    def json_schema(cls, schema: Mapping | str, *, param: str = "structured") -> StructuredSpec:
        """A JSON value valid under `schema` (a dict, or its JSON text)."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as error:
                raise InvalidRequestError(f"{param}: the schema is not valid JSON: {error}", param=param) from None
        if not isinstance(schema, Mapping):
            raise InvalidRequestError(f"{param}: the schema must be a JSON object, got {type(schema).__name__}", param=param)
        try:
            text = json.dumps(schema, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
        except (TypeError, ValueError) as error:
            raise InvalidRequestError(f"{param}: the schema is not JSON-serialisable: {error}", param=param) from None
        return cls("json_schema", text, param)

    @classmethod
    def regex(cls, pattern: str, *, param: str = "structured") -> StructuredSpec:
        if not isinstance(pattern, str):
            raise InvalidRequestError(f"{param}: the regex must be a string, got {type(pattern).__name__}", param=param)
        return cls("regex", pattern, param)

    @classmethod
    def choice(cls, choices: Sequence[str], *, param: str = "structured") -> StructuredSpec:
        """Exactly one of `choices`."""
        if isinstance(choices, str) or not isinstance(choices, Sequence):
            raise InvalidRequestError(f"{param}: must be a list of strings", param=param)
        if not 1 <= len(choices) <= MAX_CHOICES:
            raise InvalidRequestError(f"{param}: must hold 1 to {MAX_CHOICES} strings, got {len(choices)}", param=param)
        for i, choice in enumerate(choices):
            if not isinstance(choice, str) or not choice:
                raise InvalidRequestError(f"{param}[{i}]: must be a non-empty string, got {choice!r}", param=param)
        return cls("choice", json.dumps(list(choices), ensure_ascii=False), param)

    @classmethod
    def lark(cls, grammar: str, *, param: str = "structured") -> StructuredSpec:
        """Text matching a Lark grammar (llguidance's dialect: %json{...} embeds a JSON schema, lazy
        rules let free text run until a trigger).  For grammars graphexec writes; `param` names
        the request field the grammar was made from."""
        if not isinstance(grammar, str):
            raise InvalidRequestError(f"{param}: the grammar must be a string, got {type(grammar).__name__}", param=param)
        return cls("lark", grammar, param)
