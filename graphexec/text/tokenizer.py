"""Text <-> token ids, and chat prompts, for the checkpoints graphexec loads.

`Tokenizer` wraps a Hugging Face `tokenizers.Tokenizer`, built either from a GGUF's metadata or from a
`tokenizer.json`.  A GGUF states its kind in `tokenizer.ggml.model`: "gpt2" (byte-level BPE with
merges: Llama 3, Qwen, SmolLM2) or "llama" (SentencePiece: Llama 2, Mistral, Mixtral, Phi-3, Gemma),
whose pieces merge by score, "▁" spells a space and <0xNN> pieces spell the bytes no piece covers.
`ByteTokenizer` is a dependency-free stand-in for tiny random test models.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers

from graphexec.errors import CheckpointError

# Longer texts are tokenized without holding the GIL (Tokenizer.encode); shorter ones take < 10 ms.
_GIL_FREE_ENCODE_CHARS = 16_384

# GGUF token types (llama.cpp's llama_token_type) that must be matched whole, never split by BPE.
_GGUF_NORMAL = 1
_GGUF_UNKNOWN = 2
_GGUF_CONTROL = 3
_GGUF_USER_DEFINED = 4
_SPACE = "\u2581"  # SentencePiece's spelling of a space

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# `tokenizer.ggml.pre` values whose split regex differs from GPT-2's, as transformers' GGUF converter
# maps them.  Anything else (including SmolLM2's "smollm") gets the plain GPT-2 byte-level regex, which
# is also what the model's own tokenizer.json uses.
_GGUF_SPLIT_REGEXES = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "dbrx", "smaug-bpe"), _LLAMA3_SPLIT),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen"), _QWEN2_SPLIT),
}


def _gguf_byte_level_backend(metadata: Mapping[str, Any]) -> tokenizers.Tokenizer:
    tokens: list[str] = list(metadata["tokenizer.ggml.tokens"])
    token_types = list(metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    whole = {_GGUF_CONTROL, _GGUF_USER_DEFINED}
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    alphabet = set(pre_tokenizers.ByteLevel.alphabet())

    def spelled(token: str, token_type: int) -> str:
        # A few converters store plain text for ordinary tokens; BPE needs them in the byte alphabet.
        # Special tokens keep their text so that they can be matched (and decoded) as written.
        if token_type in whole or set(token) <= alphabet:
            return token
        return "".join(piece for piece, _ in byte_level.pre_tokenize_str(token))

    vocab = {spelled(token, kind): index for index, (token, kind) in enumerate(zip(tokens, token_types))}
    merges = [tuple(merge.split(" ", 1)) for merge in metadata.get("tokenizer.ggml.merges", [])]
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    split = _GGUF_SPLIT_REGEXES.get(metadata.get("tokenizer.ggml.pre", "default"))
    if split is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), "isolated"), byte_level])
    backend.decoder = decoders.ByteLevel()
    # Matched whole before BPE runs; their text is already in the vocabulary, so they keep the file's ids.
    backend.add_special_tokens(
        [AddedToken(t, normalized=False, special=True) for t, k in zip(tokens, token_types) if k == _GGUF_CONTROL]
    )
    backend.add_tokens(
        [AddedToken(t, normalized=False, special=False) for t, k in zip(tokens, token_types) if k == _GGUF_USER_DEFINED]
    )
    return backend


def _gguf_sentencepiece_backend(metadata: Mapping[str, Any]) -> tokenizers.Tokenizer:
    """llama.cpp's SentencePiece tokenizer as a BPE: repeatedly join the adjacent pair whose join
    is the best-scored piece, over the whole text with spaces as "▁" (and one "▁" in front unless
    `add_space_prefix` is false), bytes no piece covers as their <0xNN> pieces.

    The merges are every split of every normal piece into two pieces, ranked by the joined
    piece's score.  Gemma files list their pieces in merge order but with scores that do not
    follow it (transformers' GGUF reader found the same), so for them the file order ranks; they
    also store pieces of several spaces as spaces, which are respelled as "▁"s."""
    tokens: list[str] = list(metadata["tokenizer.ggml.tokens"])
    types = list(metadata.get("tokenizer.ggml.token_type") or [_GGUF_NORMAL] * len(tokens))
    gemma = str(metadata.get("general.architecture", "")).startswith("gemma")
    if gemma:
        tokens = [_SPACE * len(t) if t and not t.strip(" ") else t for t in tokens]
        scores = [-float(i) for i in range(len(tokens))]
    else:
        scores = [float(v) for v in metadata.get("tokenizer.ggml.scores") or [-float(i) for i in range(len(tokens))]]
    vocab = {token: i for i, token in reversed(list(enumerate(tokens)))}  # a repeated piece keeps its first id
    mergeable = {t: scores[i] for i, t in enumerate(tokens) if types[i] in (_GGUF_NORMAL, _GGUF_USER_DEFINED) and vocab[t] == i}
    ranked = []
    for token, score in mergeable.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                ranked.append((-score, vocab[token], vocab[left], left, right))
    merges = [(left, right) for *_, left, right in sorted(ranked)]
    unknown = next((t for t, k in zip(tokens, types) if k == _GGUF_UNKNOWN), None)
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=unknown, byte_fallback=True,
                                              fuse_unk=True))
    prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", not gemma))
    steps = [normalizers.Prepend(_SPACE)] if prefix else []
    backend.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", _SPACE)])
    strip = [decoders.Strip(" ", 1, 0)] if prefix else []
    backend.decoder = decoders.Sequence([decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse(), *strip])
    backend.add_special_tokens(
        [AddedToken(t, normalized=False, special=True) for t, k in zip(tokens, types) if k == _GGUF_CONTROL]
    )
    backend.add_tokens(
        [AddedToken(t, normalized=False, special=False) for t, k in zip(tokens, types) if k == _GGUF_USER_DEFINED]
    )
    return backend


def _compile_chat_template(template: str):
    """Compile the way transformers does, so prompts come out byte-identical to its apply_chat_template."""
    from jinja2.exceptions import TemplateError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        raise TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # Jinja's own tojson escapes HTML characters, which would change the prompt text.
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise CheckpointError(f"cannot read {path}: {error}") from error


def _token_text(value: Any) -> str | None:
    """tokenizer_config.json spells special tokens as a string or as an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value


@dataclass(frozen=True)
class VocabEncoding:
    """How a vocabulary's token strings spell bytes: "byte_level" (GPT-2's byte alphabet),
    "byte_fallback" (SentencePiece's "▁" and <0xNN> tokens) or "raw" (the text itself)."""

    kind: str
    add_prefix_space: bool


def _flatten_steps(step: dict | None, children: str) -> list[dict]:
    """A tokenizer.json component and, for a Sequence, the components inside it."""
    if not step:
        return []
    return [step, *(inner for child in step.get(children) or [] for inner in _flatten_steps(child, children))]


class Tokenizer:
    """A model's tokenizer: encode/decode plus its chat template."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_token_id: int | None,
        eos_token_ids: Iterable[int],
        chat_template: str | None = None,
        add_bos: bool = False,
    ) -> None:
        self._backend = backend
        self._bos_token_id = bos_token_id
        self._eos_token_ids = tuple(dict.fromkeys(eos_token_ids))
        self._chat_template = chat_template
        self._add_bos = add_bos and bos_token_id is not None

    @classmethod
    def from_gguf(cls, metadata: Mapping[str, Any]) -> Tokenizer:
        """Build from a GGUF's decoded metadata (key -> value, as `ReaderField.contents()` gives)."""
        kind = metadata.get("tokenizer.ggml.model")
        builders = {"gpt2": _gguf_byte_level_backend, "llama": _gguf_sentencepiece_backend}
        if kind not in builders:
            raise CheckpointError(
                f"GGUF tokenizer {kind!r} (tokenizer.ggml.model) is not supported; supported: {sorted(builders)}"
            )
        eos_ids = [
            metadata[key]
            for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
            if metadata.get(key) is not None
        ]
        return cls(
            builders[kind](metadata),
            bos_token_id=metadata.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=eos_ids,
            chat_template=metadata.get("tokenizer.chat_template"),
            # llama.cpp's default: a SentencePiece vocabulary starts every text with BOS.
            add_bos=bool(metadata.get("tokenizer.ggml.add_bos_token", kind == "llama")),
        )

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> Tokenizer:
        """Build from a Hugging Face directory's tokenizer.json (+ tokenizer_config.json, chat_template.jinja)."""
        directory = Path(path)
        tokenizer_file = directory / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise CheckpointError(f"no tokenizer.json in {directory}")
        try:
            backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        except Exception as error:  # tokenizers raises plain Exception on malformed files
            raise CheckpointError(f"cannot read {tokenizer_file}: {error}") from error
        config_file = directory / "tokenizer_config.json"
        config = _read_json(config_file) if config_file.is_file() else {}

        def token_id(key: str) -> int | None:
            text = _token_text(config.get(key))
            return None if text is None else backend.token_to_id(text)

        bos_id, eos_id = token_id("bos_token"), token_id("eos_token")
        template = config.get("chat_template")
        if isinstance(template, list):  # older multi-template form: [{"name": ..., "template": ...}]
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        template_file = directory / "chat_template.jinja"
        if template_file.is_file():
            template = template_file.read_text(encoding="utf-8")
        if "add_bos_token" in config:
            add_bos = bool(config["add_bos_token"])
        else:
            # Without the flag, the tokenizer.json post-processor is what says whether BOS is prepended.
            add_bos = bos_id is not None and backend.encode("", add_special_tokens=True).ids[:1] == [bos_id]
        return cls(
            backend,
            bos_token_id=bos_id,
            eos_token_ids=[eos_id] if eos_id is not None else [],
            chat_template=template,
            add_bos=add_bos,
        )

    @property
    def vocab_size(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_token_id

    def token_strings(self) -> dict[int, str]:
        """Each id's token as the vocabulary spells it (byte-level tokens in their byte alphabet,
        "Ġa" for " a"), added tokens included: what a grammar engine decodes to match text."""
        return {index: token for token, index in self._backend.get_vocab(with_added_tokens=True).items()}

    @cached_property
    def special_token_ids(self) -> frozenset[int]:
        """Control tokens (<|im_end|> …): never text, though their spelling looks like some."""
        return frozenset(i for i, token in self._backend.get_added_tokens_decoder().items() if token.special)

    @cached_property
    def vocab_encoding(self) -> VocabEncoding:
        """How token strings map to bytes, read from the backend's decoder and normalizer."""
        spec = json.loads(self._backend.to_str())
        decoders_ = _flatten_steps(spec.get("decoder"), "decoders")
        kinds = {step.get("type") for step in decoders_}
        kind = "byte_level" if "ByteLevel" in kinds else "byte_fallback" if "ByteFallback" in kinds else "raw"
        # SentencePiece-style vocabularies put "▁" before the first word of a text.
        prefix = any(step.get("type") == "Prepend" for step in _flatten_steps(spec.get("normalizer"), "normalizers"))
        prefix = prefix or any(
            step.get("type") == "Metaspace" and step.get("prepend_scheme") in ("first", "always")
            for step in _flatten_steps(spec.get("pre_tokenizer"), "pretokenizers")
        )
        return VocabEncoding(kind, prefix)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._eos_token_ids

    @property
    def chat_template(self) -> str | None:
        return self._chat_template

    def encode(self, text: str) -> list[int]:
        if len(text) > _GIL_FREE_ENCODE_CHARS:
            # encode_batch_fast releases the GIL while it works (encode holds it: 1.5 s for 4 MB), so
            # a long prompt tokenized on a server worker thread leaves the event loop running.  It keeps
            # no offsets: half of encode_batch's time, and its result is freed in ms (encode_batch's,
            # 2.4 M tokens of strings and offsets, held the GIL 0.3 s to free).  Short texts keep
            # encode: the batch call also starts tokenizers' thread pool.
            ids = self._backend.encode_batch_fast([text], add_special_tokens=False)[0].ids  # tokenizers >= 0.20
        else:
            ids = self._backend.encode(text, add_special_tokens=False).ids
        return [self._bos_token_id, *ids] if self._add_bos else ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        # The byte-level decoder already replaces incomplete UTF-8 with U+FFFD.
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @cached_property
    def _compiled_template(self):
        if self._chat_template is None:
            raise ValueError("this model has no chat template; pass a plain prompt instead of chat messages")
        return _compile_chat_template(self._chat_template)

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None
    ) -> str:
        """The conversation as the template writes it; `tools` (OpenAI tool objects) is the
        template's `tools` variable, as transformers passes it (left undefined when None)."""

        def token(token_id: int | None) -> str:
            return "" if token_id is None else self._backend.id_to_token(token_id)

        eos = self._eos_token_ids[0] if self._eos_token_ids else None
        extra = {} if tools is None else {"tools": [dict(tool) for tool in tools]}
        return self._compiled_template.render(
            messages=[dict(message) for message in messages],
            add_generation_prompt=add_generation_prompt,
            bos_token=token(self._bos_token_id),
            eos_token=token(eos),
            **extra,
        )


class ByteTokenizer:
    """UTF-8 bytes as tokens (ids 0..255), then BOS=256 and EOS=257: for tiny random test models."""

    BOS_TOKEN_ID = 256
    EOS_TOKEN_ID = 257

    def __init__(self, vocab_size: int = 258) -> None:
        if vocab_size < 258:
            raise ValueError(f"ByteTokenizer needs vocab_size >= 258 (256 bytes + BOS + EOS), got {vocab_size}")
        self._vocab_size = vocab_size

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def bos_token_id(self) -> int:
        return self.BOS_TOKEN_ID

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return (self.EOS_TOKEN_ID,)

    @property
    def chat_template(self) -> None:
        return None

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        # Ids above 255 are special or unused; they have no bytes, so they vanish either way.
        data = bytes(i for i in ids if 0 <= i < 256)
        return data.decode("utf-8", errors="replace")

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None
    ) -> str:
        raise ValueError("ByteTokenizer has no chat template; pass a plain prompt instead of chat messages")
