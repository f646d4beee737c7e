"""Seeded offline workloads for the e2e suite: prompt and output lengths drawn from stated
distributions, and a shared system prompt at the start of some prompts."""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class WorkloadSpec:
    num_requests: int = 64
    prompt_len: tuple[int, int] = (16, 256)  # uniform, inclusive; includes the shared prefix
    output_len: tuple[int, int] = (16, 128)  # uniform, inclusive; EOS is ignored
    shared_prefix_len: int = 32  # the "system prompt" some requests start with
    shared_fraction: float = 0.5  # share of requests that start with it
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("prompt_len", "output_len"):
            low, high = getattr(self, name)
            if not 1 <= low <= high:
                raise ValueError(f"bench.workload.{name}={[low, high]} must be [min, max] with 1 <= min <= max")
        if self.num_requests < 1:
            raise ValueError(f"bench.workload.num_requests={self.num_requests} must be at least 1")
        if not 0.0 <= self.shared_fraction <= 1.0:
            raise ValueError(f"bench.workload.shared_fraction={self.shared_fraction} must be in [0, 1]")
        if self.shared_fraction > 0 and self.shared_prefix_len >= self.prompt_len[1]:
            raise ValueError(
                f"bench.workload.shared_prefix_len={self.shared_prefix_len} leaves no room in prompts of at most "
                f"{self.prompt_len[1]} tokens"
            )


@dataclass(frozen=True)
class WorkItem:
    prompt_ids: list[int]
    output_len: int
    shared_prefix: bool


def make_workload(spec: WorkloadSpec, token_ids: tuple[int, int]) -> list[WorkItem]:
    """The same list for the same spec and token range; token ids uniform in [low, high)."""
    rng = random.Random(spec.seed)
    low, high = token_ids

    def tokens(n: int) -> list[int]:
        return [rng.randrange(low, high) for _ in range(n)]

    prefix = tokens(spec.shared_prefix_len)
    items = []
    for _ in range(spec.num_requests):
        prompt_len = rng.randint(*spec.prompt_len)
        output_len = rng.randint(*spec.output_len)
        shared = rng.random() < spec.shared_fraction and prompt_len > len(prefix)
        prompt = prefix + tokens(prompt_len - len(prefix)) if shared else tokens(prompt_len)
        items.append(WorkItem(prompt, output_len, shared))
    return items


def ordinary_token_range(vocab_size: int, special_ids: int = 100) -> tuple[int, int]:
    """Ids past the special tokens (chat markers, EOS) that small vocabularies put first."""
    return (min(special_ids, vocab_size // 2), vocab_size)
