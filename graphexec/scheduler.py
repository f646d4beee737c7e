"""A minimal continuous-batching scheduler: prefill first under a token budget, then decode.

Admission reserves each request's worst-case KV (prompt + max_new_tokens, capped by the context),
so a running request can always take its next decode slot and nothing ever needs preempting.
With the prefix cache, a request first maps the longest cached prefix of its prompt (all but
the last token, which must be computed to sample from), locks it, and reserves only the rest.
What it prefills is cached as soon as it is computed, the rest when it ends; unlocked cached KV
is evicted, least recently used first, whenever a forward needs the slots.
"""

from __future__ import annotations

from collections import deque

from graphexec.config import SchedulerConfig
from graphexec.model_runner import ModelRunner, StepOutput
from graphexec.prefix_cache import RadixCache
from graphexec.request import FinishReason, Req
from graphexec.sampler import make_generator
from graphexec.schedule_batch import ScheduleBatch


class Scheduler:
    def __init__(self, runner: ModelRunner, config: SchedulerConfig, prefix_cache: bool = False):
        self.runner = runner
        self.config = config
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        # Worst-case new KV slots promised to each admitted request (beyond its cached prefix).
        self._reservations: dict[Req, int] = {}
        self.prefix_cache = RadixCache(runner.kv_pool.free) if prefix_cache else None

    @property
    def kv_capacity(self) -> int:
        return self.runner.kv_pool.num_slots

    @property
    def reserved_slots(self) -> int:
        return sum(self._reservations.values())

    @property
    def cached_slots(self) -> int:
        """Slots the prefix cache owns (in use by running requests or evictable)."""
        return self.prefix_cache.cached_tokens if self.prefix_cache else 0

    def flush_cache(self) -> int:
        """Evict the whole prefix cache; refused while requests are in flight.  Returns slots freed."""
        if self.has_unfinished():
            raise RuntimeError("flush_cache: requests are in flight; flush when the engine is idle")
        freed = self.cached_slots
        if self.prefix_cache:
            self.prefix_cache.reset()
        return freed

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add_request(self, req: Req) -> None:
        """Queue a validated request; one that asks for no tokens finishes at once."""
        if req.params.max_new_tokens == 0:
            req.finish_reason = FinishReason.LENGTH
            return
        req.generator = make_generator(req.params.seed, self.runner.device)
        self.waiting.append(req)

    def abort(self, rid: str) -> bool:
        return self.finish(rid, FinishReason.ABORT)

    def step(self) -> list[Req]:
        """Run one forward: a prefill batch (chunked to the token budget; with mixed_chunk, the
        running requests' decode tokens ride along as one-token extends) if any request can be
        admitted, else a decode batch."""
        budget = self.config.max_prefill_tokens
        mixed = self.config.mixed_chunk and bool(self.running)
        if mixed:
            budget -= len(self.running)
        admitted, chunks = self._admit(budget)
        runner = self.runner
        if admitted and mixed:
            reqs, lens = admitted + self.running, chunks + [1] * len(self.running)
        else:
            reqs, lens = (admitted, chunks) if admitted else (list(self.running), None)
        if not reqs:
            return []
        try:
            self._make_room(len(reqs) if lens is None else sum(lens))
            if lens is None:
                batch = ScheduleBatch.prepare_for_decode(reqs, runner.req_to_token_pool, runner.kv_pool)
            else:
                batch = ScheduleBatch.prepare_for_extend(
                    reqs, runner.req_to_token_pool, runner.kv_pool, lens, mixed=bool(admitted and mixed)
                )
            result = runner.forward_and_sample(runner.init_forward_batch(batch))
        except BaseException:
            # Leave the pools as if these requests had never run; other requests are untouched.
            for req in reqs:
                req.finish_reason = FinishReason.ABORT
                self._release(req, cache=False)  # its KV may be half written
            self.running = [r for r in self.running if not r.finished]
            self.waiting = deque(r for r in self.waiting if not r.finished)
            raise
        finished = self._process_result(batch, result)
        if self.prefix_cache is not None:
            for req in admitted:
                if not req.finished:
                    self._cache_computed(req)
        return finished

    def _admit(self, budget: int) -> tuple[list[Req], list[int]]:
        """Waiting requests for the next prefill and how many new tokens each computes now.

        A prompt longer than the remaining budget is cut into chunks over several steps; it stays
        at the head of the queue, its KV and reservation kept, until its last chunk runs.
        """
        admitted: list[Req] = []
        chunks: list[int] = []
        while budget > 0 and self.waiting and len(self.running) + len(admitted) < self.config.max_running_requests:
            req = self.waiting[0]
            if req not in self._reservations and not self._reserve(req):
                break
            remaining = req.seq_len - req.num_cached_tokens
            chunk = min(remaining, budget)
            admitted.append(req)
            chunks.append(chunk)
            budget -= chunk
            if chunk < remaining:
                break
            self.waiting.popleft()
        return admitted, chunks

    def _reserve(self, req: Req) -> bool:
        """Map the request's cached prefix and promise it the slots for the rest, if they fit:
        reservations plus locked cached KV never exceed the pool, so evicting what is unlocked
        always makes room for any promised slot."""
        match = None
        if self.prefix_cache is not None:
            match = self.prefix_cache.match(req.prompt_ids[: len(req.prompt_ids) - 1])
            self.prefix_cache.lock(match.node)
        need = req.max_total_tokens() - (len(match) if match else 0)
        locked = self.prefix_cache.locked_tokens if self.prefix_cache else 0
        if self.reserved_slots + need + locked > self.kv_capacity:
            if match is not None:
                self.prefix_cache.unlock(match.node)
            return False
        self._reservations[req] = need
        if match is not None:
            req.prefix_node = match.node
            if len(match):
                pool = self.runner.req_to_token_pool
                req.req_pool_idx = pool.alloc()
                pool.write(req.req_pool_idx, 0, match.slots.to(pool.req_to_token.device))
                req.num_prefix_tokens = req.num_cached_tokens = req.num_allocated_tokens = len(match)
                req.num_reused_tokens = len(match)
        return True

    def _cache_computed(self, req: Req) -> None:
        """Hand the KV a request has computed so far to the prefix cache: after each prefill, so
        requests admitted from now on (not only after it ends) reuse it, and when it ends.  The
        request keeps those slots as its locked prefix; its reservation shrinks by as many, so
        reservations plus locked cached KV still never exceed the pool."""
        cache, pool = self.prefix_cache, self.runner.req_to_token_pool
        computed, old_prefix = req.num_cached_tokens, req.num_prefix_tokens
        if computed <= old_prefix:
            return
        slots = pool.req_to_token[req.req_pool_idx, :computed].clone().cpu()
        already = cache.insert(req.all_ids[:computed], slots)
        match = cache.match(req.all_ids[:computed])
        if already > old_prefix:  # another request cached these first: use its slots, free ours
            self.runner.kv_pool.free(slots[old_prefix:already])
            pool.write(req.req_pool_idx, old_prefix, match.slots[old_prefix:already].to(pool.req_to_token.device))
        cache.lock(match.node)
        if req.prefix_node is not None:
            cache.unlock(req.prefix_node)
        req.prefix_node, req.num_prefix_tokens = match.node, computed
        if req in self._reservations:  # batches built by hand (tests, benchmarks) reserve nothing
            self._reservations[req] -= computed - old_prefix

    def _make_room(self, num_slots: int) -> None:
        short = num_slots - self.runner.kv_pool.num_free
        if short > 0 and self.prefix_cache is not None:
            self.prefix_cache.evict(short)

    def _process_result(self, batch: ScheduleBatch, result: StepOutput) -> list[Req]:
        out = result.sampler
        next_ids = out.next_token_ids.tolist()
        finished = []
        running = set(self.running)
        for i, (req, seq_len, samples) in enumerate(zip(batch.reqs, batch.seq_lens, batch.samples)):
            req.num_cached_tokens = seq_len
            if not samples:
                continue  # a prompt chunk: its KV is kept, its token comes with the last chunk
            n_before = len(req.output_ids)
            req.append_token(next_ids[i])
            if req.params.logprobs is not None and len(req.output_ids) > n_before:
                req.output_logprobs.append(_logprob_entry(out, i, req.params.logprobs))
            if req.finished:
                finished.append(req)
                self._release(req)
            elif req not in running:
                self.running.append(req)
        if finished:
            self.running = [r for r in self.running if not r.finished]
        return finished

    def _release(self, req: Req, cache: bool = True) -> None:
        """Return what a request holds (idempotent): its table row, its reservation, its lock on
        the prefix cache, and its KV slots, which go into the prefix cache when `cache` (those
        whose KV was computed) or back to the pool."""
        if req.req_pool_idx is not None:
            if cache and self.prefix_cache is not None:
                self._cache_computed(req)
            pool = self.runner.req_to_token_pool
            # The prefix's slots belong to the cache; the rest (KV not computed, or everything
            # past the prefix when not caching) are the request's own.
            owned = pool.req_to_token[req.req_pool_idx, req.num_prefix_tokens : req.num_allocated_tokens]
            self.runner.kv_pool.free(owned.clone().cpu())
            pool.free(req.req_pool_idx)
            req.req_pool_idx = None
            req.num_cached_tokens = req.num_allocated_tokens = req.num_prefix_tokens = 0
        if req.prefix_node is not None:
            self.prefix_cache.unlock(req.prefix_node)
            req.prefix_node = None
        self._reservations.pop(req, None)

    def finish(self, rid: str, reason: FinishReason) -> bool:
        """End a waiting or running request early (an abort, or a stop string matched in the
        decoded text), releasing everything it holds.  False if no such request is in flight."""
        for queue in (self.waiting, self.running):
            for req in queue:
                if req.rid == rid:
                    queue.remove(req)
                    req.finish_reason = reason
                    self._release(req)
                    return True
        return False


def _logprob_entry(out, row: int, top_k: int) -> dict:
    entry = {"token_id": int(out.next_token_ids[row]), "logprob": float(out.chosen_logprobs[row])}
    if top_k:
        entry["top"] = list(zip(out.top_ids[row, :top_k].tolist(), out.top_logprobs[row, :top_k].tolist()))
    return entry
