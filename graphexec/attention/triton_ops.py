"""The launches of attention/triton_kernels.py: argument checks, grids, block sizes, and the
launches registered as torch ops (`graphexec::triton_decode`, `graphexec::triton_extend`).

As ops, a recorder that writes down ops (capture/op_tape.py) records the launch itself, with its
arguments and its grid, exactly what a CUDA graph records of a kernel launch; an interpreted
kernel issues no aten op the tape could see.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphexec.attention.triton_kernels import (
    DECODE_BLOCK_N,
    EXTEND_BLOCK_M,
    EXTEND_BLOCK_N,
    INTERPRETED,
    MIN_KEYS_PER_SPLIT,
    _decode_partial,
    _decode_reduce,
    _extend,
    num_splits_for,
)

__all__ = ["INTERPRETED", "decode", "extend", "num_splits_for"]


_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def _dot_args(dtype: torch.dtype) -> dict:
    """The dots' operand dtype and precision for activations of `dtype`: the activations' own,
    except bf16 in the interpreter, whose tl.dot multiplies bf16 bit patterns as integers
    (triton-lang/triton#11584, unsupported there): fp32 instead.  fp32 dots would run as tf32
    on the GPU by default (10 mantissa bits, visibly off the reference): "ieee"."""
    dot_dtype = torch.float32 if INTERPRETED and dtype == torch.bfloat16 else dtype
    return dict(DOT_DTYPE=_TL_DTYPES[dot_dtype], DOT_PRECISION="ieee" if dot_dtype == torch.float32 else None)


def _check_head_dim_contiguous(*tensors: torch.Tensor) -> None:
    # The kernels step through a head's values with stride 1.
    if any(t.stride(-1) != 1 for t in tensors):
        raise ValueError("the Triton attention kernels need head_dim contiguous (stride 1) in q, out and the KV buffers")


def _block(n: int, at_least: int = 16) -> int:
    """A power of two >= n (tl.arange's sizes), and >= 16 (tl.dot's smallest tile)."""
    return max(at_least, triton.next_power_of_2(n))


def decode(
    q: torch.Tensor,
    out: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    part_acc: torch.Tensor,
    part_lse: torch.Tensor,
    scale: float,
    num_splits: int,
    sliding_window: int = 0,
    logit_softcap: float = 0.0,
    min_split_len: int = MIN_KEYS_PER_SPLIT,
    block_n: int = DECODE_BLOCK_N,
    page_size: int = 1,
) -> None:
    """out[r] = attention of q[r] over the first seq_lens[r] keys of table row req_pool_indices[r]
    (the last `sliding_window` of them when that is > 0), scores soft-capped at `logit_softcap`
    when that is > 0.

    q, out: [rows, heads, head_dim]; k_buf, v_buf: [slots, kv_heads, head_dim]; part_acc/part_lse:
    the workspace (see _decode_partial), with room for `num_splits` splits.  The grid depends on
    rows, heads and num_splits only, never on the lengths.
    """
    rows, heads, head_dim = q.shape
    kv_heads = k_buf.shape[1]
    if rows == 0:
        return
    _check_head_dim_contiguous(q, out, k_buf, v_buf)
    if num_splits > 1 and (part_acc.shape[2] < num_splits or part_lse.shape[2] < num_splits):
        raise ValueError(f"decode workspace holds {part_acc.shape[2]} splits, {num_splits} asked")
    group = heads // kv_heads
    block_d = _block(head_dim)
    _decode_partial[(rows, kv_heads, num_splits)](
        q, out, k_buf, v_buf, req_to_token, req_pool_indices, seq_lens, part_acc, part_lse,
        scale, max(logit_softcap, 0.0),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_buf.stride(0), k_buf.stride(1), v_buf.stride(0), v_buf.stride(1),
        req_to_token.stride(0),
        part_acc.stride(0), part_acc.stride(1), part_acc.stride(2),
        part_lse.stride(0), part_lse.stride(1),
        head_dim, min_split_len, max(sliding_window, 0),
        GROUP=group, BLOCK_H=_block(group), BLOCK_D=block_d, BLOCK_N=block_n, PAGE_SIZE=page_size,
        SOFTCAP=logit_softcap > 0, **_dot_args(q.dtype),
    )  # fmt: skip
    if num_splits == 1:
        return  # every row was one split, written to `out` by _decode_partial
    _decode_reduce[(rows, kv_heads)](
        out, seq_lens, part_acc, part_lse,
        out.stride(0), out.stride(1),
        part_acc.stride(0), part_acc.stride(1), part_acc.stride(2),
        part_lse.stride(0), part_lse.stride(1),
        head_dim, min_split_len, num_splits, max(sliding_window, 0),
        GROUP=group, BLOCK_H=_block(group, 1), BLOCK_S=_block(num_splits, 1), BLOCK_D=block_d,
    )  # fmt: skip


def extend(
    q: torch.Tensor,
    out: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    extend_prefix_lens: torch.Tensor,
    extend_seq_lens: torch.Tensor,
    extend_start_loc: torch.Tensor,
    scale: float,
    max_extend_len: int,
    sliding_window: int = 0,
    logit_softcap: float = 0.0,
    block_m: int = EXTEND_BLOCK_M,
    block_n: int = EXTEND_BLOCK_N,
    page_size: int = 1,
) -> None:
    """Each request's new tokens (rows extend_start_loc[r] ... + extend_seq_lens[r] of q) over its
    prefix and, causally, themselves (a query at p: keys p - sliding_window + 1 .. p when
    sliding_window > 0), scores soft-capped at `logit_softcap` when that is > 0.  q, out: [tokens,
    heads, head_dim]; rows of out that belong to no request are not written."""
    requests = req_pool_indices.shape[0]
    _, heads, head_dim = q.shape
    if requests == 0 or max_extend_len == 0:
        return
    _check_head_dim_contiguous(q, out, k_buf, v_buf)
    _extend[(requests, triton.cdiv(max_extend_len, block_m), heads)](
        q, out, k_buf, v_buf, req_to_token, req_pool_indices,
        extend_prefix_lens, extend_seq_lens, extend_start_loc,
        scale, max(logit_softcap, 0.0),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_buf.stride(0), k_buf.stride(1), v_buf.stride(0), v_buf.stride(1),
        req_to_token.stride(0),
        head_dim, max(sliding_window, 0),
        GROUP=heads // k_buf.shape[1], BLOCK_M=block_m, BLOCK_D=_block(head_dim), BLOCK_N=block_n,
        PAGE_SIZE=page_size, SOFTCAP=logit_softcap > 0, **_dot_args(q.dtype),
    )  # fmt: skip


# The launches as ops (see the module docstring): what a recorder writes down is the launch.
_LIB = torch.library.Library("graphexec", "FRAGMENT")  # noqa: the library object keeps the ops alive
_LIB.define(
    "triton_decode(Tensor q, Tensor(a!) out, Tensor k_buf, Tensor v_buf, Tensor req_to_token, "
    "Tensor req_pool_indices, Tensor seq_lens, Tensor(b!) part_acc, Tensor(c!) part_lse, float scale, "
    "int num_splits, int sliding_window=0, float logit_softcap=0.0) -> ()"
)
_LIB.define(
    "triton_extend(Tensor q, Tensor(a!) out, Tensor k_buf, Tensor v_buf, Tensor req_to_token, "
    "Tensor req_pool_indices, Tensor extend_prefix_lens, Tensor extend_seq_lens, Tensor extend_start_loc, "
    "float scale, int max_extend_len, int sliding_window=0, float logit_softcap=0.0) -> ()"
)
_LIB.impl("triton_decode", decode, "CompositeExplicitAutograd")
_LIB.impl("triton_extend", extend, "CompositeExplicitAutograd")


@torch.library.register_fake("graphexec::triton_decode")
def _decode_fake(*args) -> None:
    return None


@torch.library.register_fake("graphexec::triton_extend")
def _extend_fake(*args) -> None:
    return None
