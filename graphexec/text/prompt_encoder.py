"""Prompts to validated token ids: plain text, token ids used as given, or chat messages.

Every check names what it rejects (`label`: "prompt 2" inside a batch, "prompt" or "messages"
for a single request), so the error reaches an HTTP client as a message naming the field.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from graphexec.errors import InvalidRequestError

Prompt = str | Sequence[int]


class PromptEncoder:
    def __init__(self, tokenizer, model_name: str, vocab_size: int, max_context: int):
        self._tokenizer = tokenizer
        self._model_name = model_name
        self._vocab_size = vocab_size
        self._max_context = max_context

    def encode(self, prompt: Prompt, *, chat: bool, label: str) -> list[int]:
        """Token ids of a prompt; a string is wrapped as one user message when `chat` is set."""
        if isinstance(prompt, str):
            if chat:
                return self.encode_chat([{"role": "user", "content": prompt}], label=label)
            ids = self._require_tokenizer(label).encode(prompt)
        elif isinstance(prompt, Sequence) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = list(prompt)
        else:
            raise InvalidRequestError(
                f"{label} must be a string or a list of token ids, got {type(prompt).__name__}", param="prompt"
            )
        self.check_ids(ids, label)
        return ids

    def encode_chat(
        self, messages: Sequence[Mapping[str, str]], *, label: str = "messages", tools: Sequence[Mapping] | None = None
    ) -> list[int]:
        """Token ids of a conversation through the model's chat template, ready for the reply;
        `tools` (OpenAI tool objects) go to the template's `tools` variable."""
        param = "messages" if label == "messages" else "prompt"
        if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
            raise InvalidRequestError(f"{label} must be a non-empty list of {{role, content}} messages", param=param)
        for i, message in enumerate(messages):
            if not isinstance(message, Mapping):
                raise InvalidRequestError(f"{label}[{i}] must be a mapping with role and content", param=param)
            for key in ("role", "content"):
                if not isinstance(message.get(key), str):
                    raise InvalidRequestError(f"{label}[{i}].{key} must be a string", param=param)
        tokenizer = self._require_tokenizer(label)
        try:
            # Only given when set: templates (and stand-ins) that know no tools keep their call.
            extra = {} if tools is None else {"tools": [dict(t) for t in tools]}
            text = tokenizer.apply_chat_template([dict(m) for m in messages], **extra)
        except ValueError as error:  # no chat template
            raise InvalidRequestError(f"{label}: {error}", param=param) from error
        except Exception as error:  # jinja2's TemplateError: the template rejected the conversation
            raise InvalidRequestError(f"{label} rejected by the chat template: {error}", param=param) from error
        ids = tokenizer.encode(text)
        self.check_ids(ids, label)
        return ids

    def check_ids(self, ids: list[int], label: str) -> None:
        param = "messages" if label == "messages" else "prompt"
        if not ids:
            raise InvalidRequestError(f"{label} is empty: at least one token is needed", param=param)
        # The length before the vocabulary: a prompt of millions of ids is refused without a scan.
        if len(ids) >= self._max_context:
            raise InvalidRequestError(
                f"{label} has {len(ids)} tokens; the context limit is {self._max_context} "
                f"({label} must be at most {self._max_context - 1} tokens to generate)",
                param=param,
            )
        bad = [t for t in ids if not 0 <= t < self._vocab_size]
        if bad:
            raise InvalidRequestError(
                f"{label} has token id {bad[0]} outside the vocabulary [0, {self._vocab_size})", param=param
            )

    def _require_tokenizer(self, label: str):
        if self._tokenizer is None:
            raise InvalidRequestError(
                f"{label}: model {self._model_name!r} has no tokenizer; pass token ids", param="prompt"
            )
        return self._tokenizer
