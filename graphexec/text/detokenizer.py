"""Incremental detokenization: text deltas of a growing token sequence, whole characters only.

Byte-level BPE tokens are byte sequences, so one character can span several tokens (an emoji or a
CJK character is often 2-4 tokens) and a token can end mid-character.  Decoding every token on
its own would emit U+FFFD halves; decoding the whole sequence every step is quadratic.

The scheme is vLLM's and SGLang's: decode a short window `ids[prefix_offset:]` and compare it
with the window's already-emitted part `ids[prefix_offset:read_offset]`.  The difference is new
text, emitted only when it does not end in U+FFFD (an incomplete character that later tokens may
finish).  After emitting, the window slides forward.  Decoding from `prefix_offset` rather than
from `read_offset` keeps one emitted token of context, so tokenizers that render a token
differently at the start of a string (SentencePiece's leading space) still join correctly.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

REPLACEMENT_CHAR = "\ufffd"


class Decoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Turns the tokens of one request, fed as they arrive, into text deltas."""

    def __init__(self, tokenizer: Decoder, *, skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._ids: list[int] = []
        # ids[prefix_offset:read_offset] decoded is text already emitted (kept as context);
        # ids[read_offset:] are tokens whose text has not been emitted yet.
        self._prefix_offset = 0
        self._read_offset = 0

    def push(self, token_ids: Sequence[int]) -> str:
        """Add new tokens; return the text they complete ("" while a character is unfinished)."""
        self._ids.extend(token_ids)
        return self._advance(final=False)

    def flush(self) -> str:
        """The text still held back, as is: an unfinished character decodes to U+FFFD.

        Call once, when the sequence ends; all deltas plus this equal decoding every token at once.
        """
        return self._advance(final=True)

    def _advance(self, *, final: bool) -> str:
        if self._read_offset == len(self._ids):
            return ""
        emitted = self._decode(self._ids[self._prefix_offset : self._read_offset])
        window = self._decode(self._ids[self._prefix_offset :])
        # A skipped special token adds no text; an unfinished character ends in U+FFFD.
        if len(window) <= len(emitted) or (window.endswith(REPLACEMENT_CHAR) and not final):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return window[len(emitted) :]

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)
