"""Triton paged-attention kernels: decode (split keys, then reduce) and extend, reading the KV pool
in place through the request -> token table.  Their launches are attention/triton_ops.py's;
imported only through the triton backend, so that `import graphexec` never needs triton.

Compiled or interpreted is decided once per process: Triton's own library functions
(`tl.sum`, `tl.cdiv`, ...) are compiled or interpreted when `triton.language` is first imported,
by TRITON_INTERPRET=1 in the environment then.  Interpreted, the kernels run on the host with
numpy, on CPU tensors (and on GPU tensors, copied to the host and back per launch).

Addressing: the table maps (request row, position) to a page; a key's slot is
`page * PAGE_SIZE + position % PAGE_SIZE`.  The pool has pages of one slot today (PAGE_SIZE 1,
the table holds slots); a larger page size changes that line only.

Sliding window (`window` > 0; 0 is full attention): a query at position p sees keys
p - window + 1 .. p.  Decode starts each row's keys (and its splits) at its window; extend starts
a block's key loop at its first query's window and masks each query's keys below its own.  The
window is a launch argument (not specialized on): the backend passes each layer its own.

Logit soft-capping (Gemma 2; `softcap` > 0, with SOFTCAP set): each score s = scale * q.k
becomes softcap * tanh(s / softcap) before masking and the softmax.  SOFTCAP is a constexpr, so
a launch without a cap compiles to the same kernel as before it existed.
"""

from __future__ import annotations

import triton
import triton.language as tl

# Decode: no split gets fewer keys than this (a split's fixed cost must pay off); the grid's
# split dimension is capped at MAX_SPLITS (the workspace holds that many partials per head).
# Block sizes and split bounds are first guesses, not yet tuned on a GPU.
MIN_KEYS_PER_SPLIT = 64
MAX_SPLITS = 16
DECODE_BLOCK_N = 64
EXTEND_BLOCK_M = 64
EXTEND_BLOCK_N = 64


def num_splits_for(max_len: int) -> int:
    """The split dimension of the decode grid for rows of up to `max_len` keys."""
    return max(1, min(MAX_SPLITS, triton.cdiv(max_len, MIN_KEYS_PER_SPLIT)))


@triton.jit
def _tanh(x):
    """tanh from exp (not every Triton has a tanh in tl): sign(x) (1 - e) / (1 + e), e = e^(-2|x|)
    in (0, 1], which never overflows."""
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def _online_softmax(
    qv,  # [ROWS, BLOCK_D] queries, already DOT_DTYPE
    q_pos,  # [ROWS] the queries' positions (read only when CAUSAL)
    window,  # sliding window (read only when CAUSAL; 0: none)
    table,  # this request's row of the request -> token table
    k_buf,
    v_buf,
    kv_head,
    start,
    end,
    scale,
    softcap,  # logit soft-cap (read only when SOFTCAP)
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    d,
    d_ok,
    ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    SOFTCAP: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Keys start..end-1 of one KV head against ROWS queries, a block of BLOCK_N keys at a time.

    Returns (acc, m, l): the unnormalized output, each row's running max and its sum of
    exponentials; the output is acc / l, the log-sum-exp m + log(l).  Under a window a row may
    see no live key in the first blocks (its window starts later): its max stays -inf, and the
    exponentials are taken against 0 instead so that they are 0, not NaN."""
    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, BLOCK_D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        live = pos < end
        slot = tl.load(table + pos // PAGE_SIZE, mask=live, other=0) * PAGE_SIZE + pos % PAGE_SIZE
        kv_ok = live[:, None] & d_ok[None, :]
        k = tl.load(k_buf + slot[:, None] * stride_ks + kv_head * stride_kh + d[None, :], mask=kv_ok, other=0.0)
        qk = tl.dot(qv, tl.trans(k.to(DOT_DTYPE)), input_precision=DOT_PRECISION) * scale
        if SOFTCAP:  # before any mask, as transformers' Gemma 2
            qk = softcap * _tanh(qk / softcap)
        if CAUSAL:
            seen = live[None, :] & (pos[None, :] <= q_pos[:, None])
            seen = seen & ((window <= 0) | (pos[None, :] > q_pos[:, None] - window))
            qk = tl.where(seen, qk, float("-inf"))
        else:
            qk = tl.where(live[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing live yet
        alpha = tl.exp(m_i - m_ref)
        p = tl.exp(qk - m_ref[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_buf + slot[:, None] * stride_vs + kv_head * stride_vh + d[None, :], mask=kv_ok, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE), input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit(do_not_specialize=["window", "softcap"])  # one compiled kernel for every window and cap
def _decode_partial(
    q,  # [rows, heads, head_dim]
    out,  # [rows, heads, head_dim]: written here for rows of one split
    k_buf,  # [slots, kv_heads, head_dim]
    v_buf,
    req_to_token,  # [table rows, max_context // PAGE_SIZE]
    req_pool_indices,  # [rows]
    seq_lens,  # [rows]
    part_acc,  # [>= rows, heads, >= splits, head_dim] fp32: each split's normalized output
    part_lse,  # [>= rows, heads, >= splits] fp32: each split's log-sum-exp
    scale,
    softcap,  # logit soft-cap (read only when SOFTCAP)
    stride_qr,
    stride_qh,
    stride_or,
    stride_oh,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    stride_table,
    stride_ar,
    stride_ah,
    stride_as,
    stride_lr,
    stride_lh,
    head_dim,
    min_split_len,
    window,  # sliding window (0: none)
    GROUP: tl.constexpr,  # query heads per KV head
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    SOFTCAP: tl.constexpr,  # whether scores are soft-capped
    DOT_DTYPE: tl.constexpr,  # what the operands of the dots are cast to
    DOT_PRECISION: tl.constexpr,
):
    """One (row, KV head, split): the split's keys against the KV head's GROUP query heads."""
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens + row)
    # The row's query sits at seq_len - 1 (decode and verify rows alike): its keys start at its window.
    first_key = tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)
    span = seq_len - first_key
    # The row's own split count, from its length on the device: a replayed graph splits this
    # step's lengths; the grid only bounds it.
    num_splits = tl.maximum(tl.minimum(tl.cdiv(span, min_split_len), tl.num_programs(2)), 1)
    split_len = tl.cdiv(span, num_splits)
    start = first_key + split * split_len
    end = tl.minimum(start + split_len, seq_len)
    if start < end:
        h = tl.arange(0, BLOCK_H)
        heads = kv_head * GROUP + h
        d = tl.arange(0, BLOCK_D)
        h_ok = h < GROUP
        d_ok = d < head_dim
        hd_ok = h_ok[:, None] & d_ok[None, :]
        qv = tl.load(q + row * stride_qr + heads[:, None] * stride_qh + d[None, :], mask=hd_ok, other=0.0).to(DOT_DTYPE)
        table = req_to_token + tl.load(req_pool_indices + row) * stride_table
        acc, m_i, l_i = _online_softmax(
            qv, h, 0, table, k_buf, v_buf, kv_head, start, end, scale, softcap,
            stride_ks, stride_kh, stride_vs, stride_vh, d, d_ok,
            ROWS=BLOCK_H, BLOCK_D=BLOCK_D, BLOCK_N=BLOCK_N, CAUSAL=False, SOFTCAP=SOFTCAP, PAGE_SIZE=PAGE_SIZE,
            DOT_DTYPE=DOT_DTYPE, DOT_PRECISION=DOT_PRECISION,
        )  # fmt: skip
        o = acc / l_i[:, None]
        if num_splits == 1:
            # The whole row in one split: its output is final, the reduce skips the row.
            tl.store(out + row * stride_or + heads[:, None] * stride_oh + d[None, :], o.to(out.dtype.element_ty), mask=hd_ok)
        else:
            tl.store(part_acc + row * stride_ar + heads[:, None] * stride_ah + split * stride_as + d[None, :], o, mask=hd_ok)
            tl.store(part_lse + row * stride_lr + heads * stride_lh + split, m_i + tl.log(l_i), mask=h_ok)


@triton.jit(do_not_specialize=["window"])  # one compiled kernel for every window
def _decode_reduce(
    out,  # [rows, heads, head_dim]
    seq_lens,
    part_acc,
    part_lse,
    stride_or,
    stride_oh,
    stride_ar,
    stride_ah,
    stride_as,
    stride_lr,
    stride_lh,
    head_dim,
    min_split_len,
    max_splits,
    window,
    GROUP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One (row, KV head): its query heads' split outputs, each weighted by its split's share of
    the softmax.  A row of one split was written to `out` by _decode_partial already."""
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq_len = tl.load(seq_lens + row)
    # The same split arithmetic as _decode_partial: a split it skipped is not read.
    span = seq_len - tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)
    num_splits = tl.maximum(tl.minimum(tl.cdiv(span, min_split_len), max_splits), 1)
    if num_splits > 1:
        split_len = tl.cdiv(span, num_splits)
        h = tl.arange(0, BLOCK_H)
        heads = kv_head * GROUP + h
        s = tl.arange(0, BLOCK_S)
        d = tl.arange(0, BLOCK_D)
        h_ok = h < GROUP
        d_ok = d < head_dim
        s_ok = (s < num_splits) & (s * split_len < span)
        hs_ok = h_ok[:, None] & s_ok[None, :]
        lse = tl.load(part_lse + row * stride_lr + heads[:, None] * stride_lh + s[None, :], mask=hs_ok, other=float("-inf"))
        # Rows of padding heads (h >= GROUP) are all -inf: keep their max finite, they are not stored.
        m = tl.maximum(tl.max(lse, 1), -1e30)
        w = tl.where(hs_ok, tl.exp(lse - m[:, None]), 0.0)
        acc = tl.load(
            part_acc + row * stride_ar + heads[:, None, None] * stride_ah + s[None, :, None] * stride_as + d[None, None, :],
            mask=hs_ok[:, :, None] & d_ok[None, None, :],
            other=0.0,
        )
        o = tl.sum(w[:, :, None] * acc, 1) / tl.maximum(tl.sum(w, 1), 1e-30)[:, None]
        out_ptrs = out + row * stride_or + heads[:, None] * stride_oh + d[None, :]
        tl.store(out_ptrs, o.to(out.dtype.element_ty), mask=h_ok[:, None] & d_ok[None, :])


@triton.jit(do_not_specialize=["window", "softcap"])  # one compiled kernel for every window and cap
def _extend(
    q,  # [tokens, heads, head_dim]
    out,
    k_buf,
    v_buf,
    req_to_token,
    req_pool_indices,  # [requests]
    extend_prefix_lens,
    extend_seq_lens,
    extend_start_loc,
    scale,
    softcap,  # logit soft-cap (read only when SOFTCAP)
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    stride_table,
    head_dim,
    window,  # sliding window (0: none)
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    SOFTCAP: tl.constexpr,  # whether scores are soft-capped
    DOT_DTYPE: tl.constexpr,  # what the operands of the dots are cast to
    DOT_PRECISION: tl.constexpr,
):
    """One (request, block of its new tokens, query head): the tokens attend to the cached
    prefix and causally to the new tokens, which are already in the pool at their slots."""
    req = tl.program_id(0)
    m_block = tl.program_id(1)
    head = tl.program_id(2)
    q_len = tl.load(extend_seq_lens + req)
    if m_block * BLOCK_M < q_len:
        prefix = tl.load(extend_prefix_lens + req)
        first = tl.load(extend_start_loc + req)
        kv_head = head // GROUP
        i = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
        i_ok = i < q_len
        q_pos = prefix + i
        d = tl.arange(0, BLOCK_D)
        d_ok = d < head_dim
        q_ok = i_ok[:, None] & d_ok[None, :]
        qv = tl.load(q + (first + i[:, None]) * stride_qt + head * stride_qh + d[None, :], mask=q_ok, other=0.0)
        qv = qv.to(DOT_DTYPE)
        table = req_to_token + tl.load(req_pool_indices + req) * stride_table
        # Keys up to this block's last query, from its first query's window start (key 0 without a window).
        end = prefix + tl.minimum((m_block + 1) * BLOCK_M, q_len)
        start = tl.where(window > 0, tl.maximum(prefix + m_block * BLOCK_M - window + 1, 0), 0)
        acc, m_i, l_i = _online_softmax(
            qv, q_pos, window, table, k_buf, v_buf, kv_head, start, end, scale, softcap,
            stride_ks, stride_kh, stride_vs, stride_vh, d, d_ok,
            ROWS=BLOCK_M, BLOCK_D=BLOCK_D, BLOCK_N=BLOCK_N, CAUSAL=True, SOFTCAP=SOFTCAP, PAGE_SIZE=PAGE_SIZE,
            DOT_DTYPE=DOT_DTYPE, DOT_PRECISION=DOT_PRECISION,
        )  # fmt: skip
        # A real query always sees itself (l > 0); the block's rows past q_len may see no key
        # under a window and are not stored: divide those by 1, not 0.
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out + (first + i[:, None]) * stride_ot + head * stride_oh + d[None, :], o.to(out.dtype.element_ty), mask=q_ok)


def _interpreted() -> bool:
    from triton.runtime.jit import JITFunction

    library, ours = (not isinstance(f, JITFunction) for f in (tl.cdiv, _decode_partial))
    if library != ours:
        raise RuntimeError(
            "TRITON_INTERPRET changed between importing triton and graphexec's Triton kernels; "
            "set it before triton is first imported"
        )
    return ours


# Whether this process runs Triton kernels in the interpreter (see the module docstring).
INTERPRETED = _interpreted()
