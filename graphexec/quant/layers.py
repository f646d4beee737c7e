"""Modules that hold a QuantizedWeight and read it through graphexec::qlinear / qdequantize.

The packed arrays are buffers (they move with `.to(device)`), never parameters: `Module.to(dtype)`
would cast the float16 scales, so the runner moves quantized modules by device only.
"""

from __future__ import annotations

import torch
from torch import nn

from graphexec.quant.formats import QuantizedWeight


class _Packed(nn.Module):
    def __init__(self, weight: QuantizedWeight):
        super().__init__()
        self.qtype = weight.qtype
        self.register_buffer("codes", weight.codes)
        self.register_buffer("scales", weight.scales)
        self.register_buffer("mins", weight.mins)

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W.T for x [..., K]: one opaque op, whatever capture does around it."""
        return torch.ops.graphexec.qlinear(x, self.codes, self.scales, self.mins)


class QuantLinear(_Packed):
    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None = None):
        super().__init__(weight)
        self.out_features, self.in_features = weight.shape
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.project(x)
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, qtype={self.qtype}, bias={self.bias is not None}"


class QuantEmbedding(_Packed):
    """Token embedding rows dequantized on lookup; `project` makes it the tied LM head too."""

    def __init__(self, weight: QuantizedWeight, dtype: torch.dtype):
        super().__init__(weight)
        self.num_embeddings, self.embedding_dim = weight.shape
        self.dtype = dtype

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows = input_ids.reshape(-1)
        mins = None if self.mins is None else self.mins.index_select(0, rows)
        codes, scales = self.codes.index_select(0, rows), self.scales.index_select(0, rows)
        out = torch.ops.graphexec.qdequantize(codes, scales, mins, self.dtype)
        return out.view(*input_ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, qtype={self.qtype}"
