"""A continuous-batching scheduler: prefill first under a token budget, then decode.

It decides what runs; the KV cache manager (graphexec/cache/manager.py) does the accounting
and the admission policy (graphexec/scheduler/admission.py) says whether the head of the queue may start.
One step:

1. Admit waiting requests in order while the policy agrees, the prefill token budget lasts and
   table rows remain; each maps its cached prefix and computes the rest, in chunks when long.
2. If any were admitted, run them (with `mixed_chunk`, the running decodes ride along);
   otherwise decode every running request.
3. If the forward cannot get its slots (free or evictable), retract running requests, the one
   with the most tokens left first: their computed KV goes to the prefix cache, they go back to
   the head of the queue and later resume by recomputing prompt + output so far (what the cache
   kept is reused), with their outputs and random streams untouched.
4. Record the sampled tokens; cache what the prefills computed; release what finished.

With a speculator (graphexec/speculative/), a decode step may instead verify drafts: each running
request's last token and its draft tokens run as one TARGET_VERIFY forward (slots for all of
them, taken from what the decode step leaves spare), each request keeps the drafts its sampled
rows agreed with plus the token of the first row that disagreed (or of the last row), and the
slots of the rejected drafts go back at once, so the KV and the prefix cache hold accepted
tokens only.  Whenever a request stops running (finished, aborted, retracted) the speculator is
told (`Speculator.forget`), so a draft model's KV for it goes too.
"""

from __future__ import annotations

import time
from collections import deque

from graphexec.batch.request import FinishReason, Req
from graphexec.batch.schedule_batch import ScheduleBatch
from graphexec.cache.manager import KVCacheManager
from graphexec.config import SchedulerConfig
from graphexec.runner.model_runner import ModelRunner, StepOutput
from graphexec.sampling.sampler import make_generator
from graphexec.scheduler.admission import create_admission
from graphexec.speculative import Speculator


class Scheduler:
    def __init__(
        self, runner: ModelRunner, kv_cache: KVCacheManager, config: SchedulerConfig, speculator: Speculator | None = None
    ):
        self.runner = runner
        self.kv_cache = kv_cache
        self.config = config
        self.speculator = speculator
        self.admission = create_admission(config)
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.num_retractions = 0

    @property
    def promised_slots(self) -> int:
        """Slots the admission policy counts as spoken for beyond what holders have mapped."""
        return self.admission.promised(self.kv_cache)

    def flush_cache(self) -> int:
        """Evict the whole prefix cache; refused while requests are in flight.  Returns slots freed."""
        if self.has_unfinished():
            raise RuntimeError("flush_cache: requests are in flight; flush when the engine is idle")
        return self.kv_cache.flush()

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add_request(self, req: Req) -> None:
        """Queue a validated request; one that asks for no tokens (and no prompt logprobs)
        finishes at once."""
        if req.params.max_new_tokens == 0 and req.prompt_logprobs is None:
            req.finish_reason = FinishReason.LENGTH
            return
        req.generator = make_generator(req.params.seed, self.runner.device)
        self.waiting.append(req)

    def abort(self, rid: str) -> bool:
        return self.finish(rid, FinishReason.ABORT)

    def step(self) -> list[Req]:
        """Run one forward (a prefill batch if any request can be admitted, else a decode batch)
        and return the requests it finished."""
        mixed = self.config.mixed_chunk and bool(self.running)
        admitted, chunks = self._admit(self.config.max_prefill_tokens - (len(self.running) if mixed else 0))
        decoding = not admitted or mixed
        if decoding:
            self._retract_for(sum(chunks) + len(self.running))
        reqs = admitted + (self.running if decoding else [])
        if not reqs:
            return []
        lens = chunks + [1] * (len(reqs) - len(admitted))
        drafts = None
        started = time.perf_counter()
        try:
            # Inside the try: a draft model's forward failing fails the step like the target's.
            if not admitted and self.speculator is not None:
                drafts = self.speculator.drafts(reqs, self.kv_cache.num_available - len(reqs))
                if drafts is not None:
                    lens = [len(d) + 1 for d in drafts]
            slots = self.kv_cache.allocate(reqs, lens)
            rows = self.kv_cache.rows(reqs)
            if admitted:
                batch = ScheduleBatch.extend(reqs, lens, rows, slots, mixed=decoding)
            elif drafts is not None:
                batch = ScheduleBatch.verify(reqs, drafts, rows, slots)
            else:
                batch = ScheduleBatch.decode(reqs, rows, slots)
            result = self.runner.forward_and_sample(self.runner.init_forward_batch(batch))
        except BaseException:
            # Leave the pools as if these requests had never run; other requests are untouched.
            for req in reqs:
                req.finish_reason = FinishReason.ABORT
                self._stop(req, cache=False)  # its KV may be half written
            self.running = [r for r in self.running if not r.finished]
            self.waiting = deque(r for r in self.waiting if not r.finished)
            raise
        if not admitted:
            self.admission.on_decode_step()
        if drafts is not None:
            finished = self._process_verify(batch, result)
        else:
            finished = self._process_result(batch, result)
        if not admitted and self.speculator is not None:
            self.speculator.observe_step(batch.batch_size, time.perf_counter() - started, drafts is not None)
        if self.kv_cache.prefix_cache is not None:
            for req in admitted:
                if not req.finished:
                    self.kv_cache.cache_computed(req)
        return finished

    def _admit(self, budget: int) -> tuple[list[Req], list[int]]:
        """Waiting requests for the next prefill and how many new tokens each computes now.

        A prompt longer than the remaining budget is cut into chunks over several steps; it stays
        at the head of the queue, holding its KV, until its last chunk runs.
        """
        admitted: list[Req] = []
        chunks: list[int] = []
        decode_tokens = len(self.running) if self.config.mixed_chunk else 0
        while budget > 0 and self.waiting and len(self.running) + len(admitted) < self.config.max_running_requests:
            req = self.waiting[0]
            if not self.kv_cache.holds(req) and not self._start(req):
                break
            remaining = req.seq_len - req.num_computed_tokens
            chunk = min(remaining, budget)
            if not self.kv_cache.can_allocate(sum(chunks) + chunk + decode_tokens):
                break  # its next chunk must wait for room (decode steps free it or retract)
            admitted.append(req)
            chunks.append(chunk)
            budget -= chunk
            if chunk < remaining:
                break
            self.waiting.popleft()
        return admitted, chunks

    def _start(self, req: Req) -> bool:
        """Admit the request into the KV cache (its cached prefix mapped) if the policy agrees."""
        # A cached prefix has no logits: a request still owed prompt logprobs computes it again.
        reused = self.kv_cache.admit(req, reuse_prefix=not req.prompt_logprobs_pending)
        if not self.admission.admits(req, self.kv_cache):
            self.kv_cache.release(req, cache=False)
            return False
        req.num_computed_tokens = reused
        if req.num_retractions == 0:
            req.num_reused_tokens = reused
        return True

    def _retract_for(self, num_slots: int) -> None:
        """Retract running requests until a forward of `num_slots` new tokens (one per running
        request among them) can get its slots."""
        victims: list[Req] = []
        while not self.kv_cache.can_allocate(num_slots) and self.running:
            victim = max(
                enumerate(self.running), key=lambda item: (item[1].max_total_tokens() - item[1].seq_len, item[0])
            )[1]
            self.running.remove(victim)
            self._stop(victim)
            victim.num_computed_tokens = 0
            victim.num_retractions += 1
            victims.append(victim)
            num_slots -= 1
        if not victims:
            return
        self.num_retractions += len(victims)
        self.admission.on_retract()
        # Back at the head of the queue, in the order they were running; behind a request whose
        # prompt is half prefilled, which holds KV and must finish first.
        at = 1 if self.waiting and self.kv_cache.holds(self.waiting[0]) else 0
        for victim in reversed(victims):
            self.waiting.insert(at, victim)

    def _process_result(self, batch: ScheduleBatch, result: StepOutput) -> list[Req]:
        out = result.sampler
        next_ids = out.next_token_ids.tolist()
        for i, position, entries in result.prompt_logprobs:
            batch.reqs[i].prompt_logprobs[position : position + len(entries)] = entries
        finished = []
        running = set(self.running)
        for i, (req, seq_len, samples) in enumerate(zip(batch.reqs, batch.seq_lens, batch.samples)):
            req.num_computed_tokens = seq_len
            if not samples:
                continue  # a prompt chunk: its KV is kept, its token comes with the last chunk
            if req.params.max_new_tokens == 0:  # prefilled for its prompt logprobs only
                req.finish_reason = FinishReason.LENGTH
            else:
                self._record_token(req, out, i, next_ids[i])
            if req.finished:
                finished.append(req)
                self._stop(req)
            elif req not in running:
                self.running.append(req)
        if finished:
            self.running = [r for r in self.running if not r.finished]
        return finished

    def _process_verify(self, batch: ScheduleBatch, result: StepOutput) -> list[Req]:
        """Per request: its rows' tokens in order while each equals the next draft token (the
        sampler accepted it), then the first that does not, or the last row's; the KV of the
        rejected drafts is unmapped and freed."""
        out = result.sampler
        next_ids = out.next_token_ids.tolist()
        finished = []
        row = 0
        for req, draft in zip(batch.reqs, batch.drafts):
            old_len = req.num_computed_tokens
            accepted = 0
            for j in range(len(draft) + 1):
                self._record_token(req, out, row + j, next_ids[row + j])
                if req.finished or j == len(draft) or next_ids[row + j] != draft[j]:
                    break
                accepted += 1
            row += len(draft) + 1
            # Valid KV: the last token's and the accepted drafts' (each computed on accepted ids only).
            computed = min(old_len + 1 + accepted, req.seq_len)
            self.kv_cache.truncate(req, computed)
            req.num_computed_tokens = computed
            self.speculator.observe(req, len(draft), accepted)
            if req.finished:
                finished.append(req)
                self._stop(req)
        if finished:
            self.running = [r for r in self.running if not r.finished]
        return finished

    @staticmethod
    def _record_token(req: Req, out, row: int, token_id: int) -> None:
        n_before = len(req.output_ids)
        req.append_token(token_id)
        if req.params.logprobs is not None and len(req.output_ids) > n_before:
            req.output_logprobs.append(_logprob_entry(out, row, req.params.logprobs))

    def finish(self, rid: str, reason: FinishReason) -> bool:
        """End a waiting or running request early (an abort, or a stop string matched in the
        decoded text), releasing everything it holds.  False if no such request is in flight."""
        for queue in (self.waiting, self.running):
            for req in queue:
                if req.rid == rid:
                    queue.remove(req)
                    req.finish_reason = reason
                    self._stop(req)
                    return True
        return False

    def _stop(self, req: Req, cache: bool = True) -> None:
        """The request stops running (finished, aborted, retracted): release its KV (its computed
        KV cached when `cache`) and whatever the speculator keeps for it (a draft model's KV)."""
        self.kv_cache.release(req, cache=cache)
        if self.speculator is not None:
            self.speculator.forget(req)


def _logprob_entry(out, row: int, top_k: int) -> dict:
    entry = {"token_id": int(out.next_token_ids[row]), "logprob": float(out.chosen_logprobs[row])}
    if top_k:
        entry["top"] = list(zip(out.top_ids[row, :top_k].tolist(), out.top_logprobs[row, :top_k].tolist()))
    return entry
