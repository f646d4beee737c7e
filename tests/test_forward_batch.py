"""ForwardBatch semantics pinned to the seeds' worked examples."""

import torch

from graphexec import SamplingParams
from graphexec.forward_batch import ForwardBatch
from graphexec.forward_mode import ForwardMode
from graphexec.kv_pool import DUMMY_SLOT, TokenToKVPool
from graphexec.logits_processor import LogitsProcessor
from graphexec.req_to_token_pool import DUMMY_REQ_ROW, ReqToTokenPool
from graphexec.request import Req
from graphexec.schedule_batch import ScheduleBatch

VOCAB = 64


def _pools():
    return ReqToTokenPool(max_requests=4, max_context=32), TokenToKVPool(64, 1, 1, 4, torch.float32)


def _req(rid, prompt, cached=0):
    return Req(rid, list(prompt), SamplingParams(), eos_token_ids=(0,), max_context=32, num_cached_tokens=cached)


def test_seed001_nine_tokens_two_logits_rows():
    req_pool, kv_pool = _pools()
    r1 = _req("r1", [11, 12, 13, 14, 15, 16])
    # R2's first three tokens hit the prefix cache: their KV already sits in slots 60..62.
    r2 = _req("r2", [21, 22, 23, 24, 25, 26], cached=3)
    r2.req_pool_idx = req_pool.alloc()
    req_pool.write(r2.req_pool_idx, 0, torch.tensor([60, 61, 62]))

    batch = ScheduleBatch.prepare_for_extend([r1, r2], req_pool, kv_pool)
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
    assert len(set(slots)) == 9 and DUMMY_SLOT not in slots
    assert req_pool.req_to_token[r1.req_pool_idx, :6].tolist() == slots[:6]
    assert req_pool.req_to_token[r2.req_pool_idx, :6].tolist() == [60, 61, 62] + slots[6:]

    hidden = torch.arange(9 * 8, dtype=torch.float32).view(9, 8)
    logits = LogitsProcessor(lambda h: h @ torch.ones(8, VOCAB))(hidden, fb)
    assert logits.shape == (2, VOCAB)
    torch.testing.assert_close(logits, (hidden[[5, 8]] @ torch.ones(8, VOCAB)))


def test_decode_step_allocates_at_old_length_then_grows():
    req_pool, kv_pool = _pools()
    reqs = [_req("a", [1, 2, 3]), _req("b", [4, 5, 6, 7, 8])]
    ScheduleBatch.prepare_for_extend(reqs, req_pool, kv_pool)
    for req, first_token in zip(reqs, [30, 40]):
        req.num_cached_tokens = req.seq_len
        req.output_ids.append(first_token)
    old_lens = [3, 5]

    batch = ScheduleBatch.prepare_for_decode(reqs, req_pool, kv_pool)
    fb = ForwardBatch.init_new(batch, "cpu", VOCAB)

    assert fb.forward_mode is ForwardMode.DECODE
    assert fb.input_ids.tolist() == [30, 40]
    assert fb.seq_lens.tolist() == [4, 6]  # L + 1
    assert fb.positions.tolist() == old_lens  # clamp(seq_lens - 1, 0) = L
    assert fb.extend_seq_lens is None and fb.extend_start_loc is None
    for req, old_len, slot in zip(reqs, old_lens, fb.out_cache_loc.tolist()):
        assert req_pool.req_to_token[req.req_pool_idx, old_len] == slot != DUMMY_SLOT
    assert fb.sample_row_indices().tolist() == [0, 1]


def test_init_new_does_not_mutate_the_schedule_batch():
    req_pool, kv_pool = _pools()
    batch = ScheduleBatch.prepare_for_extend([_req("a", [1, 2, 3])], req_pool, kv_pool)
    before = (list(batch.input_ids), list(batch.seq_lens), batch.out_cache_loc.clone())
    ForwardBatch.init_new(batch, "cpu", VOCAB)
    assert (batch.input_ids, batch.seq_lens) == before[:2]
    assert torch.equal(batch.out_cache_loc, before[2])


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
    assert [m.config_key for m in ForwardMode] == ["extend", "decode", "mixed", "idle"]
