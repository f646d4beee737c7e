"""Block-quantized weights as graphexec keeps them in memory, and their packing from GGUF blocks.

A `QuantizedWeight` is a [N, K] linear weight in 32-element blocks along K: packed codes plus a
float16 scale (and, for 4-bit, a float16 min) per block; value = d * q + m.  GGUF's Q4_0, Q4_1 and
Q8_0 blocks map onto it without touching a code: the layout is the kernel's (graphexec/kernels/
csrc/qlinear.cpp), split into three arrays so rows can be permuted and concatenated (q/k/v fusion,
llama.cpp's rotary row order) with plain tensor ops.  No fp32 copy of the weight is ever kept.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

from graphexec.errors import CheckpointError
from graphexec.quant.ops import QBLOCK, dequantize_reference

# GGUF type name -> (bytes per block, has a min, 4-bit codes)
_GGUF_BLOCKS = {
    "Q4_0": (2 + QBLOCK // 2, False, True),
    "Q4_1": (4 + QBLOCK // 2, True, True),
    "Q8_0": (2 + QBLOCK, False, False),
}
SUPPORTED_GGUF_TYPES = tuple(_GGUF_BLOCKS)


@dataclass(frozen=True, eq=False)
class QuantizedWeight:
    """codes: uint8 [N, K/2] (two 4-bit codes a byte) or int8 [N, K]; scales, mins: float16 [N, K/32]."""

    qtype: str  # the GGUF type it came from, for reports and errors
    codes: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None

    @property
    def shape(self) -> tuple[int, int]:
        return (self.codes.shape[0], self.scales.shape[1] * QBLOCK)

    @property
    def four_bit(self) -> bool:
        return self.codes.dtype == torch.uint8

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.codes, self.scales) if self.mins is None else (self.codes, self.scales, self.mins)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_reference(self.codes, self.scales, self.mins, dtype)

    def map_rows(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> "QuantizedWeight":
        """The same weight with `fn` (a row permutation) applied to every array's rows."""
        mins = None if self.mins is None else fn(self.mins)
        return QuantizedWeight(self.qtype, fn(self.codes), fn(self.scales), mins)


def concat_rows(parts: Sequence[QuantizedWeight], name: str) -> QuantizedWeight:
    """Stack weights along N (fused q/k/v, gate/up); they must share a code width and input size."""
    kinds = {(p.four_bit, p.mins is not None, p.shape[1]) for p in parts}
    if len(kinds) != 1:
        types = ", ".join(p.qtype for p in parts)
        raise CheckpointError(
            f"{name}: the fused parts have different quantizations ({types}); load with model.weights=dequantize"
        )
    mins = None if parts[0].mins is None else torch.cat([p.mins for p in parts])
    qtype = "+".join(dict.fromkeys(p.qtype for p in parts))
    return QuantizedWeight(qtype, torch.cat([p.codes for p in parts]), torch.cat([p.scales for p in parts]), mins)


@dataclass(frozen=True, eq=False)
class StackedQuantized:
    """A mixture's experts of one projection as QuantizedWeight arrays with the expert dimension
    first: codes [experts, N, K/2 or K], scales and mins [experts, N, K/32] (Q4_0, Q4_1, Q8_0)."""

    qtype: str
    codes: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.codes.shape[0], self.codes.shape[1], self.scales.shape[2] * QBLOCK)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.codes, self.scales) if self.mins is None else (self.codes, self.scales, self.mins)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def expert(self, e: int) -> QuantizedWeight:
        return QuantizedWeight(self.qtype, self.codes[e], self.scales[e], None if self.mins is None else self.mins[e])

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.stack([self.expert(e).dequantize(dtype) for e in range(self.codes.shape[0])])

    def map(self, fn: Callable[[torch.Tensor, int], torch.Tensor]) -> "StackedQuantized":
        """`fn(array, elements per array column)` applied to every array (a tensor-parallel cut)."""
        per_code = 2 if self.codes.dtype == torch.uint8 else 1
        mins = None if self.mins is None else fn(self.mins, QBLOCK)
        return StackedQuantized(self.qtype, fn(self.codes, per_code), fn(self.scales, QBLOCK), mins)

    @staticmethod
    def from_gguf(raw: np.ndarray, qtype: str, shape: tuple[int, int, int]) -> "StackedQuantized":
        rows = np.ascontiguousarray(raw).view(np.uint8).reshape(shape[0], shape[1], -1)
        experts = [from_gguf_blocks(rows[e], qtype, shape[1:]) for e in range(shape[0])]
        mins = None if experts[0].mins is None else torch.stack([w.mins for w in experts])
        return StackedQuantized(qtype, torch.stack([w.codes for w in experts]), torch.stack([w.scales for w in experts]), mins)


def from_gguf_blocks(raw: np.ndarray, qtype: str, shape: tuple[int, int]) -> QuantizedWeight:
    """Split GGUF blocks (raw bytes, [N, blocks * block_bytes]) into codes, scales and mins.

    Q4_0's value d * (q - 8) is kept as d * q + m with m = -8 d, which is exact in float16 (a power
    of two times d) and gives the very same fp32 value, so both 4-bit types share one kernel.
    """
    block_bytes, has_min, four_bit = _GGUF_BLOCKS[qtype]
    n, k = shape
    blocks = np.ascontiguousarray(raw).view(np.uint8).reshape(n, k // QBLOCK, block_bytes)
    scales = torch.from_numpy(blocks[..., 0:2].copy().view(np.float16).reshape(n, -1))
    header = 4 if has_min else 2
    codes = torch.from_numpy(blocks[..., header:].copy().reshape(n, -1))
    if not four_bit:
        codes = codes.view(torch.int8)
    if has_min:
        mins = torch.from_numpy(blocks[..., 2:4].copy().view(np.float16).reshape(n, -1))
    elif four_bit:
        mins = scales * -8.0
    else:
        mins = None
    return QuantizedWeight(qtype, codes, scales, mins)
