"""The engine's vocabulary as llguidance sees it: every token's bytes, sized to the logits' width.

Built from graphexec's own tokenizer, without transformers.  Byte-level BPE strings ("Ġa") go back
through GPT-2's byte alphabet; SentencePiece byte-fallback tokens are their byte (<0xAB>) or their
text with "▁" as a space; raw vocabularies are their UTF-8; ByteTokenizer's ids 0..255 are the
bytes.  The model's LM head can be wider than the tokenizer (padded vocabularies): ids past the
tokenizer, ids it leaves unnamed and control tokens (<|im_end|> spells like text but is not) are
marked special, which llguidance never lets a grammar produce as text.  The EOS tokens it is given
are allowed only where the grammar can end.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import llguidance

from graphexec.text.tokenizer import ByteTokenizer, Tokenizer

_BYTE_FALLBACK_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def build_ll_tokenizer(
    tokenizer: Tokenizer | ByteTokenizer, logits_vocab_size: int, eos_token_ids: Sequence[int]
) -> llguidance.LLTokenizer:
    """Built once per engine: a few hundred ms for SmolLM2's 49k tokens, most of it llguidance
    building its token trie."""
    if not eos_token_ids:
        raise ValueError("structured output needs at least one EOS token: it is how a grammar ends")
    tokens, special = token_bytes(tokenizer, logits_vocab_size)
    view = _VocabularyView(tokenizer, tokens, sorted(special | set(eos_token_ids)), eos_token_ids[0])
    return llguidance.LLTokenizer(view, eos_token=list(eos_token_ids))


def token_bytes(tokenizer: Tokenizer | ByteTokenizer, size: int) -> tuple[list[bytes], set[int]]:
    """Each id's bytes for ids 0..size-1, and the ids that are never text."""
    if isinstance(tokenizer, ByteTokenizer):
        return [bytes([i]) if i < 256 else b"" for i in range(size)], set(range(256, size))
    tokens = [b""] * size
    named = set()
    decode = _decoder(tokenizer.vocab_encoding.kind)
    for index, token in tokenizer.token_strings().items():
        if index < size:
            tokens[index] = decode(token)
            named.add(index)
    special = set(range(size)) - named
    special |= {i for i in tokenizer.special_token_ids if i < size}
    return tokens, special


def _decoder(kind: str):
    if kind == "byte_level":
        return _byte_level_decoder()
    if kind == "byte_fallback":
        return _byte_fallback_bytes
    return str.encode


def _byte_level_decoder():
    """Decodes GPT-2's byte alphabet: printable Latin-1 bytes stand for themselves, the other bytes
    for the characters from U+0100 upward, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    shifted = [b for b in range(256) if b not in printable]
    alphabet = {b: b for b in printable} | {256 + offset: b for offset, b in enumerate(shifted)}
    # str.translate + latin-1 decodes a whole token in C (a third of the per-character time);
    # characters outside the alphabet become U+FFFF, which latin-1 refuses, so those tokens (added
    # tokens spelled as plain text) take the per-character way, where such a character is itself.
    table = {code: alphabet.get(code, 0xFFFF) for code in range(256 + len(shifted))}

    def decode(token: str) -> bytes:
        try:
            return token.translate(table).encode("latin-1")
        except UnicodeEncodeError:
            return b"".join(bytes([alphabet[ord(ch)]]) if ord(ch) in alphabet else ch.encode() for ch in token)

    return decode


def _byte_fallback_bytes(token: str) -> bytes:
    byte = _BYTE_FALLBACK_TOKEN.fullmatch(token)
    if byte is not None:
        return bytes([int(byte.group(1), 16)])
    return token.replace("\u2581", " ").encode()


class _VocabularyView:
    """What llguidance.LLTokenizer reads from a tokenizer (the shape of its TokenizerWrapper): the
    tokens' bytes, EOS, BOS, the special ids, and a call that tokenizes text."""

    is_tokenizer_wrapper = True

    def __init__(self, tokenizer: Tokenizer | ByteTokenizer, tokens: list[bytes], special: list[int], eos: int):
        self.tokens = tokens
        self.special_token_ids = special
        self.eos_token_id = eos
        self.bos_token_id = tokenizer.bos_token_id
        self._encode = tokenizer.encode
        # Tokenizer.encode prepends BOS where the model wants it; llguidance tokenizes pieces of text.
        self._leading_bos = 1 if tokenizer.encode("")[:1] == [tokenizer.bos_token_id] else 0

    def __call__(self, text: str) -> list[int]:
        return self._encode(text)[self._leading_bos :]
