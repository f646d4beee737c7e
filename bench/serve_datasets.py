"""Synthetic, seeded request sets for the serve suite (no download): `random` and `chat` (bench/README.md).

Boundary: this module turns bench.dataset.* and a tokenizer into a list of `BenchRequest`s (what
to send, and how many prompt tokens the server should count for it).  It sends nothing.
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
        raise ValueError(f"bench.dataset.{name.split('.')[0]}.range_ratio={range_ratio} must be in [0, 1)")
    low, high = max(1, int(mean * (1 - range_ratio))), max(1, int(mean * (1 + range_ratio)))
    return [rng.randint(low, high) for _ in range(count)]


class WordVocabulary:
    """The tokenizer's whole-word tokens (" river", " cart", ...), for prompts of an exact token
    count: the pre-tokenizer splits text at word boundaries, so n of them encode to n tokens."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        bos = getattr(tokenizer, "bos_token_id", None)
        self.words = []
        for token_id in range(tokenizer.vocab_size):
            text = tokenizer.decode([token_id])
            ids = tokenizer.encode(text) if _WORD.match(text) else []
            if (ids[1:] if ids[:1] == [bos] and len(ids) > 1 else ids) == [token_id]:  # itself alone, BOS aside
                self.words.append(text)
        if len(self.words) < _MIN_WORDS:
            raise ValueError(f"the tokenizer has {len(self.words)} whole-word tokens (at least {_MIN_WORDS} are needed "
                             "for text prompts); use bench.dataset.random.prompt_format=token_ids")
        # A BOS the tokenizer prepends to every text is counted by the server too.
        self.bos = len(tokenizer.encode(""))

    def text(self, n: int, rng: random.Random) -> str:
        """Text that `tokenizer.encode` turns into exactly n tokens (a prepended BOS included)."""
        text = self.content(max(0, n - self.bos), rng)
        if (got := len(self.tokenizer.encode(text))) != n:  # the word-boundary argument failed: say so
            raise ValueError(f"a {n}-token text prompt encodes to {got} tokens with this tokenizer; "
                             "use bench.dataset.random.prompt_format=token_ids")
        return text

    def content(self, n: int, rng: random.Random) -> str:
        """n word tokens with no BOS (a chat message's content)."""
        return "".join(rng.choice(self.words) for _ in range(n))


def random_dataset(opts: dict[str, Any], tokenizer) -> list[BenchRequest]:
    """bench.dataset.random: prompts of exact token counts, as text or as token ids."""
    rnd, count = opts["random"], opts["num_prompts"]
    if rnd["prompt_format"] not in ("text", "token_ids"):
        raise ValueError(f"bench.dataset.random.prompt_format={rnd['prompt_format']!r} must be text or token_ids")
    vocab = WordVocabulary(tokenizer) if rnd["prompt_format"] == "text" else None
    rng = random.Random(opts["seed"])
    inputs = lengths(rnd["input_len"], rnd["range_ratio"], count, rng, "random.input_len")
    outputs = lengths(rnd["output_len"], rnd["range_ratio"], count, rng, "random.output_len")
    shared = rnd.get("shared_prefix_len", 0)
    if not 0 <= shared < min(inputs):
        raise ValueError(f"bench.dataset.random.shared_prefix_len={shared} must be at least 0 and below every prompt's "
                         f"length (the shortest is {min(inputs)})")
    low, high = ordinary_token_range(tokenizer.vocab_size)
    if vocab is None:  # token ids
        prefix = [rng.randrange(low, high) for _ in range(shared)]
        prompts = [prefix + [rng.randrange(low, high) for _ in range(n - shared)] for n in inputs]
    else:  # the shared words, then a text of the rest (which counts the BOS)
        prefix = vocab.content(shared, rng)
        prompts = [prefix + vocab.text(n - shared, rng) for n in inputs]
    return [BenchRequest(i, "completions", p, None, n_in, n_out)
            for i, (p, n_in, n_out) in enumerate(zip(prompts, inputs, outputs))]


def chat_dataset(opts: dict[str, Any], tokenizer) -> list[BenchRequest]:
    """bench.dataset.chat: a shared system prompt, `turns` earlier exchanges, a last user message."""
    chat, count, vocab = opts["chat"], opts["num_prompts"], WordVocabulary(tokenizer)
    rng = random.Random(opts["seed"])
    for key in ("system_prompt_len", "turns"):
        if chat[key] < 0:
            raise ValueError(f"bench.dataset.chat.{key}={chat[key]} must be at least 0")
    system = vocab.content(chat["system_prompt_len"], rng) if chat["system_prompt_len"] else None
    outputs = lengths(chat["output_len"], chat["range_ratio"], count, rng, "chat.output_len")

    def turn(role: str) -> dict[str, str]:  # one message, its length drawn around bench.dataset.chat.<role>_len
        n = lengths(chat[f"{role}_len"], chat["range_ratio"], 1, rng, f"chat.{role}_len")[0]
        return {"role": role, "content": vocab.content(n, rng)}

    def conversation() -> list[dict[str, str]]:
        earlier = [message for _ in range(chat["turns"]) for message in (turn("user"), turn("assistant"))]
        return ([{"role": "system", "content": system}] if system is not None else []) + earlier + [turn("user")]

    # The expected count is the chat template's prompt in the same tokenizer (what graphexec-serve counts).
    return [BenchRequest(i, "chat", None, m, len(tokenizer.encode(tokenizer.apply_chat_template(m))), n_out)
            for i, (m, n_out) in enumerate(zip([conversation() for _ in outputs], outputs))]


def build(opts: dict[str, Any], tokenizer) -> list[BenchRequest]:
    """The request set bench.dataset.* describes."""
    if opts["num_prompts"] < 1:
        raise ValueError(f"bench.dataset.num_prompts={opts['num_prompts']} must be at least 1")
    datasets = {"random": random_dataset, "chat": chat_dataset}
    if opts["name"] not in datasets:
        raise ValueError(f"bench.dataset.name={opts['name']!r} is unknown; choose random or chat")
    return datasets[opts["name"]](opts, tokenizer)


def describe(requests: Sequence[BenchRequest]) -> dict[str, Any]:
    """Totals of a request set, for the report."""
    prompt, output = [r.prompt_tokens for r in requests], [r.output_tokens for r in requests]
    return {"requests": len(requests), "prompt_tokens": sum(prompt), "output_tokens": sum(output),
            "prompt_tokens_range": [min(prompt), max(prompt)], "output_tokens_range": [min(output), max(output)]}
