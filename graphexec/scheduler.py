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
        for queue in (self.waiting, self.running):
            for req in queue:
                if req.rid == rid:
                    queue.remove(req)
                    req.finish_reason = FinishReason.ABORT
                    self._release(req)
                    return True
        return False

    def step(self) -> list[Req]:
        """Run one forward: a prefill batch if any request can be admitted, else a decode batch."""
        admitted = self._admit()
        reqs = admitted or list(self.running)
        if not reqs:
            return []
        runner = self.runner
        try:
            prepare = ScheduleBatch.prepare_for_extend if admitted else ScheduleBatch.prepare_for_decode
            batch = prepare(reqs, runner.req_to_token_pool, runner.kv_pool)
            result = runner.forward_and_sample(runner.init_forward_batch(batch))
        except BaseException:
            # Leave the pools as if these requests had never run; other requests are untouched.
            for req in reqs:
                req.finish_reason = FinishReason.ABORT
                self._release(req)
            self.running = [r for r in self.running if not r.finished]
            raise
        return self._process_result(batch, result)

    def _admit(self) -> list[Req]:
        admitted: list[Req] = []
        budget = self.config.max_prefill_tokens
        while self.waiting and len(self.running) + len(admitted) < self.config.max_running_requests:
            req = self.waiting[0]
            new_tokens = req.seq_len - req.num_cached_tokens
            # A prompt longer than the whole budget still runs, alone, rather than starving.
            # TODO(chunked prefill): split it into budget-sized chunks instead.
            if admitted and new_tokens > budget:
                break
            if self.reserved_slots + req.max_total_tokens() > self.kv_capacity:
                break
            self.waiting.popleft()
            self._reservations[req] = req.max_total_tokens()
            admitted.append(req)
            budget -= new_tokens
        return admitted

    def _process_result(self, batch: ScheduleBatch, result: StepOutput) -> list[Req]:
        out = result.sampler
        next_ids = out.next_token_ids.tolist()
        finished = []
        for i, (req, seq_len) in enumerate(zip(batch.reqs, batch.seq_lens)):
            req.num_cached_tokens = seq_len
            n_before = len(req.output_ids)
            req.append_token(next_ids[i])
            if req.params.logprobs is not None and len(req.output_ids) > n_before:
                req.output_logprobs.append(_logprob_entry(out, i, req.params.logprobs))
            if req.finished:
                finished.append(req)
                self._release(req)
            elif batch.forward_mode.is_extend():
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


def _logprob_entry(out, row: int, top_k: int) -> dict:
    entry = {"token_id": int(out.next_token_ids[row]), "logprob": float(out.chosen_logprobs[row])}
    if top_k:
        entry["top"] = list(zip(out.top_ids[row, :top_k].tolist(), out.top_logprobs[row, :top_k].tolist()))
    return entry
