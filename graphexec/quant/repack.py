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
from graphexec.quant.kquants import BlockWeight
from graphexec.quant.ops import QBLOCK, rows16_to_row_major

GROUP = 16  # rows interleaved
Q5_TYPES = ("Q5_0", "Q5_1")


@dataclass(frozen=True, eq=False)
class Rows16:
    """codes [G, B, J, 16, 4] (uint8 4-bit, J = 4; int8 8-bit or uint8 unpacked 5-bit, J = 8);
    scales, mins [G, B, 16] float16."""

    qtype: str
    rows: int  # real output rows (the last group may be padding past them)
    codes: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows, self.codes.shape[1] * QBLOCK)

    def row_major(self) -> QuantizedWeight:
        """The GGUF-ordered arrays back (a copy).  An unpacked 5-bit weight's codes stay one a
        byte, which QuantizedWeight's own methods would read as two 4-bit codes."""
        codes, scales, mins = rows16_to_row_major(self.codes, self.scales, self.mins, self.rows)
        return QuantizedWeight(self.qtype, codes.contiguous(), scales.contiguous(), None if mins is None else mins.contiguous())


def repack_rows16(weight: QuantizedWeight) -> Rows16:
    return _interleave(weight.qtype, weight.codes, weight.scales, weight.mins, weight.shape)


def unpacked_q5_rows16(weight: BlockWeight) -> Rows16:
    """A Q5_0 / Q5_1 weight for qlinear_q8: each 5-bit code unpacked to a byte (0..31; Q5_0's
    d * (q - 16) kept as d * q + m with m = -16 d, exact in float16), so the kernel reads it as
    unsigned 8-bit codes.  Exact, but 9 bits a weight against the file's 5.5-6: the price of
    running 5-bit files on the integer path until a kernel reads the bit planes in place."""
    if weight.qtype not in Q5_TYPES:
        raise ValueError(f"{weight.qtype} is not a 5-bit type ({', '.join(Q5_TYPES)})")
    n, k = weight.shape
    blocks = weight.blocks.view(n, k // QBLOCK, -1)
    header = 2 if weight.qtype == "Q5_0" else 4  # d (and m)
    d = blocks[..., 0:2].contiguous().view(torch.float16).reshape(n, -1)
    m = -16 * d if weight.qtype == "Q5_0" else blocks[..., 2:4].contiguous().view(torch.float16).reshape(n, -1)
    high = blocks[..., header : header + 4].contiguous().view(torch.int32).reshape(n, -1, 1)
    nibbles = blocks[..., header + 4 :]  # byte j: element j (low nibble), element j + 16 (high)
    low = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=-1).int()
    bits = (high >> torch.arange(QBLOCK, dtype=torch.int32)) & 1
    codes = (low | (bits << 4)).to(torch.uint8).reshape(n, k)
    return _interleave(weight.qtype, codes, d.contiguous(), m.contiguous(), (n, k))


def _interleave(qtype: str, codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, shape) -> Rows16:
    n, k = shape
    groups, blocks = -(-n // GROUP), k // QBLOCK
    pad = groups * GROUP - n
    # Each row's 4-byte runs move as one int32: a quarter of the elements to shuffle.
    words = _pad_rows(codes, pad).contiguous().view(torch.int32).view(groups, GROUP, blocks, -1)
    packed = words.permute(0, 2, 3, 1).contiguous().view(codes.dtype).view(groups, blocks, -1, GROUP, 4)

    def grouped(t: torch.Tensor) -> torch.Tensor:
        return _pad_rows(t, pad).view(groups, GROUP, blocks).permute(0, 2, 1).contiguous()

    return Rows16(qtype, n, packed, grouped(scales), None if mins is None else grouped(mins))


def _pad_rows(t: torch.Tensor, pad: int) -> torch.Tensor:
    return F.pad(t, (0, 0, 0, pad)) if pad else t
