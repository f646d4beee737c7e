"""Native block-quantized weights: formats (GGUF blocks -> packed arrays), the ops that read them,
and the modules a model swaps in for its linears and embedding."""

from graphexec.quant.formats import SUPPORTED_GGUF_TYPES, QuantizedWeight, concat_rows, from_gguf_blocks
from graphexec.quant.layers import QuantEmbedding, QuantLinear
from graphexec.quant.ops import dequantize_reference, ensure_kernels

__all__ = [
    "QuantEmbedding",
    "QuantLinear",
    "QuantizedWeight",
    "SUPPORTED_GGUF_TYPES",
    "concat_rows",
    "dequantize_reference",
    "ensure_kernels",
    "from_gguf_blocks",
]
