"""The tokenizer over HTTP, with vLLM's bodies: `GET /tokenizer_info`, `POST /tokenize`,
`POST /detokenize`.

lm-evaluation-harness's remote tokenizer (`tokenizer_backend=remote`, lm_eval 0.4.13's
`lm_eval.utils.RemoteTokenizer`) uses exactly these: it requires `eos_token` in /tokenizer_info
and reads `bos_token`, `pad_token` and `chat_template` from it; it encodes with
`{"prompt", "add_special_tokens": false}` (reading `tokens`; EOS's id is the encoding of the EOS
string, so special-token text must encode to its id) and decodes with `{"tokens"}` (reading
`prompt`).  The work runs on the server's worker thread, as every tokenization does.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import ConfigDict, Field

from graphexec.engine.engine import Engine
from graphexec.errors import InvalidRequestError
from graphexec.server.errors import bad_request, from_invalid_request, model_not_found
from graphexec.server.openapi import EXAMPLE_TEXT, MODEL, limit
from graphexec.server.protocol import ChatMessage, TokenId, _Strict
from graphexec.server.tool_prompt import ToolPrompt

# The name of the model served, or none; another is a 404.
ServedModel = Annotated[str, Field(json_schema_extra=limit(MODEL))] | None

# `TokenizeRequest` in JSON Schema: exactly one of the two given, and not null (as `tokenize` checks).
_PROMPT_OR_MESSAGES = {
    "oneOf": [
        {"required": ["prompt"], "properties": {"prompt": {"type": "string"}}},
        {"required": ["messages"], "properties": {"messages": {"type": "array"}}},
    ]
}


class TokenizeRequest(_Strict):
    """Either `prompt` (text) or `messages` (through the chat template), as vLLM's /tokenize."""

    model_config = ConfigDict(
        json_schema_extra={"examples": [{"prompt": EXAMPLE_TEXT, "add_special_tokens": False}], **_PROMPT_OR_MESSAGES}
    )

    model: ServedModel = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    # Default true for a prompt, false for messages (the template places its own), as vLLM.
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True  # messages only: end with the assistant's turn opening


class DetokenizeRequest(_Strict):
    # SmolLM2's ids of EXAMPLE_TEXT; each app publishes its own tokenizer's (openapi.document_limits).
    model_config = ConfigDict(json_schema_extra={"examples": [{"tokens": [19556, 28, 905]}]})

    model: ServedModel = None
    tokens: list[TokenId]  # in the vocabulary (the schema's bound is the app's: openapi.py)


class TokenizerEndpoints:
    """The three routes' work, given the engine (its tokenizer, vocabulary and context)."""

    def __init__(self, engine: Engine, model_name: str, tool_prompt: ToolPrompt | None = None):
        self._engine = engine
        self._model_name = model_name
        # Tool-calling histories rendered as the chat route renders them (no tools offered here).
        self._tool_prompt = tool_prompt

    def info(self) -> dict[str, Any]:
        tokenizer = self._engine.tokenizer
        eos = tokenizer.eos_token_ids if tokenizer is not None else ()
        return {
            "tokenizer_class": type(tokenizer).__name__ if tokenizer is not None else None,
            "bos_token": self._token_text(tokenizer.bos_token_id if tokenizer is not None else None),
            "eos_token": self._token_text(eos[0] if eos else None),
            "pad_token": None,  # graphexec pads with no token of the vocabulary
            "chat_template": tokenizer.chat_template if tokenizer is not None else None,
            "model_max_length": self._engine.max_context,
            "vocab_size": self._engine.model_config.vocab_size,
        }

    def tokenize(self, body: TokenizeRequest) -> dict[str, Any]:
        self._check_model(body.model)
        tokenizer = self._tokenizer()
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("prompt: give exactly one of prompt and messages", param="prompt")
        if body.prompt is not None:
            ids = tokenizer.encode(body.prompt)
            special = True if body.add_special_tokens is None else body.add_special_tokens
        else:
            messages = [m.template_dict() for m in body.messages]
            if self._tool_prompt is not None:
                messages, _ = self._tool_prompt.render(messages, None)
            try:
                text = tokenizer.apply_chat_template(messages, add_generation_prompt=body.add_generation_prompt)
            except Exception as error:  # no template (ValueError), or the template refused (jinja2)
                raise bad_request(f"messages: {error}", param="messages") from error
            ids = tokenizer.encode(text)
            special = bool(body.add_special_tokens)
        if not special:
            ids = self._without_added_bos(ids)
        return {"count": len(ids), "max_model_len": self._engine.max_context, "tokens": ids}

    def detokenize(self, body: DetokenizeRequest) -> dict[str, Any]:
        self._check_model(body.model)
        tokenizer = self._tokenizer()
        vocab = self._engine.model_config.vocab_size
        bad = next((i for i, t in enumerate(body.tokens) if not 0 <= t < vocab), None)
        if bad is not None:
            raise bad_request(f"tokens[{bad}]: token id {body.tokens[bad]} outside the vocabulary [0, {vocab})", param="tokens")
        # Special tokens kept, so that tokenize(detokenize(ids)) gives the ids back.
        return {"prompt": tokenizer.decode(body.tokens, skip_special_tokens=False)}

    def _tokenizer(self):
        tokenizer = self._engine.tokenizer
        if tokenizer is None:
            raise from_invalid_request(
                InvalidRequestError(f"model {self._model_name!r} has no tokenizer", param="prompt")
            )
        return tokenizer

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self._model_name:
            raise model_not_found(model, self._model_name)

    def _without_added_bos(self, ids: list[int]) -> list[int]:
        """The ids without the BOS the tokenizer prepends by itself (`encode` adds it when the model
        asks for one; add_special_tokens=false asks for the text's tokens only)."""
        tokenizer = self._engine.tokenizer
        bos = tokenizer.bos_token_id
        adds_bos = bos is not None and tokenizer.encode("") == [bos]
        return ids[1:] if adds_bos and ids[:1] == [bos] else ids

    def _token_text(self, token_id: int | None) -> str | None:
        if token_id is None:
            return None
        return self._engine.tokenizer.decode([token_id], skip_special_tokens=False) or None
