"""The prefix cache: the radix tree itself, then the engine reusing cached prompt prefixes."""

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from graphexec import Engine, SamplingParams
from graphexec.cache.prefix_cache import RadixCache
from tests.helpers import recorded_batches, slowed
from tests.invariants import assert_no_leak

TINY = ["model=tiny-llama", "capture=eager", "cache.num_slots=2048"]
PARAMS = SamplingParams(max_new_tokens=5, ignore_eos=True)


def _slots(*values):
    return torch.tensor(values, dtype=torch.int64)


@pytest.fixture()
def tree():
    freed = []
    cache = RadixCache(lambda slots: freed.extend(slots.tolist()))
    cache.freed = freed
    return cache


# -- the tree -------------------------------------------------------------------------------------


def test_match_returns_the_longest_cached_prefix_splitting_an_edge(tree):
    assert len(tree.match([1, 2, 3])) == 0
    assert tree.insert([1, 2, 3, 4], _slots(11, 12, 13, 14)) == 0
    assert tree.match([1, 2, 3, 4, 5]).slots.tolist() == [11, 12, 13, 14]
    partial = tree.match([1, 2, 9])
    assert partial.slots.tolist() == [11, 12] and partial.node.key == (1, 2)  # the edge was cut
    assert tree.match([1, 2, 3, 4]).slots.tolist() == [11, 12, 13, 14]  # still whole through the cut
    assert tree.cached_tokens == 4


def test_insert_reports_what_was_cached_already_and_keeps_the_first_slots(tree):
    tree.insert([1, 2, 3], _slots(11, 12, 13))
    assert tree.insert([1, 2, 3, 4, 5], _slots(21, 22, 23, 24, 25)) == 3
    assert tree.match([1, 2, 3, 4, 5]).slots.tolist() == [11, 12, 13, 24, 25]
    assert tree.insert([1, 2, 7], _slots(31, 32, 33)) == 2
    assert tree.match([1, 2, 7]).slots.tolist() == [11, 12, 33]
    assert tree.cached_tokens == 6


def test_eviction_takes_least_recently_used_unlocked_leaves_first(tree):
    tree.insert([1, 2, 3], _slots(11, 12, 13))
    tree.insert([1, 2, 4], _slots(11, 12, 14))
    tree.insert([5, 6], _slots(15, 16))
    tree.match([1, 2, 3])  # touched last: [1, 2, 4] is now the oldest leaf, then [5, 6]
    assert tree.evict(1) == 1 and tree.freed == [14]
    assert tree.evict(1) == 2 and tree.freed[-2:] == [15, 16]
    assert tree.evict(10) == 3 and sorted(tree.freed[-3:]) == [11, 12, 13]  # leaf, then its parent
    assert tree.cached_tokens == 0 and not tree.root.children


def test_locked_paths_survive_eviction_until_unlocked(tree):
    tree.insert([1, 2, 3, 4], _slots(11, 12, 13, 14))
    held = tree.match([1, 2])  # splits [1,2 | 3,4]
    tree.lock(held.node)
    assert (tree.locked_tokens, tree.evictable_tokens) == (2, 2)
    assert tree.evict(10) == 2 and tree.freed == [13, 14]
    with pytest.raises(RuntimeError, match="in use by running requests"):
        tree.reset()
    tree.unlock(held.node)
    tree.reset()
    assert tree.cached_tokens == tree.locked_tokens == 0 and sorted(tree.freed) == [11, 12, 13, 14]
    with pytest.raises(RuntimeError, match="not locked"):
        tree.unlock(held.node)


@settings(max_examples=200, deadline=None)
@given(
    keys=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=8), min_size=1, max_size=12),
    probes=st.lists(st.lists(st.integers(0, 3), max_size=9), max_size=8),
    evict=st.integers(0, 40),
)
def test_tree_agrees_with_a_table_of_every_cached_prefix(keys, probes, evict):
    """Reference: a dict from every inserted prefix to the slot its last token got from the
    first insert that reached it.  The tree must match it, own each slot once, and after an
    eviction still hold a prefix-closed subset of it."""
    freed: list[int] = []
    tree = RadixCache(lambda slots: freed.extend(slots.tolist()))
    table: dict[tuple[int, ...], int] = {}
    fresh = itertools.count(1)
    for key in keys:
        slots = [next(fresh) for _ in key]
        already = tree.insert(key, torch.tensor(slots))
        assert already == max((i for i in range(len(key) + 1) if tuple(key[:i]) in table or i == 0))
        freed.extend(slots[:already])  # the caller frees the duplicates
        for i in range(len(key)):
            table.setdefault(tuple(key[: i + 1]), slots[i])
    assert tree.cached_tokens == len(table)

    def expected(probe):
        n = max(i for i in range(len(probe) + 1) if i == 0 or tuple(probe[:i]) in table)
        return [table[tuple(probe[: i + 1])] for i in range(n)]

    for probe in probes + keys:
        assert tree.match(probe).slots.tolist() == expected(probe)

    locked = tree.match(keys[0])
    tree.lock(locked.node)
    tree.evict(evict)
    kept = {prefix: slot for prefix, slot in table.items() if slot not in freed}
    assert tree.cached_tokens == len(kept) and all(prefix[:-1] in kept or len(prefix) == 1 for prefix in kept)
    assert all(tuple(keys[0][: i + 1]) in kept for i in range(len(keys[0])))  # locked path stays
    table = kept
    for probe in probes + keys:
        assert tree.match(probe).slots.tolist() == expected(probe)
    tree.unlock(locked.node)
    tree.reset()
    assert tree.cached_tokens == 0 and sorted(freed) == list(range(1, next(fresh)))


# -- the engine -----------------------------------------------------------------------------------


def _prompts(shared=24, tails=(7, 12, 3), seed=0):
    gen = torch.Generator().manual_seed(seed)
    prefix = torch.randint(3, 320, (shared,), generator=gen).tolist()
    return [prefix + torch.randint(3, 320, (n,), generator=gen).tolist() for n in tails]


@pytest.fixture(scope="module")
def uncached_tokens():
    engine = Engine(overrides=TINY + ["cache.prefix_cache=false"])
    assert engine.kv_cache.prefix_cache is None
    return [engine.generate([p], PARAMS)[0].token_ids for p in _prompts()]


def test_requests_sharing_a_prefix_compute_only_their_own_tokens(uncached_tokens):
    engine = Engine(overrides=TINY)
    prompts = _prompts()
    with recorded_batches(engine) as batches:
        got = [engine.generate([p], PARAMS)[0].token_ids for p in prompts]
    assert got == uncached_tokens
    prefills = [fb for fb in batches if fb.forward_mode.is_extend()]
    assert [fb.extend_prefix_lens.tolist() for fb in prefills] == [[0], [24], [24]]
    assert [fb.extend_num_tokens for fb in prefills] == [31, 12, 3]
    assert_no_leak(engine)
    # Each request's prompt and output KV (but its last sampled token) is now cached, once.
    assert engine.kv_cache.num_cached == 24 + (7 + 4) + (12 + 4) + (3 + 4)


def test_a_prompt_is_cached_once_prefilled_not_only_when_its_request_ends(uncached_tokens):
    """A budget of one 31-token prompt per step: the second request is admitted while the first
    still decodes, and reuses the shared 24 tokens the first has just prefilled."""
    engine = Engine(overrides=TINY + ["scheduler.max_prefill_tokens=31"])
    with recorded_batches(engine) as batches:
        outputs = engine.generate(_prompts()[:2], PARAMS)
    assert [o.token_ids for o in outputs] == uncached_tokens[:2]
    prefills = [fb.extend_prefix_lens.tolist() for fb in batches if fb.forward_mode.is_extend()]
    assert prefills[:2] == [[0], [24]] and outputs[1].cached_tokens == 24
    assert_no_leak(engine)


def test_a_repeated_prompt_still_computes_its_last_token(uncached_tokens):
    engine = Engine(overrides=TINY)
    prompt = _prompts()[0]
    engine.generate([prompt], PARAMS)
    with recorded_batches(engine) as batches:
        again = engine.generate([prompt], PARAMS)[0].token_ids
    assert again == uncached_tokens[0]
    assert batches[0].extend_prefix_lens.tolist() == [len(prompt) - 1] and batches[0].extend_num_tokens == 1
    assert_no_leak(engine)


def test_a_full_pool_evicts_cached_kv_and_keeps_serving(uncached_tokens):
    """48 slots: each request needs up to 36, so every admission after the first evicts."""
    engine = Engine(overrides=["model=tiny-llama", "capture=eager", "cache.num_slots=48"])
    for _ in range(3):
        assert [engine.generate([p], PARAMS)[0].token_ids for p in _prompts()] == uncached_tokens
        assert_no_leak(engine)
    assert engine.kv_cache.num_cached <= 48


def test_concurrent_requests_under_pressure_queue_evict_and_match_uncached(uncached_tokens):
    """96 slots for six requests of up to 41: admission waits on reservations, later requests hit
    prefixes that earlier ones cached, eviction makes room, and nothing changes a token."""
    engine = Engine(overrides=["model=tiny-llama", "capture=eager", "cache.num_slots=96"])
    outputs = engine.generate(_prompts() * 2, PARAMS)
    assert [o.token_ids for o in outputs] == uncached_tokens * 2
    assert sum(o.cached_tokens for o in outputs) > 0
    assert_no_leak(engine)


def test_batched_requests_with_a_cached_prefix_match_uncached(uncached_tokens):
    engine = Engine(overrides=TINY)
    engine.generate([_prompts()[0]], PARAMS)
    outputs = engine.generate(_prompts(), PARAMS)
    assert [o.token_ids for o in outputs] == uncached_tokens
    assert_no_leak(engine)


def test_requests_prefilled_together_keep_one_copy_of_their_shared_prefix(uncached_tokens):
    """All three compute the shared 24 tokens in one batch; the first to be cached keeps its
    slots, the others switch to them and free their own, mid-request."""
    engine = Engine(overrides=TINY)
    outputs = engine.generate(_prompts(), PARAMS)
    assert [o.token_ids for o in outputs] == uncached_tokens
    assert engine.kv_cache.num_cached == 24 + (7 + 4) + (12 + 4) + (3 + 4)
    assert_no_leak(engine)


def test_a_failed_forward_caches_nothing(monkeypatch):
    engine = Engine(overrides=TINY)
    engine.generate([_prompts()[0]], PARAMS)
    cached = engine.kv_cache.num_cached

    def broken(fb):
        raise RuntimeError("device lost")

    monkeypatch.setattr(engine.runner, "forward_and_sample", broken)
    with pytest.raises(RuntimeError, match="device lost"):
        engine.generate([_prompts()[1]], PARAMS)
    monkeypatch.undo()
    assert engine.kv_cache.num_cached == cached
    assert_no_leak(engine)


def test_flush_cache_frees_every_slot_and_is_refused_while_requests_run():
    with Engine(overrides=TINY) as engine:
        engine.generate(_prompts(), PARAMS)
        cached = engine.kv_cache.num_cached
        assert cached > 0 and engine.flush_cache() == cached
        assert engine.kv_cache.num_free == engine.kv_cache.num_slots
        with slowed(engine):
            stream = engine.stream(_prompts()[0], SamplingParams(max_new_tokens=100, ignore_eos=True))
            with pytest.raises(RuntimeError, match="requests are in flight"):
                engine.flush_cache()
            engine.abort(stream.request_id)
            stream.result()
        engine.flush_cache()
        assert_no_leak(engine)


def test_usage_reports_the_reused_prompt_tokens():
    engine = Engine(overrides=TINY)
    prompt = _prompts()[1]
    first, second = (engine.generate([prompt], PARAMS)[0] for _ in range(2))
    assert (first.cached_tokens, second.cached_tokens) == (0, len(prompt) - 1)


def test_smollm2_chats_sharing_a_system_prompt_equal_uncached(smollm2_engine):
    """The real model: the shared chat-template prefix is reused, tokens equal the uncached run."""
    uncached = Engine(overrides=["model=smollm2-135m", "capture=eager", "cache.num_slots=4096", "cache.prefix_cache=false"])
    questions = ["What is the capital of France?", "Name a prime number.", "What colour is the sky?"]
    prompts = [smollm2_engine.encode_chat([{"role": "user", "content": q}]) for q in questions]
    params = SamplingParams(max_new_tokens=8)
    with recorded_batches(smollm2_engine) as batches:
        got = [smollm2_engine.generate([p], params)[0].token_ids for p in prompts]
    assert got == [uncached.generate([p], params)[0].token_ids for p in prompts]
    prefix_lens = [int(fb.extend_prefix_lens[0]) for fb in batches if fb.forward_mode.is_extend()]
    assert all(n >= 20 for n in prefix_lens[1:]), prefix_lens  # the system prompt and template
    assert_no_leak(smollm2_engine)
