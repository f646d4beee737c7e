"""The triton attention backend against torch_native, the reference.

On a CPU machine the kernels run in Triton's interpreter (tests/conftest.py turns it on before
triton is imported), so their logic is tested on every run, at small shapes: head_dim 16-32, a
few heads, blocks of 16 where the test needs many blocks and splits per row.  The GPU tests
(`test_gpu_*`) run the compiled kernels at real sizes and under a real CUDA graph.

Tolerances.  fp32 (CPU): both sides compute softmax(q k^T) v in fp32 and differ only in the order
of the sums (blocks, splits, then their merge), a few ulps of an output whose entries are convex
combinations of N(0, 1) values: atol 1e-5 is about 100 ulps at 1.0 and still fails on any
wrong key, mask or weight (those move entries by ~1e-1).  bf16: both sides round the output to
bf16 (8 bits of mantissa), the kernels also the probabilities before p @ v (on the GPU; the
interpreter's dots run in fp32, see triton_ops._dot_args): up to two roundings of 2^-8
relative, so rtol 1.6e-2 (torch's bf16 default, 2 ulps) and atol 2e-2 for entries near zero.
fp32 on the GPU: atol 1e-4, for sums of up to 4k terms in another order.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")

from capture.op_tape import TapeRecorder  # noqa: E402
from graphexec import Engine, SamplingParams  # noqa: E402
from graphexec.attention import triton_ops as tk  # noqa: E402
from graphexec.attention.backend import ForwardContext, create_attention_backend, resolve_attention_backend  # noqa: E402
from graphexec.attention.forward_context import forward_context  # noqa: E402
from graphexec.attention.op import PYTHON_ROUTED_OPS  # noqa: E402
from graphexec.attention.triton_backend import TritonAttnBackend  # noqa: E402
from graphexec.batch.forward_batch import ForwardBatch  # noqa: E402
from graphexec.batch.forward_mode import ForwardMode  # noqa: E402
from graphexec.batch.padding import DUMMY_REQ_ROW, DUMMY_SLOT
from graphexec.cache.kv_pool import TokenToKVPool  # noqa: E402
from graphexec.cache.req_to_token_pool import ReqToTokenPool  # noqa: E402
from graphexec.errors import ConfigError  # noqa: E402
from tests.helpers import recorded_batches  # noqa: E402
from tests.invariants import assert_no_leak  # noqa: E402

ON_CPU = pytest.mark.skipif(
    not tk.INTERPRETED, reason="CPU tensors need Triton's interpreter (TRITON_INTERPRET=1 before triton is imported)"
)
COMPILED_ON_CUDA = pytest.mark.skipif(
    not torch.cuda.is_available() or tk.INTERPRETED, reason="needs CUDA and compiled (not interpreted) Triton"
)
ATOL_FP32 = 1e-5
ATOL_FP32_GPU = 1e-4  # sums of up to 4k terms, in a different order
BF16 = dict(atol=2e-2, rtol=1.6e-2)
KV_HEADS, HEAD_DIM, MAX_CONTEXT = 2, 16, 512


# -- a KV pool, a request table and the batches the runner would build -------------------------


@dataclasses.dataclass
class World:
    pool: TokenToKVPool
    table: ReqToTokenPool
    rows: list[int]  # table row per request
    slots: list[torch.Tensor]  # KV slots per request, position order (scattered over the pool)
    spare: torch.Tensor  # slots no request holds


def _world(lens, kv_heads=KV_HEADS, head_dim=HEAD_DIM, device="cpu", dtype=torch.float32, seed=0, layers=1) -> World:
    """Requests holding `lens` tokens each at scattered slots of a random pool."""
    gen = torch.Generator().manual_seed(seed)
    num_slots = sum(lens) + 64
    pool = TokenToKVPool(num_slots, layers, kv_heads, head_dim, dtype, device)
    pool.k_pool.copy_(torch.randn(pool.k_pool.shape, generator=gen))
    pool.v_pool.copy_(torch.randn(pool.v_pool.shape, generator=gen))
    table = ReqToTokenPool(len(lens) + 1, max(MAX_CONTEXT, max(lens)), device)
    free = (torch.randperm(num_slots, generator=gen) + 1).to(device)  # never the dummy slot
    rows, slots, used = [], [], 0
    for n in lens:
        row = table.alloc()
        table.write(row, 0, free[used : used + n])
        rows.append(row)
        slots.append(free[used : used + n])
        used += n
    return World(pool, table, rows, slots, free[used:])


def _i64(values, device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=device)


def _decode_batch(world: World, pad: int = 0) -> ForwardBatch:
    """One decode step of every request (the new token is its last slot), plus `pad` rows padded
    as capture pads them (padding_policy: dummy table row, dummy slot, length 1)."""
    device = world.table.req_to_token.device
    lens = [int(s.numel()) for s in world.slots] + [1] * pad
    real = len(world.rows)
    return ForwardBatch(
        forward_mode=ForwardMode.DECODE,
        batch_size=real + pad,
        input_ids=_i64([0] * (real + pad), device),
        positions=_i64([n - 1 for n in lens], device),
        req_pool_indices=_i64(world.rows + [DUMMY_REQ_ROW] * pad, device),
        seq_lens=_i64(lens, device),
        seq_lens_cpu=tuple(lens),
        seq_lens_sum=sum(lens),
        out_cache_loc=torch.cat([torch.stack([s[-1] for s in world.slots]), _i64([DUMMY_SLOT] * pad, device)]),
        extend_prefix_lens=None,
        extend_seq_lens=None,
        extend_start_loc=None,
        extend_prefix_lens_cpu=None,
        extend_seq_lens_cpu=None,
        extend_num_tokens=None,
        num_token_non_padded=real,
        sampling_info=None,
        num_token_non_padded_device=_i64([real], device) if pad else None,
    )


def _extend_batch(world: World, prefixes: list[int], pad: int = 0) -> ForwardBatch:
    """Each request computes its tokens after its cached prefix; `pad` padded tokens at the end."""
    device = world.table.req_to_token.device
    lens = [int(s.numel()) for s in world.slots]
    ext = [n - p for n, p in zip(lens, prefixes)]
    starts = [sum(ext[:i]) for i in range(len(ext))]
    tokens = sum(ext) + pad
    new_slots = [s[p:] for s, p in zip(world.slots, prefixes)]
    return ForwardBatch(
        forward_mode=ForwardMode.EXTEND,
        batch_size=len(lens),
        input_ids=_i64([0] * tokens, device),
        positions=_i64([q for p, n in zip(prefixes, lens) for q in range(p, n)] + [0] * pad, device),
        req_pool_indices=_i64(world.rows, device),
        seq_lens=_i64(lens, device),
        seq_lens_cpu=tuple(lens),
        seq_lens_sum=sum(lens),
        out_cache_loc=torch.cat(new_slots + [_i64([DUMMY_SLOT] * pad, device)]),
        extend_prefix_lens=_i64(prefixes, device),
        extend_seq_lens=_i64(ext, device),
        extend_start_loc=_i64(starts, device),
        extend_prefix_lens_cpu=tuple(prefixes),
        extend_seq_lens_cpu=tuple(ext),
        extend_num_tokens=sum(ext),
        num_token_non_padded=sum(ext),
        sampling_info=None,
        num_token_non_padded_device=_i64([sum(ext)], device) if pad else None,
    )


def _qkv(tokens: int, heads: int, kv_heads=KV_HEADS, head_dim=HEAD_DIM, device="cpu", dtype=torch.float32, seed=1):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(tokens, heads * head_dim, generator=gen)
    k = torch.randn(tokens, kv_heads * head_dim, generator=gen)
    v = torch.randn(tokens, kv_heads * head_dim, generator=gen)
    return (x.to(device=device, dtype=dtype) for x in (q, k, v))


def _attend(backend, world: World, fb: ForwardBatch, q, k, v, layer: int = 0) -> torch.Tensor:
    """One layer through the graphexec::attention op, as the model calls it."""
    out = torch.full_like(q, float("nan"))  # a row nobody writes shows up
    with forward_context(ForwardContext(fb, backend, world.pool, world.table)):
        backend.init_forward_metadata(fb, world.table.req_to_token)
        try:
            torch.ops.graphexec.attention.default(q, k, v, out, layer)
        finally:
            backend.end_forward()
    return out


def _backends(heads: int, kv_heads=KV_HEADS, head_dim=HEAD_DIM, device="cpu"):
    device = torch.device(device)
    return (
        create_attention_backend("triton", heads, kv_heads, head_dim, device),
        create_attention_backend("torch_native", heads, kv_heads, head_dim, device),
    )


# Decode rows: 1 key, a few, exactly and just over a block, several splits, not block multiples.
DECODE_LENS = [1, 2, 17, 64, 65, 129, 300]
# Extend requests as (cached prefix, new tokens): no prefix, one new token, both long.
EXTEND_RUNS = [(0, 1), (0, 37), (50, 20), (3, 1), (100, 40)]


# -- the kernels against the reference ----------------------------------------------------------


@ON_CPU
@pytest.mark.parametrize("group", [1, 3, 4])
def test_decode_matches_torch_native(group):
    """Mixed lengths, GQA, one padded row; through the backend (the engine's blocks and splits)
    and through the kernels with blocks of 16 and splits of >= 40 keys (several blocks per split,
    up to 8 splits per row, lengths off every block boundary)."""
    heads = KV_HEADS * group
    triton_be, native_be = _backends(heads)
    world = _world(DECODE_LENS)
    fb = _decode_batch(world, pad=1)
    q, k, v = _qkv(fb.batch_size, heads)
    expected = _attend(native_be, world, fb, q, k, v)
    got = _attend(triton_be, world, fb, q, k, v)
    torch.testing.assert_close(got, expected, atol=ATOL_FP32, rtol=0)
    assert (got[-1] == 0).all()  # the padded row, zeroed like the reference's

    # The pool now holds this step's K/V: the kernels alone, with small blocks.
    out = torch.full_like(q, float("nan")).view(-1, heads, HEAD_DIM)
    splits = 8
    acc = torch.empty(fb.batch_size, heads, splits, HEAD_DIM)
    lse = torch.empty(fb.batch_size, heads, splits)
    k_buf, v_buf = world.pool.k_buffers[0], world.pool.v_buffers[0]
    tk.decode(
        q.view(-1, heads, HEAD_DIM), out, k_buf, v_buf, world.table.req_to_token, fb.req_pool_indices,
        fb.seq_lens, acc, lse, HEAD_DIM**-0.5, splits, min_split_len=40, block_n=16,
    )  # fmt: skip
    real = len(DECODE_LENS)
    torch.testing.assert_close(out.view(q.shape)[:real], expected[:real], atol=ATOL_FP32, rtol=0)
    # The padded row read the dummy slot only: its output is the dummy slot's V.
    dummy_v = v_buf[DUMMY_SLOT].repeat_interleave(group, 0)
    torch.testing.assert_close(out[real], dummy_v, atol=ATOL_FP32, rtol=0)


@ON_CPU
@pytest.mark.parametrize("group", [1, 3, 4])
def test_extend_matches_torch_native(group):
    """Requests with and without cached prefixes, one new token and many, two padded tokens; the
    backend's blocks, then blocks of 16 (many query and key blocks per request)."""
    heads = KV_HEADS * group
    triton_be, native_be = _backends(heads)
    prefixes = [p for p, _ in EXTEND_RUNS]
    world = _world([p + n for p, n in EXTEND_RUNS])
    fb = _extend_batch(world, prefixes, pad=2)
    q, k, v = _qkv(fb.num_tokens, heads)
    expected = _attend(native_be, world, fb, q, k, v)
    got = _attend(triton_be, world, fb, q, k, v)
    torch.testing.assert_close(got, expected, atol=ATOL_FP32, rtol=0)
    assert (got[-2:] == 0).all()

    out = torch.full_like(q, float("nan")).view(-1, heads, HEAD_DIM)
    tk.extend(
        q.view(-1, heads, HEAD_DIM), out, world.pool.k_buffers[0], world.pool.v_buffers[0],
        world.table.req_to_token, fb.req_pool_indices, fb.extend_prefix_lens, fb.extend_seq_lens,
        fb.extend_start_loc, HEAD_DIM**-0.5, max(fb.extend_seq_lens_cpu), block_m=16, block_n=16,
    )  # fmt: skip
    real = fb.num_token_non_padded
    torch.testing.assert_close(out.view(q.shape)[:real], expected[:real], atol=ATOL_FP32, rtol=0)
    assert out[real:].isnan().all()  # tokens of no request are not written


@ON_CPU
@pytest.mark.parametrize("window", [1, 5, 40, 1000])
def test_sliding_window_matches_torch_native(window):
    """A sliding window (a query at p sees keys p - window + 1 .. p): decode rows (splits from the
    window's start), extend blocks (loops from the first query's window; rows whose window starts
    past the first key block), through the backends and the kernels with blocks of 16."""
    heads = KV_HEADS * 3
    triton_be, native_be = (
        create_attention_backend(name, heads, KV_HEADS, HEAD_DIM, torch.device("cpu"), sliding_window=window)
        for name in ("triton", "torch_native")
    )
    world = _world(DECODE_LENS)
    fb = _decode_batch(world, pad=1)
    q, k, v = _qkv(fb.batch_size, heads)
    expected = _attend(native_be, world, fb, q, k, v)
    torch.testing.assert_close(_attend(triton_be, world, fb, q, k, v), expected, atol=ATOL_FP32, rtol=0)
    out = torch.full_like(q, float("nan")).view(-1, heads, HEAD_DIM)
    splits = 8
    acc, lse = torch.empty(fb.batch_size, heads, splits, HEAD_DIM), torch.empty(fb.batch_size, heads, splits)
    tk.decode(
        q.view(-1, heads, HEAD_DIM), out, world.pool.k_buffers[0], world.pool.v_buffers[0], world.table.req_to_token,
        fb.req_pool_indices, fb.seq_lens, acc, lse, HEAD_DIM**-0.5, splits, sliding_window=window,
        min_split_len=8, block_n=16,
    )  # fmt: skip
    real = len(DECODE_LENS)
    torch.testing.assert_close(out.view(q.shape)[:real], expected[:real], atol=ATOL_FP32, rtol=0)

    world = _world([p + n for p, n in EXTEND_RUNS])
    fb = _extend_batch(world, [p for p, _ in EXTEND_RUNS], pad=2)
    q, k, v = _qkv(fb.num_tokens, heads)
    expected = _attend(native_be, world, fb, q, k, v)
    torch.testing.assert_close(_attend(triton_be, world, fb, q, k, v), expected, atol=ATOL_FP32, rtol=0)
    out = torch.full_like(q, float("nan")).view(-1, heads, HEAD_DIM)
    tk.extend(
        q.view(-1, heads, HEAD_DIM), out, world.pool.k_buffers[0], world.pool.v_buffers[0],
        world.table.req_to_token, fb.req_pool_indices, fb.extend_prefix_lens, fb.extend_seq_lens,
        fb.extend_start_loc, HEAD_DIM**-0.5, max(fb.extend_seq_lens_cpu), sliding_window=window,
        block_m=16, block_n=16,
    )  # fmt: skip
    real = fb.num_token_non_padded
    torch.testing.assert_close(out.view(q.shape)[:real], expected[:real], atol=ATOL_FP32, rtol=0)


def _dense_reference(world: World, fb: ForwardBatch, q, layer, window, scale, softcap) -> torch.Tensor:
    """The plain definition, in float64, over the pool as the call left it (this step's K/V
    written): each real token's scores scale * q.k, soft-capped (cap * tanh(s / cap), before the
    mask), causal and windowed mask (a query at p sees p - window + 1 .. p), softmax, times V."""
    heads = q.shape[1] // HEAD_DIM
    keys_all, values_all = world.pool.k_buffers[layer].double(), world.pool.v_buffers[layer].double()
    out = torch.zeros(q.shape, dtype=torch.float64)
    for r, slots in enumerate(world.slots):
        n = slots.numel()
        if fb.forward_mode.is_extend():
            prefix, first = fb.extend_prefix_lens_cpu[r], int(fb.extend_start_loc[r])
        else:
            prefix, first = n - 1, r
        tokens = slice(first, first + n - prefix)
        queries = q[tokens].double().view(-1, heads, HEAD_DIM).transpose(0, 1)  # [heads, new, d]
        group = heads // KV_HEADS
        keys = keys_all[slots].transpose(0, 1).repeat_interleave(group, 0)  # [heads, n, d]
        values = values_all[slots].transpose(0, 1).repeat_interleave(group, 0)
        scores = queries @ keys.transpose(-1, -2) * scale
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        q_pos, k_pos = torch.arange(prefix, n)[:, None], torch.arange(n)[None, :]
        mask = (k_pos <= q_pos) & ((k_pos > q_pos - window) if window else True)
        o = torch.softmax(scores.masked_fill(~mask, float("-inf")), -1) @ values
        out[tokens] = o.transpose(0, 1).reshape(n - prefix, -1)
    return out


@ON_CPU
@pytest.mark.parametrize("options", [{}, dict(scale=1.5, softcap=5.0)], ids=["plain", "scale-softcap"])
def test_per_layer_windows_scale_and_softcap_match_dense_reference(options):
    """One backend with sliding_window=(4, None, 4): each layer's call attends with its own
    window (decode rows and extend runs, with prefixes and without, longer than the window),
    against the dense reference; with a custom scale and a soft-cap of 5 on scores large enough
    that capping changes the output.  Then the kernels alone, blocks of 16 and several splits."""
    heads, windows = KV_HEADS * 2, (4, None, 4)
    scale, softcap = options.get("scale", HEAD_DIM**-0.5), options.get("softcap", 0.0)
    backend = create_attention_backend(
        "triton", heads, KV_HEADS, HEAD_DIM, torch.device("cpu"), sliding_window=windows, scale=options.get("scale"),
        logit_softcap=options.get("softcap"),
    )  # fmt: skip
    runs = [(0, 19), (10, 9), (3, 1), (40, 3)]
    for decode in (True, False):
        world = _world([1, 3, 17, 70] if decode else [p + n for p, n in runs], layers=3)
        fb = _decode_batch(world, pad=1) if decode else _extend_batch(world, [p for p, _ in runs], pad=1)
        q, k, v = _qkv(fb.num_tokens, heads)
        real = fb.num_token_non_padded
        for layer, window in enumerate(windows):
            got = _attend(backend, world, fb, q, k, v, layer)
            expected = _dense_reference(world, fb, q, layer, window, scale, softcap)
            torch.testing.assert_close(got[:real].double(), expected[:real], atol=ATOL_FP32, rtol=0)
            assert (got[real:] == 0).all()
            if softcap:
                uncapped = _dense_reference(world, fb, q, layer, window, scale, 0.0)
                assert (expected[:real] - uncapped[:real]).abs().max() > 0.1
        if not softcap:
            continue
        # The kernels alone on layer 0 (window 4): small blocks, several splits per row.
        q3, k_buf, v_buf = q.view(-1, heads, HEAD_DIM), world.pool.k_buffers[0], world.pool.v_buffers[0]
        out = torch.full_like(q3, float("nan"))
        if decode:
            splits = 4
            acc, lse = torch.empty(fb.batch_size, heads, splits, HEAD_DIM), torch.empty(fb.batch_size, heads, splits)
            tk.decode(
                q3, out, k_buf, v_buf, world.table.req_to_token, fb.req_pool_indices, fb.seq_lens, acc, lse, scale,
                splits, sliding_window=0, logit_softcap=softcap, min_split_len=8, block_n=16,
            )  # fmt: skip
        else:
            tk.extend(
                q3, out, k_buf, v_buf, world.table.req_to_token, fb.req_pool_indices, fb.extend_prefix_lens,
                fb.extend_seq_lens, fb.extend_start_loc, scale, max(fb.extend_seq_lens_cpu), sliding_window=4,
                logit_softcap=softcap, block_m=16, block_n=16,
            )  # fmt: skip
        expected = _dense_reference(world, fb, q, 0, 0 if decode else 4, scale, softcap)
        torch.testing.assert_close(out.view(q.shape)[:real].double(), expected[:real], atol=ATOL_FP32, rtol=0)


@ON_CPU
def test_bf16_activations_and_pool_match_torch_native():
    """The dtype casts: bf16 q/k/v and pool, bf16 output (decode and extend, GQA 4)."""
    heads, dtype = KV_HEADS * 4, torch.bfloat16
    triton_be, native_be = _backends(heads)
    world = _world(DECODE_LENS, dtype=dtype)
    fb = _decode_batch(world, pad=1)
    q, k, v = _qkv(fb.batch_size, heads, dtype=dtype)
    got, expected = _attend(triton_be, world, fb, q, k, v), _attend(native_be, world, fb, q, k, v)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), expected.float(), **BF16)

    world = _world([p + n for p, n in EXTEND_RUNS], dtype=dtype)
    fb = _extend_batch(world, [p for p, _ in EXTEND_RUNS])
    q, k, v = _qkv(fb.num_tokens, heads, dtype=dtype)
    got, expected = _attend(triton_be, world, fb, q, k, v), _attend(native_be, world, fb, q, k, v)
    torch.testing.assert_close(got.float(), expected.float(), **BF16)


@ON_CPU
def test_a_larger_page_only_changes_the_index_math():
    """Pages of 4 slots: the table maps position // 4 to a page, a key sits at page * 4 +
    position % 4.  Same kernels, PAGE_SIZE=4, against the reference on the slots that implies."""
    page, heads = 4, KV_HEADS * 2
    lens = [5, 12, 33]
    gen = torch.Generator().manual_seed(5)
    num_pages = 1 + sum(-(-n // page) for n in lens)
    k_buf = torch.randn(num_pages * page, KV_HEADS, HEAD_DIM, generator=gen)
    v_buf = torch.randn(num_pages * page, KV_HEADS, HEAD_DIM, generator=gen)
    pages = torch.randperm(num_pages - 1, generator=gen) + 1
    page_table = torch.zeros(len(lens) + 1, MAX_CONTEXT // page, dtype=torch.int64)
    used = 0
    for row, n in enumerate(lens, start=1):
        count = -(-n // page)
        page_table[row, :count] = pages[used : used + count]
        used += count
    rows, seq_lens = torch.arange(1, len(lens) + 1), torch.tensor(lens)
    q = torch.randn(len(lens), heads, HEAD_DIM, generator=gen)

    out = torch.empty_like(q)
    splits = 2
    acc, lse = torch.empty(len(lens), heads, splits, HEAD_DIM), torch.empty(len(lens), heads, splits)
    tk.decode(q, out, k_buf, v_buf, page_table, rows, seq_lens, acc, lse, HEAD_DIM**-0.5, splits,
              min_split_len=8, block_n=16, page_size=page)  # fmt: skip

    for i, (row, n) in enumerate(zip(rows.tolist(), lens)):
        pos = torch.arange(n)
        slots = page_table[row, pos // page] * page + pos % page
        keys, values = k_buf[slots].transpose(0, 1), v_buf[slots].transpose(0, 1)
        ref = torch.nn.functional.scaled_dot_product_attention(
            q[i][:, None], keys, values, scale=HEAD_DIM**-0.5, enable_gqa=True
        )[:, 0]
        torch.testing.assert_close(out[i], ref, atol=ATOL_FP32, rtol=0)


# -- static metadata: what a replayed decode graph reads ----------------------------------------


@ON_CPU
def test_a_recorded_decode_replays_against_rewritten_metadata():
    """The CUDA-graph path on the op tape: a padded decode of 4 rows is recorded once (the
    interpreted kernels issue no aten op, so the tape records their launches, which are ops,
    with their arguments and grid, as a CUDA graph records a launch).  Then the static inputs are
    rewritten for other requests, lengths and padding, and the recording is replayed: it must
    equal fresh eager calls of both backends on the same step."""
    heads, rows = KV_HEADS * 2, 4
    triton_be, native_be = _backends(heads)
    triton_be.enable_static_decode_metadata(rows, MAX_CONTEXT, torch.device("cpu"))
    world = _world([30, 3, 140, 77, 9])  # requests 0-2 run first, then 3, 4 and 2

    # The capture backend's static inputs, and a batch over them.
    static = _decode_batch(dataclasses.replace(world, rows=world.rows[:3], slots=world.slots[:3]), pad=1)
    q, k, v = _qkv(rows, heads, seed=2)
    out = torch.empty_like(q)
    recorder = TapeRecorder(PYTHON_ROUTED_OPS)
    with forward_context(ForwardContext(static, triton_be, world.pool, world.table)):
        triton_be.init_forward_metadata(static, world.table.req_to_token)
        recorder.begin()
        try:
            torch.ops.graphexec.attention.default(q, k, v, out, 0)
        finally:
            tape = recorder.end()
            triton_be.end_forward()
    launched = [call.op for call in tape.calls]
    assert torch.ops.graphexec.triton_decode.default in launched

    # Next step: requests 3, 4, 2 (2 has grown by one token), 1 padded row; new q/k/v.
    grown = torch.cat([world.slots[2], world.spare[:1]])
    world.table.write(world.rows[2], 0, grown)
    step = dataclasses.replace(world, rows=[world.rows[i] for i in (3, 4, 2)], slots=[world.slots[3], world.slots[4], grown])
    fresh = _decode_batch(step, pad=1)
    for name in ("req_pool_indices", "seq_lens", "out_cache_loc", "num_token_non_padded_device"):
        getattr(static, name).copy_(getattr(fresh, name))
    pool_before = world.pool.k_pool.clone(), world.pool.v_pool.clone()
    q2, k2, v2 = _qkv(rows, heads, seed=3)
    for buf, new in ((q, q2), (k, k2), (v, v2)):
        buf.copy_(new)
    with forward_context(ForwardContext(static, triton_be, world.pool, world.table)):
        triton_be.init_forward_metadata(static, world.table.req_to_token)  # as the runner does before a replay
        try:
            tape.replay()
        finally:
            triton_be.end_forward()
    replayed = out.clone()

    world.pool.k_pool.copy_(pool_before[0])
    world.pool.v_pool.copy_(pool_before[1])
    eager_triton = _attend(_backends(heads)[0], world, fresh, q2, k2, v2)
    world.pool.k_pool.copy_(pool_before[0])
    world.pool.v_pool.copy_(pool_before[1])
    reference = _attend(native_be, world, fresh, q2, k2, v2)
    torch.testing.assert_close(replayed, eager_triton, atol=ATOL_FP32, rtol=0)
    torch.testing.assert_close(replayed, reference, atol=ATOL_FP32, rtol=0)
    assert (replayed[3] == 0).all() and not (replayed[:3] == 0).all(dim=1).any()


# -- the engine ---------------------------------------------------------------------------------

TINY = ["model=tiny-llama", "cache.num_slots=1024"]


def _workload():
    """Three requests, the third sharing the first's prompt head (a cached prefix once it ran)."""
    gen = torch.Generator().manual_seed(7)
    first = torch.randint(3, 320, (19,), generator=gen).tolist()
    prompts = [first, torch.randint(3, 320, (5,), generator=gen).tolist(), first[:12] + [7, 8, 9]]
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (6, 3, 5)]
    return prompts, params


def _generate(engine):
    """The first two requests, then the third: its prompt head is in the prefix cache by then."""
    prompts, params = _workload()
    with recorded_batches(engine) as batches:
        outputs = engine.generate(prompts[:2], params[:2]) + engine.generate(prompts[2:], params[2:])
    assert any(fb.forward_mode.is_extend() and max(fb.extend_prefix_lens_cpu) > 0 for fb in batches)
    return [o.token_ids for o in outputs]


@pytest.fixture(scope="module")
def native_tokens():
    return _generate(Engine(overrides=TINY + ["capture=eager", "attention_backend=torch_native"]))


@ON_CPU
def test_engine_greedy_tokens_equal_torch_native(native_tokens):
    engine = Engine(overrides=TINY + ["capture=eager", "attention_backend=triton"])
    assert isinstance(engine.runner.attn_backend, TritonAttnBackend)
    assert _generate(engine) == native_tokens
    assert_no_leak(engine)


@ON_CPU
def test_engine_decode_graph_on_the_tape_equals_torch_native(native_tokens):
    """Decode as the CUDA-graph path runs it (recorded per bucket on the op tape, replayed against
    the static inputs), the triton kernels inside the recording."""
    engine = Engine(
        overrides=TINY
        + ["capture=graph_first", "capture.decode.buckets=[1,2,4]", "capture.decode.progress=false"]
        + ["capture.decode.graph=tape", "capture.extend.backend=eager", "attention_backend=triton"]
    )
    backend = engine.runner.backends[ForwardMode.DECODE]
    for bucket in backend.buckets:
        (tape,) = backend.segments_of(bucket).steps
        assert sum(call.op is torch.ops.graphexec.triton_decode.default for call in tape.calls) == 2  # one per layer
    assert _generate(engine) == native_tokens
    assert backend.stats.executions > 0 and backend.stats.fallbacks == 0
    assert_no_leak(engine)


# -- selection ----------------------------------------------------------------------------------


def test_auto_picks_by_device():
    assert resolve_attention_backend("auto", torch.device("cuda")) == "triton"
    assert resolve_attention_backend("auto", torch.device("cpu")) == "cpu"
    assert resolve_attention_backend("auto", torch.device("meta")) == "torch_native"
    assert resolve_attention_backend("torch_native", torch.device("cuda")) == "torch_native"
    with pytest.raises(ConfigError, match="attention_backend='flash'.*auto"):
        resolve_attention_backend("flash", torch.device("cpu"))


def test_default_config_keeps_the_cpu_backend_on_the_cpu():
    from graphexec.attention.cpu import CpuAttnBackend

    engine = Engine(overrides=["model=tiny-llama", "capture=eager", "cache.num_slots=64"])
    assert engine.config.attention_backend == "auto"
    assert type(engine.runner.attn_backend) is CpuAttnBackend


def test_triton_on_the_cpu_without_the_interpreter_is_refused():
    """A fresh process without TRITON_INTERPRET: the kernels compile, and nothing compiles for
    the CPU, so the backend refuses and names the option."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = (
        "import torch\n"
        "from graphexec.attention.backend import create_attention_backend\n"
        "from graphexec.errors import ConfigError\n"
        "try:\n"
        "    create_attention_backend('triton', 4, 2, 16, torch.device('cpu'))\n"
        "except ConfigError as e:\n"
        "    print('REFUSED', e)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert "REFUSED attention_backend=triton" in done.stdout, done.stdout + done.stderr
    assert "TRITON_INTERPRET=1" in done.stdout


def test_a_missing_triton_is_a_config_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` raises ImportError
    for module in ("triton_ops", "triton_kernels"):
        monkeypatch.delitem(sys.modules, f"graphexec.attention.{module}")
        monkeypatch.delattr(f"graphexec.attention.{module}", raising=False)
    with pytest.raises(ConfigError, match="attention_backend=triton needs the triton package"):
        create_attention_backend("triton", 4, 2, 16, torch.device("cuda"))


# -- GPU: the compiled kernels (skipped without CUDA) -------------------------------------------

GPU_SHAPES = [(32, 8, 128), (9, 3, 64)]  # (heads, kv heads, head_dim): Llama-8B-like, SmolLM2-135M


@pytest.mark.parametrize("heads,kv_heads,head_dim", GPU_SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.gpu
@COMPILED_ON_CUDA
def test_gpu_decode_matches_torch_native(heads, kv_heads, head_dim, dtype):
    lens = [1, 63, 64, 65, 1000, 4097, 2047, 300] * 4
    triton_be, native_be = _backends(heads, kv_heads, head_dim, "cuda")
    world = _world(lens, kv_heads, head_dim, "cuda", dtype)
    fb = _decode_batch(world, pad=3)
    q, k, v = _qkv(fb.batch_size, heads, kv_heads, head_dim, "cuda", dtype)
    expected = _attend(native_be, world, fb, q, k, v)
    got = _attend(triton_be, world, fb, q, k, v)
    tol = dict(atol=ATOL_FP32_GPU, rtol=0) if dtype == torch.float32 else BF16
    torch.testing.assert_close(got.float(), expected.float(), **tol)


@pytest.mark.parametrize("heads,kv_heads,head_dim", GPU_SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.gpu
@COMPILED_ON_CUDA
def test_gpu_extend_matches_torch_native(heads, kv_heads, head_dim, dtype):
    runs = [(0, 1), (0, 700), (1000, 129), (64, 64), (5, 3000)]
    triton_be, native_be = _backends(heads, kv_heads, head_dim, "cuda")
    world = _world([p + n for p, n in runs], kv_heads, head_dim, "cuda", dtype)
    fb = _extend_batch(world, [p for p, _ in runs], pad=5)
    q, k, v = _qkv(fb.num_tokens, heads, kv_heads, head_dim, "cuda", dtype)
    expected = _attend(native_be, world, fb, q, k, v)
    got = _attend(triton_be, world, fb, q, k, v)
    tol = dict(atol=ATOL_FP32_GPU, rtol=0) if dtype == torch.float32 else BF16
    torch.testing.assert_close(got.float(), expected.float(), **tol)


@pytest.mark.gpu
@COMPILED_ON_CUDA
def test_gpu_decode_under_a_cuda_graph_reads_rewritten_metadata():
    """A real CUDA graph of one padded decode layer, replayed after the static inputs are
    rewritten for other requests and lengths: equal to fresh eager calls of torch_native."""
    heads, kv_heads, head_dim, rows, dtype = 32, 8, 128, 8, torch.bfloat16
    triton_be, native_be = _backends(heads, kv_heads, head_dim, "cuda")
    triton_be.enable_static_decode_metadata(rows, 4096, torch.device("cuda"))
    lens = [5, 900, 64, 3000, 17, 2048, 1, 129, 4000, 77]
    world = _world(lens, kv_heads, head_dim, "cuda", dtype)
    first = dataclasses.replace(world, rows=world.rows[:6], slots=world.slots[:6])
    static = _decode_batch(first, pad=2)
    q, k, v = _qkv(rows, heads, kv_heads, head_dim, "cuda", dtype, seed=2)
    out = torch.empty_like(q)

    def step():
        torch.ops.graphexec.attention.default(q, k, v, out, 0)

    with forward_context(ForwardContext(static, triton_be, world.pool, world.table)):
        triton_be.init_forward_metadata(static, world.table.req_to_token)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step()  # warm-up: compile the kernels outside the capture
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        triton_be.end_forward()

    second = dataclasses.replace(world, rows=world.rows[6:], slots=world.slots[6:])
    fresh = _decode_batch(second, pad=4)
    for name in ("req_pool_indices", "seq_lens", "out_cache_loc", "num_token_non_padded_device"):
        getattr(static, name).copy_(getattr(fresh, name))
    pool_before = world.pool.k_pool.clone(), world.pool.v_pool.clone()
    q2, k2, v2 = _qkv(rows, heads, kv_heads, head_dim, "cuda", dtype, seed=3)
    for buf, new in ((q, q2), (k, k2), (v, v2)):
        buf.copy_(new)
    graph.replay()
    torch.cuda.synchronize()
    world.pool.k_pool.copy_(pool_before[0])
    world.pool.v_pool.copy_(pool_before[1])
    reference = _attend(native_be, world, fresh, q2, k2, v2)
    torch.testing.assert_close(out.float(), reference.float(), **BF16)
    assert (out[4:] == 0).all()
