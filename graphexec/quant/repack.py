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
from graphexec.quant.ops import QBLOCK, rows16_to_row_major

GROUP = 16  # rows interleaved


@dataclass(frozen=True, eq=False)
class Rows16:
    """codes [G, B, J, 16, 4] (uint8 4-bit, J = 4; int8 8-bit, J = 8); scales, mins [G, B, 16] float16."""

    qtype: str
    rows: int  # real output rows (the last group may be padding past them)
    codes: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None

    def row_major(self) -> QuantizedWeight:
        """The GGUF-ordered weight back (a copy)."""
        codes, scales, mins = rows16_to_row_major(self.codes, self.scales, self.mins, self.rows)
        return QuantizedWeight(self.qtype, codes.contiguous(), scales.contiguous(), None if mins is None else mins.contiguous())


def repack_rows16(weight: QuantizedWeight) -> Rows16:
    n, k = weight.shape
    groups, blocks = -(-n // GROUP), k // QBLOCK
    pad = groups * GROUP - n
    # Each row's 4-byte runs move as one int32: a quarter of the elements to shuffle.
    words = _pad_rows(weight.codes, pad).contiguous().view(torch.int32).view(groups, GROUP, blocks, -1)
    codes = words.permute(0, 2, 3, 1).contiguous().view(weight.codes.dtype).view(groups, blocks, -1, GROUP, 4)

    def grouped(t: torch.Tensor) -> torch.Tensor:
        return _pad_rows(t, pad).view(groups, GROUP, blocks).permute(0, 2, 1).contiguous()

    mins = None if weight.mins is None else grouped(weight.mins)
    return Rows16(weight.qtype, n, codes, grouped(weight.scales), mins)


def _pad_rows(t: torch.Tensor, pad: int) -> torch.Tensor:
    return F.pad(t, (0, 0, 0, pad)) if pad else t
