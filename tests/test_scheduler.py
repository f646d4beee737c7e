"""Continuous batching: requests join and finish at different steps; stops; abort; no leaks."""

import torch

from graphexec import Engine, SamplingParams
from graphexec.batch.forward_mode import ForwardMode
from graphexec.batch.request import Req
from tests.conftest import TINY_OVERRIDES
from tests.helpers import recorded_batches
from tests.invariants import assert_no_leak


def _ids(n, seed):
    return torch.randint(3, 320, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_batched_equals_alone_and_budget_splits_prefill():
    """A request's greedy tokens do not depend on which others share its batches."""
    engine = Engine(overrides=TINY_OVERRIDES + ["scheduler.max_prefill_tokens=32", "scheduler.max_running_requests=3"])
    prompts = [_ids(n, s) for s, n in enumerate([20, 3, 30, 9, 14])]
    params = [SamplingParams(max_new_tokens=6 + 5 * i, ignore_eos=True) for i in range(5)]
    alone = [engine.generate([p], sp)[0].token_ids for p, sp in zip(prompts, params)]

    with recorded_batches(engine) as batches:
        together = [o.token_ids for o in engine.generate(prompts, params)]
    modes, sizes = [fb.forward_mode for fb in batches], [fb.batch_size for fb in batches]
    assert together == alone
    assert max(sizes) <= 3  # max_running_requests
    # The 32-token budget forces several prefill batches, interleaved with decode steps.
    assert modes.count(ForwardMode.EXTEND) >= 3 and ForwardMode.DECODE in modes
    assert_no_leak(engine)


def test_stop_token_ids_and_eos():
    engine = Engine(overrides=TINY_OVERRIDES)
    prompt = _ids(8, 1)
    (free_run,) = engine.generate([prompt], SamplingParams(max_new_tokens=12, ignore_eos=True))
    stop_at = free_run.token_ids[4]
    first = free_run.token_ids.index(stop_at)
    (stopped,) = engine.generate([prompt], SamplingParams(max_new_tokens=12, stop_token_ids=[stop_at]))
    assert stopped.token_ids == free_run.token_ids[:first]
    assert stopped.finish_reason == "stop"
    assert_no_leak(engine)


def test_max_new_tokens_zero_and_one():
    engine = Engine(overrides=TINY_OVERRIDES)
    zero, one = engine.generate([[5, 6], [5, 6]], [SamplingParams(max_new_tokens=0), SamplingParams(max_new_tokens=1, ignore_eos=True)])
    assert zero.token_ids == [] and zero.finish_reason == "length"
    assert len(one.token_ids) == 1 and one.finish_reason == "length"
    assert_no_leak(engine)


def test_context_limit_finishes_with_length():
    engine = Engine(overrides=TINY_OVERRIDES + ["cache.max_context=24"])
    (out,) = engine.generate([_ids(20, 2)], SamplingParams(max_new_tokens=100, ignore_eos=True))
    assert len(out.token_ids) == 4 and out.finish_reason == "length"  # 20 + 4 = the 24-token context
    assert_no_leak(engine)


def test_abort_frees_slots_mid_generation():
    engine = Engine(overrides=TINY_OVERRIDES)
    sched = engine.scheduler
    reqs = [Req(f"a{i}", _ids(10, i), SamplingParams(max_new_tokens=50, ignore_eos=True), (), 512) for i in range(3)]
    for r in reqs:
        sched.add_request(r)
    for _ in range(4):
        sched.step()
    assert engine.kv_cache.num_free < engine.kv_cache.num_slots
    assert sched.abort("a1") and reqs[1].finish_reason.value == "abort"
    assert not sched.abort("a1")
    while sched.has_unfinished():
        sched.step()
    assert [len(r.output_ids) for r in (reqs[0], reqs[2])] == [50, 50]
    assert_no_leak(engine)


def test_kv_pressure_queues_instead_of_failing():
    """More work than the pool holds at once: requests wait for capacity, then all complete."""
    engine = Engine(overrides=["model=tiny-llama", "capture=eager", "cache.num_slots=64"])
    outs = engine.generate([_ids(10, s) for s in range(6)], SamplingParams(max_new_tokens=20, ignore_eos=True))
    assert all(len(o.token_ids) == 20 for o in outs)
    assert_no_leak(engine)


def test_failed_forward_releases_the_batch():
    engine = Engine(overrides=TINY_OVERRIDES)

    def boom(fb):
        raise RuntimeError("injected failure")

    real = engine.runner.forward_and_sample
    engine.runner.forward_and_sample = boom
    try:
        engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=5))
    except RuntimeError as err:
        assert "injected" in str(err)
    else:
        raise AssertionError("the injected failure was swallowed")
    assert_no_leak(engine)
    engine.runner.forward_and_sample = real
    (out,) = engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=5, ignore_eos=True))
    assert len(out.token_ids) == 5


def test_chunked_prefill_equals_whole_prefill():
    """Prompts longer than the token budget run in chunks over several steps, KV kept between
    them; tokens (greedy and seeded) equal a run where every prompt fits in one batch."""
    prompts = [_ids(n, 40 + n) for n in (45, 7, 23, 61)]
    params = [
        SamplingParams(max_new_tokens=8, ignore_eos=True),
        SamplingParams(max_new_tokens=5, ignore_eos=True),
        SamplingParams(max_new_tokens=9, temperature=0.9, seed=5, ignore_eos=True),
        SamplingParams(max_new_tokens=6, temperature=0.7, top_p=0.9, seed=9, ignore_eos=True),
    ]
    whole = Engine(overrides=TINY_OVERRIDES + ["scheduler.max_prefill_tokens=512"])
    expected = [o.token_ids for o in whole.generate(prompts, params)]

    chunked = Engine(overrides=TINY_OVERRIDES + ["scheduler.max_prefill_tokens=16"])
    with recorded_batches(chunked) as batches:
        assert [o.token_ids for o in chunked.generate(prompts, params)] == expected
    extend_sizes = [fb.num_tokens for fb in batches if fb.forward_mode.is_extend()]
    assert max(extend_sizes) <= 16 and sum(extend_sizes) == sum(map(len, prompts))
    assert len(extend_sizes) >= sum(-(-len(p) // 16) for p in prompts[:1]) + 3
    assert_no_leak(chunked)


def test_mixed_chunk_batches_decode_with_prefill():
    prompts = [_ids(n, 70 + n) for n in (12, 30, 9, 25, 18)]
    params = [SamplingParams(max_new_tokens=6 + 2 * i, ignore_eos=True) for i in range(5)]
    expected = [o.token_ids for o in Engine(overrides=TINY_OVERRIDES).generate(prompts, params)]
    engine = Engine(overrides=TINY_OVERRIDES + ["scheduler.max_prefill_tokens=24", "scheduler.mixed_chunk=true"])
    with recorded_batches(engine) as batches:
        assert [o.token_ids for o in engine.generate(prompts, params)] == expected
    modes = [fb.forward_mode for fb in batches]
    assert ForwardMode.MIXED in modes
    assert_no_leak(engine)


def test_abort_of_a_half_prefilled_request_frees_its_chunks():
    engine = Engine(overrides=TINY_OVERRIDES + ["scheduler.max_prefill_tokens=8"])
    sched = engine.scheduler
    req = Req("long", _ids(40, 3), SamplingParams(max_new_tokens=4), (), 512)
    sched.add_request(req)
    sched.step()
    sched.step()
    assert req.num_computed_tokens == 16 and not req.output_ids and req in sched.waiting
    assert sched.abort("long")
    assert_no_leak(engine)


def _oversubscribed_workload():
    prompts = [_ids(12 + 3 * i, 90 + i) for i in range(8)]
    params = [
        SamplingParams(max_new_tokens=40, ignore_eos=True) if i % 2 else
        SamplingParams(max_new_tokens=40, ignore_eos=True, temperature=0.9, top_p=0.95, seed=100 + i)
        for i in range(8)
    ]
    return prompts, params


def test_oversubscribed_pool_retracts_and_keeps_every_token():
    """A pool 4x smaller than the requests' worst cases (8 requests of up to 500 tokens in all,
    120 slots): with optimistic admission running requests are retracted and resumed; every
    request still gets exactly the tokens (greedy and seeded) of a run with a large pool, and its
    stream's deltas join to them with nothing repeated or missing."""
    prompts, params = _oversubscribed_workload()
    large = Engine(overrides=TINY_OVERRIDES)
    expected = [o.token_ids for o in large.generate(prompts, params)]

    small = Engine(overrides=TINY_OVERRIDES + ["cache.num_slots=120", "scheduler.max_running_requests=8"])
    assert sum(len(p) + sp.max_new_tokens for p, sp in zip(prompts, params)) >= 4 * 120
    streams = [small.stream(p, sp) for p, sp in zip(prompts, params)]
    streamed = [[t for delta in stream for t in delta.token_ids] for stream in streams]
    outputs = [stream.result() for stream in streams]
    assert [o.token_ids for o in outputs] == expected
    assert streamed == expected
    assert small.metrics().retractions_total > 0
    assert_no_leak(small)


def test_reserve_admission_never_retracts():
    """scheduler.admission=reserve keeps the old behaviour: same tokens, requests wait instead."""
    prompts, params = _oversubscribed_workload()
    expected = [o.token_ids for o in Engine(overrides=TINY_OVERRIDES).generate(prompts, params)]
    engine = Engine(overrides=TINY_OVERRIDES + ["cache.num_slots=128", "scheduler.admission=reserve"])
    assert [o.token_ids for o in engine.generate(prompts, params)] == expected
    assert engine.metrics().retractions_total == 0
    assert_no_leak(engine)


def _first_token_steps(admission: str) -> tuple[list[int], int]:
    """Two requests that run to the end of the context (max_new_tokens=1e9, ignore_eos), then 30
    normal ones, in a pool that holds both huge ones with 10 slots to spare (less than a normal request needs).  Returns how many
    steps each normal request waited for its first token, and how many steps the huge ones took."""
    engine = Engine(overrides=TINY_OVERRIDES + ["cache.num_slots=1034", f"scheduler.admission={admission}"])
    sched = engine.scheduler
    huge = [Req(f"huge{i}", _ids(8, 200 + i), SamplingParams(max_new_tokens=10**9, ignore_eos=True), (), 512) for i in range(2)]
    normal = [Req(f"n{i}", _ids(10, 300 + i), SamplingParams(max_new_tokens=8, ignore_eos=True), (), 512) for i in range(30)]
    for req in huge + normal:
        sched.add_request(req)
    first_token: dict[str, int] = {}
    steps = 0
    while sched.has_unfinished():
        sched.step()
        steps += 1
        for req in normal:
            if req.output_ids and req.rid not in first_token:
                first_token[req.rid] = steps
    assert all(len(r.output_ids) == 8 for r in normal) and all(r.seq_len == 512 for r in huge)
    assert_no_leak(engine)
    return [first_token[r.rid] for r in normal], steps


def test_huge_requests_do_not_starve_normal_ones():
    """The bound: with optimistic admission every normal request has its first token within 100
    steps of arriving (measured: 1 or 9), while the huge requests run ~500 steps.  Reserve
    admission, for contrast, makes every normal request wait for a huge one to end (505 steps)."""
    optimistic, total = _first_token_steps("optimistic")
    assert max(optimistic) <= 100 < total
    reserve, _ = _first_token_steps("reserve")
    assert min(reserve) > 400
