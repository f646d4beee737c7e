"""Rows interleaved in groups of 16: the weight layout graphexec::qlinear_q8 reads.

A QuantizedWeight keeps GGUF's row-major blocks (formats.py), which row permutations, fusion and
tensor-parallel cuts work on.  The 8-bit activation kernel wants 16 output rows side by side
instead: for each group of 16 rows and each 32-element block, 4 consecutive code bytes of every
row fill one 512-bit register, one row per 32-bit lane, so the byte dot products of a block come
out as 16 rows' sums with nothing to reduce (graphexec/kernels/csrc/qlinear_q8.cpp has the
layout).  Repacking is a byte shuffle (reshape + permute, one copy), done once when the module is
built: the weight is never held twice.  Rows are padded with zero codes and scales to a multiple
of 16; the kernel does not write the padding's outputs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from graphexec.quant.formats import QuantizedWeight
from graphexec.quant.kquants import BlockWeight, block_codes
from graphexec.quant.ops import QBLOCK, rows16_to_row_major

GROUP = 16  # rows interleaved
Q5_TYPES = ("Q5_0", "Q5_1")


@dataclass(frozen=True, eq=False)
class Rows16:
    """codes [G, B, J, 16, 4] (uint8 4-bit, J = 4; 5-bit, J = 5; 6-bit offset by 32, J = 6; int8
    8-bit, J = 8);
    scales, mins [G, B, 16] per 32-element block, or [G, B, 2, 16] per 16-element half (Q6_K):
    float16 where the file's scales are (Q4_x, Q8_0, Q5_x), float32 where they are products
    (K-quants: d times a sub-block's integer scale)."""

    qtype: str
    rows: int  # real output rows (the last group may be padding past them)
    codes: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows, self.codes.shape[1] * QBLOCK)

    def row_major(self) -> QuantizedWeight:
        """The GGUF-ordered arrays back (a copy), for 4- and 8-bit codes from a QuantizedWeight
        (repack_rows16).  A block weight's (block_rows16) scales stay float32 and Q6_K's come two
        a block; its codes are read with ops.rows16_codes, which also knows the bit planes."""
        codes, scales, mins = rows16_to_row_major(self.codes, self.scales, self.mins, self.rows)
        return QuantizedWeight(self.qtype, codes.contiguous(), scales.contiguous(), None if mins is None else mins.contiguous())


def repack_rows16(weight: QuantizedWeight) -> Rows16:
    return _interleave(weight.qtype, weight.codes, weight.scales, weight.mins, weight.shape)


def block_rows16(weight: BlockWeight) -> Rows16:
    """A GGUF block weight (K-quant or 5-bit) in qlinear_q8's layout, its values exactly the file's.
    Codes above four bits keep their low four two a byte, as Q4_x does, and each higher bit in a
    plane of its own (qlinear_q8.cpp has the layout); bits a weight against the file's:
    - Q4_K: fp32 scale and min per 32 (6 against 4.5: the scales are products, d times a 6-bit
      integer, exact in fp32 only);
    - Q5_0, Q5_1: a plane of fifth bits, the file's fp16 scale (and min) per 32 (Q5_0's
      d * (q - 16) kept as d * q + m with m = -16 d, exact): 6 against 5.5-6;
    - Q5_K: the same with fp32 scales and mins: 7 against 5.5;
    - Q6_K: codes q + 32 (0..63) in two planes, an fp32 scale per 16-element half and no min
      (the kernel subtracts 32 d): 8 against 6.6."""
    n, k = weight.shape
    codes = block_codes(weight.blocks, weight.format.type_id)
    scales, mins = codes.scales, codes.mins
    if weight.qtype in Q5_TYPES:  # the file's fp16 scales; Q5_0's bias of 16 becomes a min
        scales = scales.half()
        mins = scales * -float(codes.bias) if mins is None else mins.half()
    planes = {"Q4_K": 0, "Q6_K": 2}.get(weight.qtype, 1)  # Q6_K's bias of 32 is the 6-bit kind's own
    q = codes.q.to(torch.uint8)  # 0..63: a quarter of int32's traffic for the shuffles below
    halves = (q & 0x0F).view(n, k // QBLOCK, 2, QBLOCK // 2)  # byte t: element t (low nibble), 16 + t (high)
    nibbles = (halves[:, :, 0] | (halves[:, :, 1] << 4)).reshape(n, k // 2)
    packed = _interleave(weight.qtype, nibbles, scales.contiguous(), None if mins is None else mins.contiguous(), (n, k))
    if not planes:
        return packed
    high = [_bit_plane((q >> (4 + p)) & 1, packed.codes.shape[0]) for p in range(planes)]
    return Rows16(weight.qtype, n, torch.cat([packed.codes, *high], dim=2), packed.scales, packed.mins)


def _bit_plane(bits: torch.Tensor, groups: int) -> torch.Tensor:
    """[n, K] bits -> uint8 [G, B, 1, 16, 4]: per block, eight 64-bit little-endian masks, mask
    2j + half holding in bit 4r + t the bit of element 16 half + 4j + t of lane r: the lanes and
    bytes of the v-th 4-bit register the kernel builds (qlinear_q8.cpp)."""
    blocks = bits.shape[1] // QBLOCK
    bits = _pad_rows(bits, groups * GROUP - bits.shape[0]).view(groups, GROUP, blocks, 2, 4, 4)
    bits = bits.permute(0, 2, 4, 3, 1, 5).reshape(groups, blocks, 8, 8, 8)  # [g, b, v, byte, bit]
    weights = 1 << torch.arange(8, dtype=torch.uint8)
    return (bits * weights).sum(-1, dtype=torch.uint8).view(groups, blocks, 1, GROUP, 4)


def _interleave(qtype: str, codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, shape) -> Rows16:
    n, k = shape
    groups, blocks = -(-n // GROUP), k // QBLOCK
    pad = groups * GROUP - n
    # Each row's 4-byte runs move as one int32: a quarter of the elements to shuffle.
    words = _pad_rows(codes, pad).contiguous().view(torch.int32).view(groups, GROUP, blocks, -1)
    packed = words.permute(0, 2, 3, 1).contiguous().view(codes.dtype).view(groups, blocks, -1, GROUP, 4)
    per_block = scales.shape[1] // blocks  # 2: Q6_K's halves

    def grouped(t: torch.Tensor) -> torch.Tensor:
        lanes = _pad_rows(t, pad).view(groups, GROUP, blocks, per_block).permute(0, 2, 3, 1).contiguous()
        return lanes if per_block > 1 else lanes.view(groups, blocks, GROUP)

    return Rows16(qtype, n, packed, grouped(scales), None if mins is None else grouped(mins))


def _pad_rows(t: torch.Tensor, pad: int) -> torch.Tensor:
    return F.pad(t, (0, 0, 0, pad)) if pad else t
