"""One fused linear (q/k/v, gate/up) from parts stored in different formats, and the module factory
for every weight kind graphexec keeps packed.

llama.cpp's mixed quantizations (Q4_K_M, Q5_K_M) give attn_v a wider type than attn_q/attn_k in
some layers, and ffn_gate/ffn_up may differ too.  Parts that can share one weight are still
concatenated row-wise into it (one op reads all of them); where formats differ, `fuse_rows`
keeps a `RowParts` and `PartsLinear` runs each group's op and concatenates the outputs along the
last dimension: the same numbers as separate linears, which is what they are.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn

from graphexec.errors import CheckpointError
from graphexec.quant.block_layers import BlockEmbedding, BlockLinear
from graphexec.quant.formats import QuantizedWeight, concat_rows
from graphexec.quant.kquants import BlockWeight, concat_blocks
from graphexec.quant.layers import QuantEmbedding, QuantLinear
from graphexec.quant.repack import block_rows16

# A weight as a loader hands one over: dense, packed arrays, or GGUF block bytes.
Weight = torch.Tensor | QuantizedWeight | BlockWeight


@dataclass(frozen=True, eq=False)
class RowParts:
    """A [sum of rows, K] weight as consecutive row groups, each in one format."""

    parts: tuple[Weight, ...]

    @property
    def shape(self) -> tuple[int, int]:
        return (sum(p.shape[0] for p in self.parts), self.parts[0].shape[1])

    @property
    def qtype(self) -> str:
        return "+".join("dense" if isinstance(p, torch.Tensor) else p.qtype for p in self.parts)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.cat([p.to(dtype) if isinstance(p, torch.Tensor) else p.dequantize(dtype) for p in self.parts])


def _kind(part: Weight) -> tuple:
    """Parts of equal kind concatenate row-wise into one weight of that kind."""
    if isinstance(part, QuantizedWeight):
        return ("packed", part.four_bit, part.mins is not None)
    if isinstance(part, BlockWeight):
        return (part.qtype,)
    return ("dense",)


def _concat(group: list[Weight], name: str) -> Weight:
    if len(group) == 1:
        return group[0]
    if isinstance(group[0], QuantizedWeight):
        return concat_rows(group, name)
    if isinstance(group[0], BlockWeight):
        return concat_blocks(group)
    return torch.cat(group)


def fuse_rows(parts: Sequence[Weight], name: str) -> Weight | RowParts:
    """parts stacked along N: one weight where their formats allow, else a RowParts of the runs
    of consecutive same-format parts.  Raises only when the parts take different input sizes."""
    if len({p.shape[1] for p in parts}) != 1:
        sizes = ", ".join(str(p.shape[1]) for p in parts)
        raise CheckpointError(f"{name}: the fused parts take different input sizes ({sizes}); the checkpoint is malformed")
    groups: list[list[Weight]] = []
    for part in parts:
        if groups and _kind(groups[-1][0]) == _kind(part):
            groups[-1].append(part)
        else:
            groups.append([part])
    fused = [_concat(group, name) for group in groups]
    return fused[0] if len(fused) == 1 else RowParts(tuple(fused))


class _DenseRows(nn.Module):
    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight)


class PartsLinear(nn.Module):
    """x @ W.T for a RowParts W: each part's own linear, outputs concatenated, then the bias."""

    def __init__(self, weight: RowParts, bias: torch.Tensor | None, dtype: torch.dtype, activations: str = "float"):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.qtype = weight.qtype
        self.parts = nn.ModuleList(
            _DenseRows(p.to(dtype)) if isinstance(p, torch.Tensor) else packed_linear(p, None, dtype, activations)
            for p in weight.parts
        )
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.cat([part(x) for part in self.parts], dim=-1)
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, qtype={self.qtype}, bias={self.bias is not None}"


PACKED_WEIGHTS = (QuantizedWeight, BlockWeight, RowParts)
PACKED_MODULES = (QuantLinear, QuantEmbedding, BlockLinear, BlockEmbedding, PartsLinear)
EMBEDDINGS = (QuantEmbedding, BlockEmbedding)  # each has `project`: the tied LM head


def packed_linear(
    weight: QuantizedWeight | BlockWeight | RowParts, bias: torch.Tensor | None, dtype: torch.dtype, activations: str = "float"
) -> nn.Module:
    """The module that reads `weight` as a linear; `bias` (if any) already in `dtype`.  Under
    q8 a GGUF block weight (K-quant, 5-bit) is converted to qlinear_q8's layout
    (repack.block_rows16); with float activations it keeps the file's bytes."""
    if isinstance(weight, QuantizedWeight):
        return QuantLinear(weight, bias, activations)
    if isinstance(weight, BlockWeight):
        if activations == "q8":
            return QuantLinear(block_rows16(weight), bias, activations)
        return BlockLinear(weight, bias)
    return PartsLinear(weight, bias, dtype, activations)


def packed_embedding(weight: QuantizedWeight | BlockWeight, dtype: torch.dtype, activations: str = "float") -> nn.Module:
    if isinstance(weight, QuantizedWeight):
        return QuantEmbedding(weight, dtype, activations)
    if isinstance(weight, BlockWeight):
        # TODO(issue 23): under q8 a K-quant token embedding (Q6_K in Q4_K_M files whose width
        # divides into 256, e.g. Llama 3.2) keeps float activations as the tied LM head: its rows
        # are looked up from the file's bytes, and holding block_rows16's copy beside them would
        # double its memory; a row lookup over the interleaved layout would serve both.
        return BlockEmbedding(weight, dtype)
    raise CheckpointError(f"an embedding cannot be made of row parts in different formats ({weight.qtype})")
