"""Synthetic, seeded request sets for the serve suite (no download): `random` and `chat`.

Boundary: this module turns bench.dataset.* and a tokenizer into a list of `BenchRequest`s (what
to send, and how many prompt tokens the server should count for it).  It sends nothing.

- `random`: prompt and output lengths uniform in [len·(1−r), len·(1+r)] (vLLM's range ratio), sent
  to /v1/completions either as token ids or as text; with `bench.dataset.random.shared_prefix_len=N`
  every prompt starts with the same N tokens (a system prompt: prefix caching, replica affinity).
  Text is a sequence of whole-word tokens of the tokenizer's own vocabulary (" river", " cart", ...): the pre-tokenizer splits text at word
  boundaries, so n such words encode back to exactly n tokens, and every prompt is checked so.
- `chat`: conversations with a shared system prompt of a set length, some earlier user/assistant
  turns and a last user turn, sent to /v1/chat/completions.  The expected count is the chat
  template's prompt encoded with the same tokenizer (what graphexec-serve counts).
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Any, Sequence

from bench.workload import ordinary_token_range

# A word token: one leading space, then ASCII letters only (no digits, punctuation or specials).
_WORD = re.compile(r"^ [A-Za-z]{2,}$")
_MIN_WORDS = 256


@dataclass(frozen=True)
class BenchRequest:
    """One request of the benchmark: the prompt (text, token ids or messages) and its lengths."""

    index: int
    endpoint: str  # "completions" | "chat"
    prompt: str | list[int] | None  # completions
    messages: list[dict[str, str]] | None  # chat
    prompt_tokens: int  # what the server should report as usage.prompt_tokens
    output_tokens: int  # max_tokens; with ignore_eos, exactly the completion's length


def lengths(mean: int, range_ratio: float, count: int, rng: random.Random, name: str) -> list[int]:
    """`count` integers uniform in [mean·(1−r), mean·(1+r)] (at least 1)."""
    if mean < 1:
        raise ValueError(f"bench.dataset.{name}={mean} must be at least 1")
    if not 0.0 <= range_ratio < 1.0:
        group = name.split(".")[0]
        raise ValueError(f"bench.dataset.{group}.range_ratio={range_ratio} must be in [0, 1)")
    low, high = max(1, int(mean * (1 - range_ratio))), max(1, int(mean * (1 + range_ratio)))
    return [rng.randint(low, high) for _ in range(count)]


class WordVocabulary:
    """The tokenizer's whole-word tokens, for prompts of an exact token count."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.words = word_tokens(tokenizer)
        # A BOS the tokenizer prepends to every text is counted by the server too.
        self.bos = len(tokenizer.encode(""))

    def text(self, n: int, rng: random.Random) -> str:
        """Text that `tokenizer.encode` turns into exactly n tokens (a prepended BOS included)."""
        words = max(0, n - self.bos)
        text = "".join(rng.choice(self.words) for _ in range(words))
        got = len(self.tokenizer.encode(text))
        if got != n:  # would mean the word-boundary argument failed for this tokenizer: say so
            raise ValueError(f"a {n}-token text prompt encodes to {got} tokens with this tokenizer; "
                             "use bench.dataset.random.prompt_format=token_ids")
        return text

    def content(self, n: int, rng: random.Random) -> str:
        """n word tokens with no BOS (a chat message's content)."""
        return "".join(rng.choice(self.words) for _ in range(n))


def word_tokens(tokenizer) -> list[str]:
    """Vocabulary entries that decode to " word" and encode back to themselves alone."""
    words = []
    for token_id in range(tokenizer.vocab_size):
        text = tokenizer.decode([token_id])
        if _WORD.match(text) and _plain_ids(tokenizer, text) == [token_id]:
            words.append(text)
    if len(words) < _MIN_WORDS:
        raise ValueError(f"the tokenizer has {len(words)} whole-word tokens (at least {_MIN_WORDS} are needed for "
                         "text prompts); use bench.dataset.random.prompt_format=token_ids")
    return words


def _plain_ids(tokenizer, text: str) -> list[int]:
    ids = tokenizer.encode(text)
    bos = getattr(tokenizer, "bos_token_id", None)
    return ids[1:] if ids and ids[0] == bos and len(ids) > 1 else ids


def random_dataset(opts: dict[str, Any], tokenizer, vocab: WordVocabulary | None) -> list[BenchRequest]:
    """bench.dataset.random: prompts of exact token counts, as text or as token ids."""
    rnd, count = opts["random"], opts["num_prompts"]
    rng = random.Random(opts["seed"])
    inputs = lengths(rnd["input_len"], rnd["range_ratio"], count, rng, "random.input_len")
    outputs = lengths(rnd["output_len"], rnd["range_ratio"], count, rng, "random.output_len")
    fmt = rnd["prompt_format"]
    if fmt not in ("text", "token_ids"):
        raise ValueError(f"bench.dataset.random.prompt_format={fmt!r} must be text or token_ids")
    shared = rnd.get("shared_prefix_len", 0)
    if not 0 <= shared < min(inputs):
        raise ValueError(f"bench.dataset.random.shared_prefix_len={shared} must be at least 0 and below every prompt's "
                         f"length (the shortest is {min(inputs)})")
    low, high = ordinary_token_range(tokenizer.vocab_size)
    prefix_ids = [rng.randrange(low, high) for _ in range(shared)] if fmt == "token_ids" else []
    prefix_text = vocab.content(shared, rng) if fmt == "text" else ""
    requests = []
    for i, (n_in, n_out) in enumerate(zip(inputs, outputs)):
        if fmt == "token_ids":
            prompt: str | list[int] = prefix_ids + [rng.randrange(low, high) for _ in range(n_in - shared)]
        else:  # the shared words, then a text of the rest (which counts the BOS)
            prompt = prefix_text + vocab.text(n_in - shared, rng)
        requests.append(BenchRequest(i, "completions", prompt, None, n_in, n_out))
    return requests


def chat_dataset(opts: dict[str, Any], tokenizer, vocab: WordVocabulary) -> list[BenchRequest]:
    """bench.dataset.chat: a shared system prompt, `turns` earlier exchanges, a last user message."""
    chat, count = opts["chat"], opts["num_prompts"]
    rng = random.Random(opts["seed"])
    for key in ("system_prompt_len", "turns"):
        if chat[key] < 0:
            raise ValueError(f"bench.dataset.chat.{key}={chat[key]} must be at least 0")
    system = vocab.content(chat["system_prompt_len"], rng) if chat["system_prompt_len"] else None
    outputs = lengths(chat["output_len"], chat["range_ratio"], count, rng, "chat.output_len")
    requests = []
    for i, n_out in enumerate(outputs):
        messages = [{"role": "system", "content": system}] if system is not None else []
        for _ in range(chat["turns"]):
            messages += [{"role": "user", "content": _turn(vocab, chat, "user_len", rng)},
                         {"role": "assistant", "content": _turn(vocab, chat, "assistant_len", rng)}]
        messages.append({"role": "user", "content": _turn(vocab, chat, "user_len", rng)})
        expected = len(tokenizer.encode(tokenizer.apply_chat_template(messages)))
        requests.append(BenchRequest(i, "chat", None, messages, expected, n_out))
    return requests


def _turn(vocab: WordVocabulary, chat: dict[str, Any], key: str, rng: random.Random) -> str:
    """One message's content, its length drawn around bench.dataset.chat.<key>."""
    return vocab.content(lengths(chat[key], chat["range_ratio"], 1, rng, f"chat.{key}")[0], rng)


def build(opts: dict[str, Any], tokenizer) -> list[BenchRequest]:
    """The request set bench.dataset.* describes."""
    if opts["num_prompts"] < 1:
        raise ValueError(f"bench.dataset.num_prompts={opts['num_prompts']} must be at least 1")
    name = opts["name"]
    if name == "random":
        needs_text = opts["random"]["prompt_format"] == "text"
        return random_dataset(opts, tokenizer, WordVocabulary(tokenizer) if needs_text else None)
    if name == "chat":
        return chat_dataset(opts, tokenizer, WordVocabulary(tokenizer))
    raise ValueError(f"bench.dataset.name={name!r} is unknown; choose random or chat")


def describe(requests: Sequence[BenchRequest]) -> dict[str, Any]:
    """Totals of a request set, for the report."""
    return {
        "requests": len(requests),
        "prompt_tokens": sum(r.prompt_tokens for r in requests),
        "output_tokens": sum(r.output_tokens for r in requests),
        "prompt_tokens_range": [min(r.prompt_tokens for r in requests), max(r.prompt_tokens for r in requests)],
        "output_tokens_range": [min(r.output_tokens for r in requests), max(r.output_tokens for r in requests)],
    }
