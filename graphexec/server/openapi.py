"""The schema /openapi.json and /docs publish: FastAPI's (the routes, their documented answers and
the request models of protocol.py and tokenize.py), finished with what only the running app knows:

    access   with keys configured (auth.Access): a bearer security scheme, and `security` and a
             401 answer on every operation whose path needs a key, a 403 on admin paths
    limits   the values of the bounds that the request models mark with `limit(NAME)` but cannot
             know: the served model's name, its vocabulary and context, server.max_n, ...

so that a body the schema admits is one the server takes, and the reverse, as far as JSON Schema
can say it.  What it cannot (one field bounded by another, a text prompt's length in tokens, a
grammar that does not compile) stays a 400 naming the field.  The steps run once, when the schema
is first asked for; FastAPI keeps the result.  Nothing here validates a request.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fastapi import FastAPI

from graphexec.server.auth import Access
from graphexec.server.errors import ErrorResponse

if TYPE_CHECKING:
    from graphexec.engine.engine import Engine
    from graphexec.server.config import ServerConfig

# The marker a request model leaves on a schema node whose bound is the app's; `document_limits`
# replaces it with JSON Schema keywords.
LIMIT_KEY = "x-graphexec-limit"
MODEL = "model"  # a string: the served model's name
TOKEN_ID = "token_id"  # an integer: below the vocabulary size
TOKEN_ID_KEY = "token_id_key"  # a string: a token id as a JSON key (logit_bias)
PROMPT_TOKENS = "prompt_tokens"  # a list of token ids as one prompt: room left for a token
PROMPT_TEXT = "prompt_text"  # a text prompt: non-empty where "" encodes to no token
PROMPTS = "prompts"  # a list of prompts: server.max_prompts_per_request at most
CHOICES = "choices"  # n: server.max_n at most
MAX_TOKENS = "max_tokens"  # room after a one-token prompt, unless server.clamp_max_tokens
MIN_TOKENS = "min_tokens"  # room after a one-token prompt

BEARER = "bearer"  # the security scheme's name
_HTTP_METHODS = frozenset({"get", "put", "post", "delete", "options", "head", "patch", "trace"})
_SCHEMAS_REF = "#/components/schemas/{model}"

# The text of the request examples; an example's `tokens` become its ids under the served tokenizer.
EXAMPLE_TEXT = "Hello, world"

SchemaStep = Callable[[dict], None]


def limit(name: str) -> dict[str, str]:
    """`json_schema_extra` for a field (or type) whose bound `document_limits` fills in."""
    return {LIMIT_KEY: name}


@dataclass(frozen=True)
class ServedLimits:
    """The facts of one app that bound its requests (the values of the `limit` markers)."""

    model: str
    vocab_size: int
    max_request_tokens: int  # prompt + completion (limits.TokenBound): the context, or the KV pool
    clamp_max_tokens: bool
    max_n: int
    max_prompts: int
    empty_text_has_tokens: bool  # whether "" encodes to a token (a BOS)
    example_ids: tuple[int, ...]  # EXAMPLE_TEXT's token ids, for the request examples

    @classmethod
    def of(cls, engine: Engine, config: ServerConfig) -> ServedLimits:
        tokenizer = engine.tokenizer
        return cls(
            model=engine.config.model.name,
            vocab_size=engine.model_config.vocab_size,
            max_request_tokens=engine.max_request_tokens,
            clamp_max_tokens=config.clamp_max_tokens,
            max_n=config.max_n,
            max_prompts=config.max_prompts_per_request,
            empty_text_has_tokens=tokenizer is not None and bool(tokenizer.encode("")),
            example_ids=tuple(tokenizer.encode(EXAMPLE_TEXT)) if tokenizer is not None else (),
        )

    def keywords(self) -> dict[str, dict]:
        """JSON Schema keywords per marker name."""
        # The most a prompt may hold (a token's room left), and the room a one-token prompt leaves.
        room = self.max_request_tokens - 1
        return {
            MODEL: {"enum": [self.model]},
            TOKEN_ID: {"maximum": self.vocab_size - 1},
            TOKEN_ID_KEY: {"pattern": f"^0*{decimal_below(self.vocab_size)}$"},
            PROMPT_TOKENS: {"maxItems": room},
            PROMPT_TEXT: {} if self.empty_text_has_tokens else {"minLength": 1},
            PROMPTS: {"maxItems": self.max_prompts},
            CHOICES: {"maximum": self.max_n},
            # Clamped, any max_tokens is served (as the room left).
            MAX_TOKENS: {} if self.clamp_max_tokens else {"maximum": room},
            MIN_TOKENS: {"maximum": room},
        }


def publish(app: FastAPI, *steps: SchemaStep) -> None:
    """`app.openapi` (what /openapi.json and /docs serve): FastAPI's schema finished by `steps`."""
    build = app.openapi  # FastAPI's: builds the schema once and keeps it in app.openapi_schema

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = build()
            for step in steps:
                step(schema)
        return app.openapi_schema

    app.openapi = openapi


def document_access(schema: dict, access: Access) -> None:
    """The bearer scheme, `security` and 401/403 answers where `access` asks for a key, and none
    anywhere else (so a data-parallel front can re-document its replicas' schema by its own rules)."""
    components = schema.setdefault("components", {})
    schemes = components.setdefault("securitySchemes", {})
    schemes.pop(BEARER, None)
    if access.keys_required:
        schemes[BEARER] = {
            "type": "http",
            "scheme": "bearer",
            "description": "An API key of this server (server.api_key, GRAPHEXEC_API_KEY or server.api_key_file); "
            "admin routes need an admin key",
        }
        _add_error_schemas(components)
    if not schemes:
        del components["securitySchemes"]
    for path, item in schema.get("paths", {}).items():
        for method, operation in item.items():
            if method in _HTTP_METHODS:
                _document_operation_access(operation, access.protects(path), access.needs_admin(path))


def document_limits(schema: dict, limits: ServedLimits) -> None:
    """Every `limit` marker in `schema` replaced by its keywords for `limits`, and the request
    examples made the served model's: its name, token ids of its vocabulary."""
    keywords = limits.keywords()

    def fill(node: object) -> None:
        if isinstance(node, dict):
            name = node.pop(LIMIT_KEY, None)
            if name is not None:
                node.update(keywords[name])
            for child in node.values():
                fill(child)
        elif isinstance(node, list):
            for child in node:
                fill(child)

    fill(schema)
    for definition in schema.get("components", {}).get("schemas", {}).values():
        for example in definition.get("examples", ()):
            if "model" in example:
                example["model"] = limits.model
            if "tokens" in example:
                example["tokens"] = list(limits.example_ids)


def decimal_below(limit: int) -> str:
    """A regex group matching the decimal integers in [0, `limit`), without leading zeros."""
    top = str(limit - 1)
    width = len(top)
    forms = []
    if width > 1:
        forms.append("[0-9]")  # the shorter numbers: one digit,
    if width > 2:
        forms.append("[1-9]" + (f"[0-9]{{1,{width - 2}}}" if width > 3 else "[0-9]"))  # up to width - 1
    for i, digit in enumerate(top):  # then those as long as top: top's first i digits, a smaller one, any
        lowest = 1 if i == 0 and width > 1 else 0
        if int(digit) > lowest:
            forms.append(top[:i] + _digits(lowest, int(digit) - 1) + _any_digits(width - i - 1))
    forms.append(top)
    return "(?:" + "|".join(forms) + ")"


def _digits(low: int, high: int) -> str:
    return str(low) if low == high else f"[{low}-{high}]"


def _any_digits(count: int) -> str:
    return "" if count == 0 else "[0-9]" if count == 1 else f"[0-9]{{{count}}}"


def _document_operation_access(operation: dict, protected: bool, admin: bool) -> None:
    responses = operation.setdefault("responses", {})
    # Only access documents these here: cleared first, so documenting twice (a front) is exact.
    operation.pop("security", None)
    responses.pop("401", None)
    responses.pop("403", None)
    if protected:
        operation["security"] = [{BEARER: []}]
        responses["401"] = _error_response(
            "No API key (`Authorization: Bearer <key>`), or not one this server takes", 'Bearer realm="graphexec"'
        )
    if admin:
        responses["403"] = _error_response(
            "A user key: this route needs an admin key (server.admin_api_key)",
            'Bearer realm="graphexec", error="insufficient_scope"',
        )


def _error_response(description: str, challenge: str) -> dict:
    return {
        "description": description,
        "headers": {"WWW-Authenticate": {"description": f"`{challenge}`", "schema": {"type": "string"}}},
        "content": {"application/json": {"schema": {"$ref": _SCHEMAS_REF.format(model="ErrorResponse")}}},
    }


def _add_error_schemas(components: dict) -> None:
    """ErrorResponse and ErrorBody among the components, where no route put them already."""
    schemas = components.setdefault("schemas", {})
    error = ErrorResponse.model_json_schema(ref_template=_SCHEMAS_REF)
    for name, definition in error.pop("$defs", {}).items():
        schemas.setdefault(name, definition)
    schemas.setdefault("ErrorResponse", error)
