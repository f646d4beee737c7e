"""ForwardBatch semantics pinned to the seeds' worked examples."""

import torch

from graphexec import SamplingParams
from graphexec.batch.forward_batch import ForwardBatch
from graphexec.batch.forward_mode import ForwardMode
from graphexec.batch.padding import DUMMY_REQ_ROW, DUMMY_SLOT
from graphexec.batch.request import Req
from graphexec.batch.schedule_batch import ScheduleBatch
from graphexec.cache.kv_pool import TokenToKVPool
from graphexec.cache.manager import KVCacheManager
from graphexec.cache.req_to_token_pool import ReqToTokenPool
from graphexec.runner.logits_processor import LogitsProcessor

VOCAB = 64


def _kv(prefix_cache=False):
    return KVCacheManager(TokenToKVPool(64, 1, 1, 4, torch.float32), ReqToTokenPool(max_requests=4, max_context=32), prefix_cache)


def _req(rid, prompt):
    return Req(rid, list(prompt), SamplingParams(), eos_token_ids=(0,), max_context=32)


def _plan_extend(kv, reqs):
    """What the scheduler does for a prefill: admit (cached prefix mapped), allocate, plan."""
    for req in reqs:
        req.num_computed_tokens = kv.admit(req)
    lens = [r.seq_len - r.num_computed_tokens for r in reqs]
    return ScheduleBatch.extend(reqs, lens, kv.rows(reqs), kv.allocate(reqs, lens))


def test_seed001_nine_tokens_two_logits_rows():
    kv = _kv(prefix_cache=True)
    # R2's first three tokens hit the prefix cache: their KV already sits in slots 60..62.
    taken = kv.token_pool.alloc(64)
    kv.token_pool.free(taken[(taken < 60) | (taken > 62)])
    kv.prefix_cache.insert([21, 22, 23], torch.tensor([60, 61, 62]))
    r1 = _req("r1", [11, 12, 13, 14, 15, 16])
    r2 = _req("r2", [21, 22, 23, 24, 25, 26])

    batch = _plan_extend(kv, [r1, r2])
    fb = ForwardBatch.init_new(batch, "cpu", VOCAB)

    assert fb.forward_mode is ForwardMode.EXTEND
    assert fb.input_ids.tolist() == [11, 12, 13, 14, 15, 16, 24, 25, 26]
    assert fb.positions.tolist() == [0, 1, 2, 3, 4, 5, 3, 4, 5]
    assert fb.extend_prefix_lens.tolist() == [0, 3]
    assert fb.extend_seq_lens.tolist() == [6, 3]
    assert fb.seq_lens.tolist() == [6, 6]
    assert fb.extend_start_loc.tolist() == [0, 6]
    assert fb.extend_num_tokens == 9 == fb.num_token_non_padded
    assert fb.seq_lens_sum == 12
    assert fb.sample_row_indices().tolist() == [5, 8]

    # Nine new slots, none of them the dummy, mapped at each request's new positions.
    slots = fb.out_cache_loc.tolist()
    table = kv.req_to_token_pool.req_to_token
    assert len(set(slots)) == 9 and DUMMY_SLOT not in slots
    assert table[kv.row(r1), :6].tolist() == slots[:6]
    assert table[kv.row(r2), :6].tolist() == [60, 61, 62] + slots[6:]
    kv.audit()

    hidden = torch.arange(9 * 8, dtype=torch.float32).view(9, 8)
    logits = LogitsProcessor(lambda h: h @ torch.ones(8, VOCAB))(hidden, fb)
    assert logits.shape == (2, VOCAB)
    torch.testing.assert_close(logits, (hidden[[5, 8]] @ torch.ones(8, VOCAB)))


def test_decode_step_allocates_at_old_length_then_grows():
    kv = _kv()
    reqs = [_req("a", [1, 2, 3]), _req("b", [4, 5, 6, 7, 8])]
    _plan_extend(kv, reqs)
    for req, first_token in zip(reqs, [30, 40]):
        req.num_computed_tokens = req.seq_len
        req.output_ids.append(first_token)
    old_lens = [3, 5]

    batch = ScheduleBatch.decode(reqs, kv.rows(reqs), kv.allocate(reqs, [1, 1]))
    fb = ForwardBatch.init_new(batch, "cpu", VOCAB)

    assert fb.forward_mode is ForwardMode.DECODE
    assert fb.input_ids.tolist() == [30, 40]
    assert fb.seq_lens.tolist() == [4, 6]  # L + 1
    assert fb.positions.tolist() == old_lens  # clamp(seq_lens - 1, 0) = L
    assert fb.extend_seq_lens is None and fb.extend_start_loc is None
    for req, old_len, slot in zip(reqs, old_lens, fb.out_cache_loc.tolist()):
        assert kv.req_to_token_pool.req_to_token[kv.row(req), old_len] == slot != DUMMY_SLOT
    assert fb.sample_row_indices().tolist() == [0, 1]


def test_building_a_plan_changes_nothing():
    """ScheduleBatch is a plan: building one (and a ForwardBatch from it) touches no pool or request."""
    kv = _kv()
    req = _req("a", [1, 2, 3])
    kv.admit(req)
    slots = kv.allocate([req], [3])
    state = (kv.num_free, kv.req_to_token_pool.req_to_token.clone(), req.num_computed_tokens)
    batch = ScheduleBatch.extend([req], [3], kv.rows([req]), slots)
    before = (list(batch.input_ids), list(batch.seq_lens), batch.out_cache_loc.clone())
    ForwardBatch.init_new(batch, "cpu", VOCAB)
    assert (batch.input_ids, batch.seq_lens) == before[:2]
    assert torch.equal(batch.out_cache_loc, before[2])
    assert kv.num_free == state[0] and torch.equal(kv.req_to_token_pool.req_to_token, state[1])
    assert req.num_computed_tokens == state[2]


def test_dummy_slot_and_row_are_never_handed_out():
    req_pool, kv_pool = ReqToTokenPool(max_requests=3, max_context=8), TokenToKVPool(5, 1, 1, 2, torch.float32)
    assert sorted(req_pool.alloc() for _ in range(3)) == [1, 2, 3]
    assert DUMMY_REQ_ROW == 0
    slots = kv_pool.alloc(5).tolist()
    assert sorted(slots) == [1, 2, 3, 4, 5]
    assert kv_pool.k_buffers[0].shape[0] == 6  # slot 0 exists, as the dummy


def test_forward_mode_predicates():
    assert ForwardMode.EXTEND.is_extend() and ForwardMode.MIXED.is_extend()
    assert not ForwardMode.DECODE.is_extend() and ForwardMode.DECODE.is_decode()
    assert ForwardMode.DECODE.is_graph_capturable() and ForwardMode.IDLE.is_graph_capturable()
    assert not ForwardMode.EXTEND.is_graph_capturable() and not ForwardMode.MIXED.is_graph_capturable()
    assert ForwardMode.TARGET_VERIFY.is_graph_capturable() and not ForwardMode.TARGET_VERIFY.is_extend()
    assert [m.config_key for m in ForwardMode] == ["extend", "decode", "mixed", "idle", "target_verify"]


def test_hand_batches_move_requests_on_and_give_every_slot_back():
    """Batches built by hand (tests, benches): extend, then decode, each `ran` moving the request's
    computed length to what the batch wrote; `rewind` unmaps the slots after a length; a verify
    batch's outcome is refused (only its caller knows what it accepted)."""
    import pytest

    from graphexec.scheduler.hand_batches import HandBatches

    kv = _kv(prefix_cache=True)
    hand = HandBatches(kv)
    req = _req("h", [11, 12, 13, 14])
    prefill = hand.extend([req], [3])  # a chunk: 3 of the 4 prompt tokens
    assert prefill.extend_lens == [3] and not prefill.samples[0]
    hand.ran(prefill)
    assert req.num_computed_tokens == 3 and req.output_ids == []
    prefill = hand.extend([req])
    assert prefill.prefix_lens == [3] and prefill.extend_lens == [1]
    hand.ran(prefill, [7])
    assert (req.num_computed_tokens, req.output_ids) == (4, [7])
    decode = hand.decode([req])
    assert decode.forward_mode is ForwardMode.DECODE and decode.input_ids == [7] and decode.seq_lens == [5]
    hand.ran(decode, [8])
    assert (req.num_computed_tokens, req.output_ids) == (5, [7, 8])
    with pytest.raises(ValueError, match="2 next tokens for 1 requests"):
        hand.ran(hand.decode([req]), [1, 2])
    assert req.num_computed_tokens == 5 and req.output_ids == [7, 8]  # refused whole
    hand.rewind(req, 5)  # the refused decode's slot
    verify = hand.verify([req], [[9, 9]])
    with pytest.raises(ValueError, match="TARGET_VERIFY"):
        hand.ran(verify)
    hand.rewind(req, 5)
    assert req.num_computed_tokens == 5
    kv.audit()
    hand.release(req, cache=False)
    kv.audit()
    assert kv.num_free + kv.num_cached == kv.num_slots and not kv.holders()
    assert kv.num_free_rows == kv.req_to_token_pool.max_requests
