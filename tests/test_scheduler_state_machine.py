"""The scheduler and the KV cache manager under random traffic, against a model whose KV is checkable.

A Hypothesis state machine drives arrivals (prompts sharing prefixes), steps and aborts through tiny
pools, with either admission policy, the prefix cache on or off, chunked and mixed prefill.  The
stand-in model writes each token id into its KV slot and, before sampling a request, checks that
every position of the request maps to a slot holding that position's token: what attention would
read.  Its next token is a pure function of the request's ids, so the tokens of an unpressured run
are known exactly.  After every step: each slot free, cached or owned by one request (audit), lock
counts equal to the holdings; at the end every finished request has exactly its unpressured tokens
and the pool is whole again.  With speculation drawn on, decode steps verify n-gram drafts
(TARGET_VERIFY): each verified row is checked against its request's ids plus the drafts before
it, and rejected drafts must leave no slot behind and nothing wrong in the prefix cache.

The default run is 250 examples (the suite's 15-minute budget; each run draws new ones);
GRAPHEXEC_SOAK=1 runs 20,000 (`pytest -m soak`).
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from graphexec import SamplingParams
from graphexec.batch.request import Req
from graphexec.cache.kv_pool import TokenToKVPool
from graphexec.cache.manager import KVCacheManager
from graphexec.cache.req_to_token_pool import ReqToTokenPool
from graphexec.config import SchedulerConfig, SpeculativeConfig
from graphexec.runner.model_runner import StepOutput
from graphexec.sampling.sampler import SamplerOutput
from graphexec.scheduler.scheduler import Scheduler
from graphexec.speculative import Speculator

EOS = 3
MAX_CONTEXT = 32
# Prompts start with one of a few bases, so the prefix cache sees shared prefixes.
BASES = [[10, 11, 12, 13, 14, 15, 16, 17], [10, 11, 12, 20, 21], [30, 31]]


def next_token(ids: list[int]) -> int:
    """The stand-in model: a pure function of the request's ids (EOS now and then)."""
    return (sum((k + 1) * t for k, t in enumerate(ids[-3:])) + len(ids)) % 40 + 3


def unpressured(prompt: list[int], params: SamplingParams) -> list[int]:
    req = Req("reference", list(prompt), params, (EOS,), MAX_CONTEXT)
    while not req.finished:
        req.append_token(next_token(req.all_ids))
    return req.output_ids


class TokenKVRunner:
    """What the scheduler uses of ModelRunner, with KV that stores token ids (see the module doc)."""

    device = torch.device("cpu")

    def __init__(self, kv: KVCacheManager):
        self.kv = kv
        self.store = torch.full((kv.num_slots + 1,), -1, dtype=torch.int64)
        self.forwards = 0
        self.verify_forwards = 0

    def init_forward_batch(self, batch):
        return batch

    def forward_and_sample(self, batch) -> StepOutput:
        self.forwards += 1
        self.verify_forwards += batch.drafts is not None
        assert batch.out_cache_loc.numel() == len(batch.input_ids)
        self.store[batch.out_cache_loc] = torch.tensor(batch.input_ids, dtype=torch.int64)
        table = self.kv.req_to_token_pool.req_to_token
        next_ids = []
        for req, row, seq_len, ids in zip(batch.row_owners(), batch.req_pool_indices, batch.seq_lens, _row_ids(batch)):
            assert self.store[table[row, :seq_len]].tolist() == ids, f"{req.rid} reads wrong KV"
            next_ids.append(next_token(ids))
        return StepOutput(SamplerOutput(next_token_ids=torch.tensor(next_ids)), logits=torch.empty(0))


def _row_ids(batch) -> list[list[int]]:
    """The ids each row's KV must hold: the request's first seq_len ids; in a verify batch, row i
    of a request holds its ids up to its last token, then its first i draft tokens."""
    if batch.drafts is None:
        return [req.all_ids[:n] for req, n in zip(batch.reqs, batch.seq_lens)]
    return [
        req.all_ids[: old + 1] + list(draft[:i])
        for req, old, draft in zip(batch.reqs, batch.prefix_lens, batch.drafts)
        for i in range(len(draft) + 1)
    ]


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(
        num_slots=st.integers(MAX_CONTEXT, 96),
        max_running=st.integers(1, 4),
        prefill_tokens=st.integers(1, 24),
        mixed=st.booleans(),
        admission=st.sampled_from(["optimistic", "reserve"]),
        prefix_cache=st.booleans(),
        ratio=st.sampled_from([0.0, 0.3, 0.7]),
        draft_tokens=st.sampled_from([0, 0, 1, 3]),
    )
    def setup(self, num_slots, max_running, prefill_tokens, mixed, admission, prefix_cache, ratio, draft_tokens):
        pools = TokenToKVPool(num_slots, 1, 1, 1, torch.float32), ReqToTokenPool(max_running, MAX_CONTEXT)
        self.kv = KVCacheManager(*pools, prefix_cache=prefix_cache)
        config = SchedulerConfig(
            max_running_requests=max_running, max_prefill_tokens=prefill_tokens, mixed_chunk=mixed,
            admission=admission, init_new_token_ratio=ratio, min_new_token_ratio=min(ratio, 0.1),
            new_token_ratio_decay=0.05,
        )
        self.runner = TokenKVRunner(self.kv)
        speculator = None
        if draft_tokens:
            spec = SpeculativeConfig(method="ngram", num_draft_tokens=draft_tokens, ngram_min=1, ngram_max=2, policy="always")
            speculator = Speculator(spec)
        self.scheduler = Scheduler(self.runner, self.kv, config, speculator)
        self.reqs: list[Req] = []
        self.aborted: set[str] = set()

    @rule(
        base=st.integers(0, len(BASES)),
        suffix=st.lists(st.integers(40, 60), max_size=12),
        max_new=st.integers(1, 24),
        ignore_eos=st.booleans(),
    )
    def arrive(self, base, suffix, max_new, ignore_eos):
        prompt = (BASES[base] if base < len(BASES) else []) + suffix
        if not prompt or len(prompt) >= MAX_CONTEXT:
            return
        req = Req(f"r{len(self.reqs)}", prompt, SamplingParams(max_new_tokens=max_new, ignore_eos=ignore_eos), (EOS,), MAX_CONTEXT)
        self.reqs.append(req)
        self.scheduler.add_request(req)

    @precondition(lambda self: self.scheduler.has_unfinished())
    @rule()
    def step(self):
        self.scheduler.step()

    @precondition(lambda self: self.scheduler.has_unfinished())
    @rule(pick=st.integers(0, 10**6))
    def abort(self, pick):
        live = [r for r in self.reqs if not r.finished]
        victim = live[pick % len(live)]
        assert self.scheduler.abort(victim.rid)
        self.aborted.add(victim.rid)

    @invariant()
    def every_slot_owned_once(self):
        self.kv.audit()
        holders = set(self.kv.holders())
        # Only running requests and the half-prefilled head of the queue hold KV.
        assert holders <= set(self.scheduler.running) | set(list(self.scheduler.waiting)[:1])
        assert set(self.scheduler.running) <= holders
        assert len(self.scheduler.running) <= self.scheduler.config.max_running_requests

    def teardown(self):
        if not hasattr(self, "scheduler"):
            return
        for _ in range(10_000):
            if not self.scheduler.has_unfinished():
                break
            self.scheduler.step()
            self.kv.audit()
        assert not self.scheduler.has_unfinished(), "requests never finished"
        for req in self.reqs:
            if req.rid not in self.aborted:
                assert req.output_ids == unpressured(req.prompt_ids, req.params), f"{req.rid} (retracted {req.num_retractions}x)"
        kv = self.kv
        assert kv.num_free + kv.num_cached == kv.num_slots and kv.num_locked == 0 and not kv.holders()
        assert kv.num_free_rows == kv.req_to_token_pool.max_requests


_COMMON = dict(deadline=None, stateful_step_count=40, suppress_health_check=list(HealthCheck))

TestScheduler = SchedulerMachine.TestCase
TestScheduler.settings = settings(max_examples=250, **_COMMON)


@pytest.mark.soak
@pytest.mark.skipif(not os.environ.get("GRAPHEXEC_SOAK"), reason="a long randomized run: set GRAPHEXEC_SOAK=1")
def test_scheduler_soak():
    machine = type("SoakMachine", (SchedulerMachine,), {})
    case = machine.TestCase
    case.settings = settings(max_examples=20_000, **_COMMON)
    case("runTest").runTest()


def test_the_stand_in_model_catches_a_wrong_mapping():
    """The KV check is real: a table row pointing at another request's slot fails the forward."""
    kv = KVCacheManager(TokenToKVPool(16, 1, 1, 1, torch.float32), ReqToTokenPool(2, MAX_CONTEXT), prefix_cache=False)
    runner = TokenKVRunner(kv)
    scheduler = Scheduler(runner, kv, SchedulerConfig(max_running_requests=2, max_prefill_tokens=16, mixed_chunk=False))
    a, b = (Req(n, p, SamplingParams(max_new_tokens=4, ignore_eos=True), (EOS,), MAX_CONTEXT) for n, p in [("a", [5, 6]), ("b", [7, 8])])
    scheduler.add_request(a)
    scheduler.add_request(b)
    scheduler.step()
    table = kv.req_to_token_pool.req_to_token
    table[kv.row(a), 0] = table[kv.row(b), 0]
    with pytest.raises(AssertionError, match="a reads wrong KV"):
        scheduler.step()


def test_the_machine_verifies_drafts_and_keeps_every_token():
    """The speculating configuration of the machine does verify drafts (the stand-in model's
    tokens repeat, so n-grams match), accepts some, and leaves exactly the unpressured tokens."""
    machine = SchedulerMachine()
    machine.setup(num_slots=40, max_running=3, prefill_tokens=16, mixed=False, admission="optimistic",
                  prefix_cache=True, ratio=0.3, draft_tokens=3)
    for i in range(6):
        machine.arrive(base=i % 4, suffix=[40 + i, 41], max_new=24, ignore_eos=True)
    for _ in range(3):
        machine.step()
        machine.every_slot_owned_once()
    machine.teardown()
    stats = machine.scheduler.speculator.stats()
    assert machine.runner.verify_forwards > 0 and stats.accepted_tokens > 0
