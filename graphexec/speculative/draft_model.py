"""Draft-model drafting: a smaller model of the same vocabulary proposes each request's next tokens.

Boundary: the draft model runs on the engine's own machinery, but its own copy of it: a
KVCacheManager (its own KV pool and request table) and a ModelRunner (its own capture backends)
that the engine builds and hands over.  Nothing here touches the target's KV or runner.

Per real request a shadow `Req` (sharing the prompt, with its own output_ids and computed count)
holds the draft model's KV.  One step of `propose_batch`, batched across every request that
drafts:

1. sync: the shadow's output becomes the real one; its KV is cut back to the longest prefix it
   computed on ids the real request still has (drafts rejected last step are dropped);
2. one EXTEND forward computes each shadow's uncomputed tokens (the whole prompt the first time,
   afterwards the one or few tokens verification added); each last row's argmax is draft token 1;
3. k - 1 DECODE forwards, each feeding the previous draft token, give draft tokens 2..k; a request
   whose room is smaller drops out of the later forwards.

Proposals are argmax (greedy), so deterministic: the sampler's rejection test stays exact for
sampled requests (graphexec/sampling/sampler.py).  A shadow goes with its request: the scheduler
calls `forget` when the request finishes, is aborted or is retracted, so the draft pool never
holds KV for a request that is not running.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from graphexec.batch.request import Req
from graphexec.batch.schedule_batch import ScheduleBatch
from graphexec.cache.manager import KVCacheManager

if TYPE_CHECKING:
    from graphexec.runner.model_runner import ModelRunner


class DraftModelDrafter:
    # A full room's worth of tokens, unless the draft pool is short (then nothing that step).
    fills_room = True

    def __init__(self, runner: ModelRunner, kv_cache: KVCacheManager):
        self.runner = runner
        self.kv_cache = kv_cache
        # Real request -> its shadow.  A plain dict, not weak keys: a shadow holds draft KV, which
        # must be freed by `forget` at a known point, never whenever the collector runs.
        self._shadows: dict[Req, Req] = {}

    def propose_batch(self, reqs: Sequence[Req], rooms: Sequence[int]) -> list[tuple[int, ...]]:
        """Per request up to `rooms[i]` draft tokens to follow its ids (() where its room is 0 or
        the draft pool has no space for it this step)."""
        # The draft table's rows end at its context: the k-th draft token is predicted from
        # position seq_len + k - 2.
        rooms = [min(room, self.kv_cache.max_context - req.seq_len + 1) for req, room in zip(reqs, rooms)]
        drafts: list[list[int]] = [[] for _ in reqs]
        active = self._admit([i for i, room in enumerate(rooms) if room > 0], reqs, rooms)
        for step in range(max((rooms[i] for i in active), default=0)):
            active = [i for i in active if rooms[i] > step]
            shadows = [self._shadows[reqs[i]] for i in active]
            if step == 0:  # catch up: every token the shadow has not computed, the last one's logits
                lens = [s.seq_len - s.num_computed_tokens for s in shadows]
                slots = self.kv_cache.allocate(shadows, lens)
                batch = ScheduleBatch.extend(shadows, lens, self.kv_cache.rows(shadows), slots)
            else:
                for i, shadow in zip(active, shadows):
                    shadow.output_ids.append(drafts[i][-1])
                slots = self.kv_cache.allocate(shadows, [1] * len(shadows))
                batch = ScheduleBatch.decode(shadows, self.kv_cache.rows(shadows), slots)
            for i, shadow, token in zip(active, shadows, self._argmax(batch)):
                shadow.num_computed_tokens = shadow.seq_len
                drafts[i].append(token)
        return [tuple(d) for d in drafts]

    def forget(self, req: Req) -> None:
        """The request stopped running (finished, aborted, retracted): free its draft KV."""
        shadow = self._shadows.pop(req, None)
        if shadow is not None:
            self.kv_cache.release(shadow, cache=False)

    def _admit(self, candidates: list[int], reqs: Sequence[Req], rooms: Sequence[int]) -> list[int]:
        """Sync the candidates' shadows and keep those whose step fits the draft pool, in order;
        a request that does not fit loses its shadow (it drafts again once there is room)."""
        catch_up = [self._sync(reqs[i]) for i in candidates]
        budget = self.kv_cache.num_available  # after the syncs freed the rejected drafts' slots
        active = []
        for i, n in zip(candidates, catch_up):
            need = n + rooms[i] - 1  # the catch-up tokens, then one slot per later draft position
            if need <= budget:
                budget -= need
                active.append(i)
            else:
                self.forget(reqs[i])
        return active

    def _sync(self, req: Req) -> int:
        """Bring the request's shadow up to its ids: its output copied, its KV cut back to what it
        computed on ids the request still has.  Returns the tokens it has to compute."""
        shadow = self._shadows.get(req)
        if shadow is None:
            shadow = self._shadows[req] = _shadow_of(req, self.kv_cache.max_context)
            self.kv_cache.admit(shadow, reuse_prefix=False)
        keep = _common_prefix(shadow, req)
        shadow.output_ids = list(req.output_ids)
        # The last token is always computed again: its logits give the first draft token.
        keep = min(keep, shadow.seq_len - 1)
        self.kv_cache.truncate(shadow, keep)
        shadow.num_computed_tokens = keep
        return shadow.seq_len - keep

    def _argmax(self, batch: ScheduleBatch) -> list[int]:
        logits, _ = self.runner.forward_logits(self.runner.init_forward_batch(batch))
        return torch.argmax(logits, dim=-1).tolist()


def _shadow_of(req: Req, max_context: int) -> Req:
    # Neither logprobs nor prompt logprobs: the draft model's distribution is never reported.
    params = dataclasses.replace(req.params, logprobs=None, prompt_logprobs=None)
    return Req(f"{req.rid}/draft", req.prompt_ids, params, (), max_context)


def _common_prefix(shadow: Req, req: Req) -> int:
    """Leading tokens the shadow computed that the request still has (the prompt is shared)."""
    computed = shadow.num_computed_tokens
    prompt = len(req.prompt_ids)
    if computed <= prompt:
        return computed
    same = prompt
    for mine, theirs in zip(shadow.output_ids[: computed - prompt], req.output_ids):
        if mine != theirs:
            break
        same += 1
    return same
