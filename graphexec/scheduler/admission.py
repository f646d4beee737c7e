"""Admission policies: may the request at the head of the queue start now?

Asked after the KV cache manager has admitted the request (row assigned, cached prefix mapped
and locked), so the numbers include what it reuses; a refusal is undone by releasing it.

- `reserve`: every holder's worst case (prompt + max_new_tokens, capped by the context) minus
  what the prefix cache supplies is promised up front, so decode never runs out of slots and
  nothing is retracted; a few requests with a huge max_new_tokens hold the pool for everyone.
- `optimistic` (SGLang's new_token_ratio): what the holders must compute now, plus an estimate
  of their future decode tokens, must fit in the free and evictable slots.  The estimate is
  ratio x remaining max_new_tokens (capped per request), the ratio decays with every decode
  step and resets on every retraction; when the estimate is wrong the scheduler retracts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from graphexec.config import SchedulerConfig

if TYPE_CHECKING:
    from graphexec.batch.request import Req
    from graphexec.cache.manager import KVCacheManager


class ReserveAdmission:
    name = "reserve"

    def admits(self, req: Req, kv: KVCacheManager) -> bool:
        return self.promised(kv) + kv.num_locked <= kv.num_slots

    def promised(self, kv: KVCacheManager) -> int:
        """Slots promised to holders beyond the prefix they lock (the worst case of each)."""
        return sum(r.max_total_tokens() - kv.prefix_len(r) for r in kv.holders())

    def on_decode_step(self) -> None:
        pass

    def on_retract(self) -> None:
        pass


class OptimisticAdmission:
    name = "optimistic"

    def __init__(self, config: SchedulerConfig):
        self.init_ratio = config.init_new_token_ratio
        self.min_ratio = config.min_new_token_ratio
        self.decay = config.new_token_ratio_decay
        self.cap = config.new_token_estimate_cap
        self.ratio = self.init_ratio

    def admits(self, req: Req, kv: KVCacheManager) -> bool:
        holders = kv.holders()
        if holders == [req]:
            # Alone it always fits (the door bounds a request by the pool), and must run, or
            # nothing would.
            return True
        return self.promised(kv) <= kv.num_available

    def promised(self, kv: KVCacheManager) -> int:
        """Slots the holders need beyond what they have mapped: the tokens still to compute
        (an unfinished prompt; one for a decoding request), plus the decode estimate."""
        now = future = 0
        for r in kv.holders():
            now += r.seq_len - kv.num_allocated(r)
            future += min(r.max_total_tokens() - r.seq_len, self.cap)
        return now + int(self.ratio * future)

    def on_decode_step(self) -> None:
        self.ratio = max(self.min_ratio, self.ratio - self.decay)

    def on_retract(self) -> None:
        self.ratio = self.init_ratio


def create_admission(config: SchedulerConfig) -> ReserveAdmission | OptimisticAdmission:
    if config.admission == "reserve":
        return ReserveAdmission()
    return OptimisticAdmission(config)
