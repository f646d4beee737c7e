"""Prompt-lookup drafting: a request's next tokens guessed from its own earlier text.

If the request's last n tokens (n from `ngram_max` down to `ngram_min`) occurred before in its
prompt or output, the tokens that followed their latest earlier occurrence are the draft.  Text
that copies from its input (summaries, edits, refactors, quoting) drafts well; other text finds
no match and drafts nothing.  Deterministic: the same ids always give the same draft, which the
sampler's rejection test relies on (graphexec/sampling/sampler.py).

Per request an index maps each n-gram to the end of its latest occurrence; it grows with the
request's ids (never rebuilt) and goes when the request does (weak keys).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any


class _Index:
    def __init__(self, sizes: range):
        self.sizes = sizes
        self.indexed = 0  # n-grams ending at positions <= this are in `latest`
        self.latest: dict[tuple[int, ...], int] = {}  # n-gram -> end (exclusive) of its latest occurrence

    def extend(self, ids: Sequence[int], end: int) -> None:
        """Index every n-gram that ends at a position in (indexed, end]."""
        for stop in range(self.indexed + 1, end + 1):
            for n in self.sizes:
                if stop >= n:
                    self.latest[tuple(ids[stop - n : stop])] = stop
        self.indexed = max(self.indexed, end)


class NgramDrafter:
    fills_room = False  # a draft is whatever followed the match: maybe shorter, maybe nothing

    def __init__(self, ngram_min: int, ngram_max: int):
        if not 1 <= ngram_min <= ngram_max:
            raise ValueError(f"ngram sizes must satisfy 1 <= min <= max, got {ngram_min}..{ngram_max}")
        self.sizes = range(ngram_min, ngram_max + 1)
        self._indexes: weakref.WeakKeyDictionary[Any, _Index] = weakref.WeakKeyDictionary()

    def propose(self, owner: Any, ids: Sequence[int], max_tokens: int) -> tuple[int, ...]:
        """Up to `max_tokens` draft tokens to follow `ids` (the whole text of `owner`, which only
        ever grows); () when no suffix of it occurred earlier."""
        if max_tokens <= 0 or len(ids) < 2:
            return ()
        index = self._indexes.get(owner)
        if index is None or index.indexed > len(ids):
            index = self._indexes[owner] = _Index(self.sizes)
        # Occurrences must end before the last token, or the suffix would find itself.
        index.extend(ids, len(ids) - 1)
        for n in reversed(self.sizes):
            if n > len(ids):
                continue
            end = index.latest.get(tuple(ids[len(ids) - n :]))
            if end is not None:
                return tuple(ids[end : end + max_tokens])
        return ()

    def propose_batch(self, reqs: Sequence[Any], rooms: Sequence[int]) -> list[tuple[int, ...]]:
        """`propose` for each request over its whole text (`all_ids`)."""
        return [self.propose(req, req.all_ids, room) for req, room in zip(reqs, rooms)]

    def forget(self, req: Any) -> None:
        """Nothing to free: an index goes with its request (weak keys)."""
