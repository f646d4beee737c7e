"""Modules that hold a QuantizedWeight and read it through graphexec::qlinear / qdequantize.

The packed arrays are buffers (they move with `.to(device)`), never parameters: `Module.to(dtype)`
would cast the float16 scales, so the runner moves quantized modules by device only.  Which op a
module calls (`activations`: float -> qlinear, q8 -> qlinear_q8) is fixed when it is built, so a
captured graph holds that op and nothing decides per call.  Under q8 the arrays are held in
qlinear_q8's layout, rows interleaved in groups of 16 (repack.py), and nowhere else.
"""

from __future__ import annotations

import torch
from torch import nn

from graphexec.quant.formats import QuantizedWeight
from graphexec.quant.repack import GROUP, Rows16, repack_rows16


ACTIVATION_MODES = ("float", "q8")


class _Packed(nn.Module):
    """`weight` row-major (a QuantizedWeight), or already interleaved (Rows16, q8 only: how a
    GGUF block weight arrives, repack.block_rows16)."""

    def __init__(self, weight: QuantizedWeight | Rows16, activations: str):
        super().__init__()
        if activations not in ACTIVATION_MODES:
            raise ValueError(f"activations must be one of {list(ACTIVATION_MODES)}, got {activations!r}")
        if isinstance(weight, Rows16) and activations != "q8":
            raise ValueError(f"an interleaved {weight.qtype} weight is read by qlinear_q8 only (activations=q8)")
        self.qtype = weight.qtype
        self.activations = activations
        self.rows = weight.shape[0]
        arrays = repack_rows16(weight) if activations == "q8" and isinstance(weight, QuantizedWeight) else weight
        self.register_buffer("codes", arrays.codes)
        self.register_buffer("scales", arrays.scales)
        self.register_buffer("mins", arrays.mins)

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W.T for x [..., K]: one opaque op, whatever capture does around it."""
        if self.activations == "q8":
            return torch.ops.graphexec.qlinear_q8(x, self.codes, self.scales, self.mins, self.rows)
        return torch.ops.graphexec.qlinear(x, self.codes, self.scales, self.mins)

    def row_arrays(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """codes, scales and mins of the given weight rows, in GGUF's row-major form."""
        if self.activations != "q8":
            mins = None if self.mins is None else self.mins.index_select(0, rows)
            return self.codes.index_select(0, rows), self.scales.index_select(0, rows), mins
        # Row r of the interleaved layout is lane r % 16 of group r // 16 (repack.py).
        group, lane = torch.div(rows, GROUP, rounding_mode="floor"), rows % GROUP
        codes = self.codes.permute(0, 3, 1, 2, 4)[group, lane].reshape(rows.shape[0], -1)
        scales = self.scales.permute(0, 2, 1)[group, lane]
        return codes, scales, None if self.mins is None else self.mins.permute(0, 2, 1)[group, lane]


class QuantLinear(_Packed):
    def __init__(self, weight: QuantizedWeight | Rows16, bias: torch.Tensor | None = None, activations: str = "float"):
        super().__init__(weight, activations)
        self.out_features, self.in_features = weight.shape
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.project(x)
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, qtype={self.qtype}, activations={self.activations}, bias={self.bias is not None}"


class QuantEmbedding(_Packed):
    """Token embedding rows dequantized on lookup; `project` makes it the tied LM head too."""

    def __init__(self, weight: QuantizedWeight, dtype: torch.dtype, activations: str = "float"):
        super().__init__(weight, activations)
        self.num_embeddings, self.embedding_dim = weight.shape
        self.dtype = dtype

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        codes, scales, mins = self.row_arrays(input_ids.reshape(-1))
        out = torch.ops.graphexec.qdequantize(codes, scales, mins, self.dtype)
        return out.view(*input_ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, qtype={self.qtype}, activations={self.activations}"
