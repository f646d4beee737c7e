"""Batches built by hand: tests and benchmarks that drive a model runner one chosen forward at a
time, without the scheduler's admission policy, budgets or prefix reuse.

Boundary: asks the KV cache manager for rows and slots, builds `ScheduleBatch`es and moves the
hand-run requests' state on after a forward ran (what the scheduler does for the requests it
serves), so no caller writes a request's fields itself.  Never runs a forward: the caller hands
the batch to the runner.  The scheduler does not use this; it is the public face of the cache's
accounting for code that is not serving.
"""

from __future__ import annotations

from collections.abc import Sequence

from graphexec.batch.request import Req
from graphexec.batch.schedule_batch import ScheduleBatch
from graphexec.cache.manager import KVCacheManager


class HandBatches:
    def __init__(self, kv_cache: KVCacheManager) -> None:
        self.kv_cache = kv_cache

    def extend(self, reqs: Sequence[Req], extend_lens: Sequence[int] | None = None) -> ScheduleBatch:
        """Slots for each request's next `extend_lens` uncomputed tokens (default: all of them)
        and the batch that computes them.  A request not held yet gets a table row, no prefix."""
        for req in reqs:
            if not self.kv_cache.holds(req):
                self.kv_cache.admit(req, reuse_prefix=False)
        if extend_lens is None:
            extend_lens = [r.seq_len - r.num_computed_tokens for r in reqs]
        slots = self.kv_cache.allocate(reqs, extend_lens)
        return ScheduleBatch.extend(reqs, extend_lens, self.kv_cache.rows(reqs), slots)

    def decode(self, reqs: Sequence[Req]) -> ScheduleBatch:
        """A slot for each request's last token and the DECODE batch that computes it."""
        slots = self.kv_cache.allocate(reqs, [1] * len(reqs))
        return ScheduleBatch.decode(reqs, self.kv_cache.rows(reqs), slots)

    def verify(self, reqs: Sequence[Req], drafts: Sequence[Sequence[int]]) -> ScheduleBatch:
        """Slots for each request's last token and drafts, and the TARGET_VERIFY batch of them.
        The slots stay mapped until `rewind` or `release`: only the caller knows what it accepts."""
        slots = self.kv_cache.allocate(reqs, [len(d) + 1 for d in drafts])
        return ScheduleBatch.verify(reqs, drafts, self.kv_cache.rows(reqs), slots)

    def ran(self, batch: ScheduleBatch, next_tokens: Sequence[int] | None = None) -> None:
        """`batch` (EXTEND or DECODE) ran: each request's KV now covers the tokens it computed,
        and each gets its entry of `next_tokens` (one a request) as its next output, if given."""
        if batch.drafts is not None:
            raise ValueError("a TARGET_VERIFY batch's outcome is the caller's: rewind to what it accepts")
        if next_tokens is not None and len(next_tokens) != len(batch.reqs):
            raise ValueError(f"{len(next_tokens)} next tokens for {len(batch.reqs)} requests")
        for i, (req, computed) in enumerate(zip(batch.reqs, batch.seq_lens)):
            req.num_computed_tokens = computed
            if next_tokens is not None:
                req.output_ids.append(int(next_tokens[i]))

    def rewind(self, req: Req, computed: int) -> None:
        """Back to `computed` tokens of KV: the slots after it go back to the pool."""
        self.kv_cache.truncate(req, computed)
        req.num_computed_tokens = computed

    def release(self, req: Req, cache: bool = True) -> None:
        """Free what a hand-run request holds (its computed KV cached when `cache`)."""
        self.kv_cache.release(req, cache=cache)
