"""Modules that hold a BlockWeight (GGUF K-quant / 5-bit bytes) and read it through
graphexec::qlinear_blocks / qdequantize_blocks (graphexec/quant/kquants.py).

The bytes are a buffer (it moves with `.to(device)`), never a parameter, like QuantLinear's arrays.
"""

from __future__ import annotations

import torch
from torch import nn

from graphexec.quant.kquants import BlockWeight


class _Blocks(nn.Module):
    def __init__(self, weight: BlockWeight):
        super().__init__()
        self.qtype = weight.qtype
        self.type_id = weight.format.type_id  # a plain int: a constant to Dynamo
        self.register_buffer("blocks", weight.blocks)

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W.T for x [..., K]: one opaque op, whatever capture does around it."""
        return torch.ops.graphexec.qlinear_blocks(x, self.blocks, self.type_id)


class BlockLinear(_Blocks):
    def __init__(self, weight: BlockWeight, bias: torch.Tensor | None = None):
        super().__init__(weight)
        self.out_features, self.in_features = weight.shape
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.project(x)
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, qtype={self.qtype}, bias={self.bias is not None}"


class BlockEmbedding(_Blocks):
    """Token embedding rows dequantized on lookup; `project` makes it the tied LM head too."""

    def __init__(self, weight: BlockWeight, dtype: torch.dtype):
        super().__init__(weight)
        self.num_embeddings, self.embedding_dim = weight.shape
        self.dtype = dtype

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows = self.blocks.index_select(0, input_ids.reshape(-1))
        out = torch.ops.graphexec.qdequantize_blocks(rows, self.type_id, self.dtype)
        return out.view(*input_ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, qtype={self.qtype}"
