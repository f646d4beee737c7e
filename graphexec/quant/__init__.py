"""Native block-quantized weights: formats (GGUF blocks -> packed arrays, or GGUF's own block
bytes for K-quants and 5-bit types), the ops that read them, and the modules a model swaps in for
its linears and embedding."""

from graphexec.quant.block_layers import BlockEmbedding, BlockLinear
from graphexec.quant.formats import SUPPORTED_GGUF_TYPES, QuantizedWeight, StackedQuantized, concat_rows, from_gguf_blocks
from graphexec.quant.kquants import BLOCK_GGUF_TYPES, BlockWeight, StackedBlocks, block_elements
from graphexec.quant.layers import QuantEmbedding, QuantLinear
from graphexec.quant.ops import dequantize_reference, ensure_kernels
from graphexec.quant.row_parts import (
    EMBEDDINGS,
    PACKED_MODULES,
    PACKED_WEIGHTS,
    PartsLinear,
    RowParts,
    Weight,
    fuse_rows,
    packed_embedding,
    packed_linear,
)

# Every GGUF type `model.weights=native` keeps packed.
NATIVE_GGUF_TYPES = SUPPORTED_GGUF_TYPES + BLOCK_GGUF_TYPES
# A mixture's experts of one projection, stacked, in either packed form.
STACKED_WEIGHTS = (StackedBlocks, StackedQuantized)

__all__ = [
    "BLOCK_GGUF_TYPES",
    "BlockEmbedding",
    "BlockLinear",
    "BlockWeight",
    "EMBEDDINGS",
    "NATIVE_GGUF_TYPES",
    "PACKED_MODULES",
    "PACKED_WEIGHTS",
    "PartsLinear",
    "QuantEmbedding",
    "QuantLinear",
    "QuantizedWeight",
    "RowParts",
    "STACKED_WEIGHTS",
    "SUPPORTED_GGUF_TYPES",
    "StackedBlocks",
    "StackedQuantized",
    "Weight",
    "block_elements",
    "concat_rows",
    "dequantize_reference",
    "ensure_kernels",
    "from_gguf_blocks",
    "fuse_rows",
    "packed_embedding",
    "packed_linear",
]
