"""GGUF's K-quant (Q4_K, Q5_K, Q6_K) and 5-bit (Q5_0, Q5_1) weights kept in the file's own block
bytes, and the two ops that read them: `graphexec::qlinear_blocks` and `graphexec::qdequantize_blocks`.

A `BlockWeight` is a [N, K] linear weight as uint8 [N, row_bytes]: row n is the GGUF blocks of
output row n, byte for byte.  Rows are independent in every GGUF type, so llama.cpp's rotary row
order, q/k/v fusion and tensor-parallel row cuts are plain tensor ops on `blocks`; a column cut
takes whole blocks (256 elements for K-quants, 32 for Q5_x).  Unlike QuantizedWeight
(graphexec/quant/formats.py) nothing is split into arrays: a K-quant super-block's 6-bit scales
are decoded by the kernel (graphexec/kernels/csrc/qlinear_kquants.cpp), never at load.

Schemas and fake implementations live here, as for graphexec::qlinear (graphexec/quant/ops.py):
one opaque node for Dynamo and inductor on any device.  The CPU kernels are C++; every other
device runs the plain-torch reference below, which reproduces gguf's numpy dequantization bit for
bit (tests/test_kquants.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple

import numpy as np
import torch

from graphexec.quant.ops import QBLOCK


class BlockFormat(NamedTuple):
    type_id: int  # GGML's type id, what the ops take
    elements: int  # weights per block
    nbytes: int  # bytes per block


BLOCK_FORMATS = {
    "Q5_0": BlockFormat(6, 32, 22),  # d, 32 high bits, 16 bytes of nibbles
    "Q5_1": BlockFormat(7, 32, 24),  # d, m, 32 high bits, nibbles
    "Q4_K": BlockFormat(12, 256, 144),  # d, dmin, 12 bytes of 6-bit scales/mins, 128 bytes of nibbles
    "Q5_K": BlockFormat(13, 256, 176),  # as Q4_K plus 32 bytes of high bits
    "Q6_K": BlockFormat(14, 256, 210),  # 128 bytes low nibbles, 64 bytes 2-bit highs, 16 int8 scales, d
}
BLOCK_GGUF_TYPES = tuple(BLOCK_FORMATS)
_BY_ID = {f.type_id: (name, f) for name, f in BLOCK_FORMATS.items()}


def block_elements(qtype: str) -> int:
    """Input columns per block of a GGUF type graphexec keeps packed (a column cut's unit)."""
    return BLOCK_FORMATS[qtype].elements if qtype in BLOCK_FORMATS else QBLOCK


@dataclass(frozen=True, eq=False)
class BlockWeight:
    """blocks: uint8 [N, K / elements * nbytes], GGUF's bytes for each output row."""

    qtype: str
    blocks: torch.Tensor

    @property
    def format(self) -> BlockFormat:
        return BLOCK_FORMATS[self.qtype]

    @property
    def shape(self) -> tuple[int, int]:
        return (self.blocks.shape[0], self.blocks.shape[1] // self.format.nbytes * self.format.elements)

    def nbytes(self) -> int:
        return self.blocks.numel()

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.blocks,)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_blocks_reference(self.blocks, self.format.type_id, dtype)

    def map_rows(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> "BlockWeight":
        """The same weight with `fn` (a row permutation or slice) applied to its rows."""
        return BlockWeight(self.qtype, fn(self.blocks))

    def columns(self, start: int, stop: int) -> "BlockWeight":
        """Input columns [start, stop), which must fall on block boundaries (a copy)."""
        elements, nbytes = self.format.elements, self.format.nbytes
        if start % elements or stop % elements:
            raise ValueError(f"columns [{start}, {stop}) do not fall on {self.qtype}'s {elements}-element blocks")
        return BlockWeight(self.qtype, self.blocks[:, start // elements * nbytes : stop // elements * nbytes].clone())

    @staticmethod
    def from_gguf(raw: np.ndarray, qtype: str, shape: tuple[int, int]) -> "BlockWeight":
        """GGUF's bytes for a [N, K] tensor (possibly a read-only view of the file), copied."""
        rows = np.array(np.ascontiguousarray(raw).view(np.uint8).reshape(shape[0], -1))
        return BlockWeight(qtype, torch.from_numpy(rows))


@dataclass(frozen=True, eq=False)
class StackedBlocks:
    """A mixture's experts of one projection in GGUF's bytes: blocks uint8 [experts, N, row bytes]
    (a GGUF `ffn_*_exps` tensor as stored; graphexec/models/moe.py reads one expert's rows)."""

    qtype: str
    blocks: torch.Tensor

    @property
    def format(self) -> BlockFormat:
        return BLOCK_FORMATS[self.qtype]

    @property
    def shape(self) -> tuple[int, int, int]:
        e, n, row = self.blocks.shape
        return (e, n, row // self.format.nbytes * self.format.elements)

    def nbytes(self) -> int:
        return self.blocks.numel()

    def expert(self, e: int) -> BlockWeight:
        return BlockWeight(self.qtype, self.blocks[e])

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.stack([self.expert(e).dequantize(dtype) for e in range(self.blocks.shape[0])])

    @staticmethod
    def from_gguf(raw: np.ndarray, qtype: str, shape: tuple[int, int, int]) -> "StackedBlocks":
        rows = np.array(np.ascontiguousarray(raw).view(np.uint8).reshape(shape[0], shape[1], -1))
        return StackedBlocks(qtype, torch.from_numpy(rows))


def concat_blocks(parts: list[BlockWeight]) -> BlockWeight:
    """Stack same-type weights along N (fused q/k/v, gate/up)."""
    assert len({(p.qtype, p.shape[1]) for p in parts}) == 1, [p.qtype for p in parts]
    return BlockWeight(parts[0].qtype, torch.cat([p.blocks for p in parts]))


# --- the ops --------------------------------------------------------------------------------

_LIB = torch.library.Library("graphexec", "FRAGMENT")  # noqa: the library object keeps the ops alive
_LIB.define("qlinear_blocks(Tensor x, Tensor blocks, int qtype) -> Tensor")
_LIB.define("qdequantize_blocks(Tensor blocks, int qtype, ScalarType dtype) -> Tensor")


@torch.library.register_fake("graphexec::qlinear_blocks")
def _qlinear_blocks_fake(x, blocks, qtype):
    return x.new_empty((*x.shape[:-1], blocks.shape[0]))


@torch.library.register_fake("graphexec::qdequantize_blocks")
def _qdequantize_blocks_fake(blocks, qtype, dtype):
    _, fmt = _BY_ID[qtype]
    return blocks.new_empty((blocks.shape[0], blocks.shape[1] // fmt.nbytes * fmt.elements), dtype=dtype)


def _half(b: torch.Tensor, offset: int) -> torch.Tensor:
    return b[:, offset : offset + 2].clone(memory_format=torch.contiguous_format).view(torch.float16).float()  # [B, 1]


def _k_scales_mins(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 12 bytes -> 8 six-bit scales and 8 six-bit mins: the first four of each are
    the low 6 bits of bytes 0-3 / 4-7; the last four take 4 bits from bytes 8-11 and their top
    2 bits from the top bits of bytes 0-3 / 4-7."""
    s = s.int()
    lo_sc, lo_m, mixed = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    scales = torch.cat([lo_sc & 63, (mixed & 15) | ((lo_sc >> 6) << 4)], dim=-1)
    mins = torch.cat([lo_m & 63, (mixed >> 4) | ((lo_m >> 6) << 4)], dim=-1)
    return scales.float(), mins.float()


def _shifts(count: int, step: int, device: torch.device) -> torch.Tensor:
    # arange, not torch.tensor([...]): no host-to-device copy, so CUDA graph capture may record it.
    return torch.arange(count, device=device, dtype=torch.int32) * step


def _nibbles(qs: torch.Tensor, group: int) -> torch.Tensor:
    """[B, bytes] -> [B, bytes / group, 2, group]: each group of bytes, low nibbles then high."""
    q = qs.int().reshape(qs.shape[0], -1, 1, group)
    return (q >> _shifts(2, 4, qs.device).reshape(1, 1, 2, 1)) & 15


class BlockCodes(NamedTuple):
    """A block weight's unsigned codes and per-sub-block scales: value = scale * (q - bias)
    (+ min).  Q4_K / Q5_K sub-blocks are 32 elements, Q6_K's 16, Q5_x's the whole 32-element block."""

    q: torch.Tensor  # int32 [N, K], as the file stores them (0..63)
    bias: int  # 32 for Q6_K, 16 for Q5_0, else 0
    scales: torch.Tensor  # float32 [N, K / sub]
    mins: torch.Tensor | None  # float32 [N, K / sub]; None: no min (Q6_K, Q5_0)


def block_codes(blocks: torch.Tensor, type_id: int) -> BlockCodes:
    """Decode GGUF block bytes [N, row_bytes] into codes and fp32 sub-block scales, in plain torch
    ops (any device).  Each scale is gguf's own fp32 product (d * 6-bit scale, d * int8 scale):
    exact, as an fp16 times a small integer always is in fp32."""
    qtype, fmt = _BY_ID[type_id]
    n = blocks.shape[0]
    b = blocks.reshape(-1, fmt.nbytes)
    count = b.shape[0]
    mins, bias = None, 0
    if qtype in ("Q4_K", "Q5_K"):
        d, dmin = _half(b, 0), _half(b, 2)
        scales, sub_mins = _k_scales_mins(b[:, 4:16])
        qs_at = 16 if qtype == "Q4_K" else 48
        q = _nibbles(b[:, qs_at : qs_at + 128], 32).reshape(count, 8, 32)
        if qtype == "Q5_K":
            qh = b[:, 16:48].int().reshape(count, 1, 32) >> _shifts(8, 1, b.device).reshape(1, 8, 1)
            q = q | ((qh & 1) << 4)
        scales, mins = d * scales, -(dmin * sub_mins)
    elif qtype == "Q6_K":
        low = _nibbles(b[:, :128], 64).reshape(count, 8, 32)
        qh = b[:, 128:192].int().reshape(count, 2, 1, 32) >> _shifts(4, 2, b.device).reshape(1, 1, 4, 1)
        q, bias = low | ((qh & 3) << 4).reshape(count, 8, 32), 32
        scales = _half(b, 208) * b[:, 192:208].clone(memory_format=torch.contiguous_format).view(torch.int8).float()
    else:  # Q5_0, Q5_1: a 32-bit little-endian mask of fifth bits, then 16 bytes of nibbles
        has_min = qtype == "Q5_1"
        qh_at = 4 if has_min else 2
        # In bytes, not int32: the most common 5-bit tensors are the largest (a quarter the traffic).
        bit = torch.arange(8, dtype=torch.uint8, device=b.device)
        high = ((b[:, qh_at : qh_at + 4].unsqueeze(-1) >> bit) & 1).reshape(count, 32)
        qs = b[:, qh_at + 4 : qh_at + 20]
        q = (torch.cat([qs & 15, qs >> 4], dim=-1) | (high << 4)).int()
        scales = _half(b, 0)
        if has_min:
            mins = _half(b, 2)
        else:
            bias = 16
    return BlockCodes(q.reshape(n, -1), bias, scales.reshape(n, -1), None if mins is None else mins.reshape(n, -1))


def dequantize_blocks_reference(blocks: torch.Tensor, type_id: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weight as a dense [N, K] tensor, in plain torch ops (any device), with gguf's fp32
    arithmetic in gguf's order: each product and sum rounded as numpy rounds it (Q5_0's
    d * (q - 16) too, so a -0.0 stays -0.0)."""
    codes = block_codes(blocks, type_id)
    n, k = codes.q.shape
    per_sub = (codes.q - codes.bias).view(n, codes.scales.shape[1], -1).float()
    values = codes.scales.unsqueeze(-1) * per_sub
    if codes.mins is not None:
        values = values + codes.mins.unsqueeze(-1)
    return values.reshape(n, k).to(dtype)


def _qlinear_blocks_any_device(x, blocks, qtype):
    # TODO(gpu): a fused dequantize-GEMV kernel; this materializes the weight per call.
    return torch.nn.functional.linear(x, dequantize_blocks_reference(blocks, qtype, x.dtype))


def _qdequantize_blocks_any_device(blocks, qtype, dtype):
    return dequantize_blocks_reference(blocks, qtype, dtype)


_LIB.impl("qlinear_blocks", _qlinear_blocks_any_device, "CUDA")
_LIB.impl("qdequantize_blocks", _qdequantize_blocks_any_device, "CUDA")
