"""A minimal continuous-batching scheduler: prefill first under a token budget, then decode.

Admission reserves each request's worst-case KV (prompt + max_new_tokens, capped by the context),
so a running request can always take its next decode slot and nothing ever needs preempting.
"""

from __future__ import annotations

from collections import deque

from graphexec.config import SchedulerConfig
from graphexec.model_runner import ModelRunner, StepOutput
from graphexec.request import FinishReason, Req
from graphexec.sampler import make_generator
from graphexec.schedule_batch import ScheduleBatch


class Scheduler:
    def __init__(self, runner: ModelRunner, config: SchedulerConfig):
        self.runner = runner
        self.config = config
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        # Worst-case KV slots promised to each admitted request.
        self._reservations: dict[Req, int] = {}

    @property
    def kv_capacity(self) -> int:
        return self.runner.kv_pool.num_slots

    @property
    def reserved_slots(self) -> int:
        return sum(self._reservations.values())

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
                self._release(req)
            self.running = [r for r in self.running if not r.finished]
            self.waiting = deque(r for r in self.waiting if not r.finished)
            raise
        return self._process_result(batch, result)

    def _admit(self, budget: int) -> tuple[list[Req], list[int]]:
        """Waiting requests for the next prefill and how many new tokens each computes now.

        A prompt longer than the remaining budget is cut into chunks over several steps; it stays
        at the head of the queue, its KV and reservation kept, until its last chunk runs.
        """
        admitted: list[Req] = []
        chunks: list[int] = []
        while budget > 0 and self.waiting and len(self.running) + len(admitted) < self.config.max_running_requests:
            req = self.waiting[0]
            if req not in self._reservations:
                if self.reserved_slots + req.max_total_tokens() > self.kv_capacity:
                    break
                self._reservations[req] = req.max_total_tokens()
            remaining = req.seq_len - req.num_cached_tokens
            chunk = min(remaining, budget)
            admitted.append(req)
            chunks.append(chunk)
            budget -= chunk
            if chunk < remaining:
                break
            self.waiting.popleft()
        return admitted, chunks

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

    def _release(self, req: Req) -> None:
        """Return a request's KV slots, table row and reservation (idempotent)."""
        if req.req_pool_idx is not None:
            pool = self.runner.req_to_token_pool
            slots = pool.req_to_token[req.req_pool_idx, : req.num_allocated_tokens].clone()
            self.runner.kv_pool.free(slots.cpu())
            pool.free(req.req_pool_idx)
            req.req_pool_idx = None
            req.num_cached_tokens = req.num_allocated_tokens = 0
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
