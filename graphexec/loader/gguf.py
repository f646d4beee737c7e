"""Load a llama.cpp GGUF file (Llama, Mistral, Qwen2, Qwen3, Phi-3, Gemma 1, 2 and 3, Mixtral,
Qwen2-MoE, Qwen3-MoE: graphexec/loader/gguf_config.py) into Hugging Face-named tensors.

`weights="native"` keeps Q4_0 / Q4_1 / Q8_0 tensors block-quantized (graphexec.quant's packed
arrays) and Q4_K / Q5_K / Q6_K / Q5_0 / Q5_1 tensors as the file's own block bytes (BlockWeight):
every type a Q4_K_M / Q5_K_M / Q6_K file holds.  A mixture's stacked experts stay packed too
(StackedQuantized, StackedBlocks).  Any other quantized type is dequantized to float only under
`weights="dequantize"` (the fp32 reference path).
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch

from graphexec.errors import CheckpointError
from graphexec.loader.checkpoint import LoadedCheckpoint, check_state_dict
from graphexec.loader.fused import is_fused, split_fused
from graphexec.loader.gguf_config import GEMMA_ARCHITECTURES, ROPE_TENSORS, config_from_metadata
from graphexec.loader.gguf_file import GGUFFile, GGUFTensor, read_gguf
from graphexec.models.config import ModelConfig
from graphexec.models.sharding import Cut, check_block_cut, cut_for, cut_weight
from graphexec.models.tp_layout import TPLayout
from graphexec.quant import (
    BLOCK_GGUF_TYPES,
    NATIVE_GGUF_TYPES,
    SUPPORTED_GGUF_TYPES,
    BlockWeight,
    QuantizedWeight,
    StackedBlocks,
    StackedQuantized,
    Weight,
    block_elements,
    from_gguf_blocks,
)
from graphexec.text.tokenizer import Tokenizer

WEIGHT_MODES = ("native", "dequantize")
_DENSE_TYPES = ("F32", "F16", "BF16", "F64")

_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_qkv": "self_attn.qkv_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    # Mixtures of experts: the router, the stacked experts, the shared expert and its gate.
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
# Gemma 2 / 3's four norms a layer: llama.cpp's ffn_norm is the MLP's input norm, as Llama's is,
# but their Hugging Face names call that one pre_feedforward_layernorm.
_GEMMA_BLOCK_TENSORS = {
    **_BLOCK_TENSORS,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_BLOCK_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def hf_tensor_name(gguf_name: str, arch: str = "llama") -> str | None:
    """The Hugging Face name of a GGUF tensor, or None for tensors a plain causal LM cannot use."""
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    match = _BLOCK_NAME.fullmatch(gguf_name)
    names = _GEMMA_BLOCK_TENSORS if arch in ("gemma2", "gemma3") else _BLOCK_TENSORS
    if match is None or match[2] not in names:
        return None
    # Phi-3 has no ffn_gate: its ffn_up holds gate and up stacked, as HF's gate_up_proj.
    module = "mlp.gate_up_proj" if (arch, match[2]) == ("phi3", "ffn_up") else names[match[2]]
    return f"model.layers.{match[1]}.{module}.{match[3]}"


def unpermute_rotary_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation, back to Hugging Face's rotate-half layout.

    llama.cpp's converter interleaves each head's two rotary halves (row r of the first half and row r of
    the second half become rows 2r and 2r+1) because its RoPE rotates adjacent pairs.  Works for the
    [rows, in] weight and the [rows] bias alike.
    """
    head_dim = weight.shape[0] // num_heads
    pairs = weight.reshape(num_heads, head_dim // 2, 2, *weight.shape[1:])
    return pairs.transpose(1, 2).reshape(weight.shape).contiguous()


def _state_dict(file: GGUFFile, config: ModelConfig, gguf_arch: str, dtype: torch.dtype, weights: str, path: Path,
                layout: TPLayout):
    state_dict: dict[str, Weight] = {}
    for tensor in file.tensors:
        if tensor.name in ROPE_TENSORS:
            continue  # read into the config (gguf_config.py)
        hf_name = hf_tensor_name(tensor.name, gguf_arch)
        if hf_name is None:
            raise CheckpointError(f"{path}: tensor {tensor.name!r} has no place in a {gguf_arch} causal LM")
        shape, qtype = tensor.shape, tensor.qtype.name
        # A fused tensor is read whole, split per projection, then each part cut.
        fused = is_fused(hf_name)
        experts = len(shape) == 3  # a mixture's stacked experts: read whole, cut once built
        cut = None if fused or experts else cut_for(hf_name, layout)
        weight: Weight
        if weights == "native" and experts and qtype in NATIVE_GGUF_TYPES:
            # Kept packed; the experts op reads only the routed experts' rows.
            stacked = StackedBlocks if qtype in BLOCK_GGUF_TYPES else StackedQuantized
            weight = stacked.from_gguf(tensor.data, qtype, shape)
        elif weights == "native" and qtype in NATIVE_GGUF_TYPES and not experts:
            raw, part_shape = _cut_blocks(hf_name, tensor.data, qtype, shape, cut)
            if qtype in SUPPORTED_GGUF_TYPES:
                weight = from_gguf_blocks(raw, qtype, part_shape)
            else:
                weight = BlockWeight.from_gguf(raw, qtype, part_shape)
        elif weights == "native" and qtype not in _DENSE_TYPES:
            raise CheckpointError(
                f"{path}: tensor {tensor.name} is {qtype}, which model.weights=native cannot keep quantized "
                f"(supported: {', '.join(NATIVE_GGUF_TYPES)}); load it with model.weights=dequantize"
            )
        else:
            weight = _dequantized(tensor, shape, path, cut)
            if gguf_arch in GEMMA_ARCHITECTURES and hf_name.endswith("norm.weight"):
                # llama.cpp's converter stores Gemma's norm weights plus one (its RMSNorm scales by
                # the weight alone); the model adds the one back (RMSNorm's unit_offset).  In fp32,
                # before any cast, as transformers' GGUF reader does it.
                weight = weight - 1.0
            if hf_name.endswith("shared_expert_gate.weight"):
                weight = weight.reshape(1, -1)  # llama.cpp stores the one-row gate as a vector
            weight = weight.to(dtype)
        # Only llama-arch files were permuted by the converter; Qwen2 files keep HF's layout.  The
        # permutation is within a head, so a rank's whole heads unpermute on their own.
        if gguf_arch == "llama" and hf_name.split(".")[-2] in ("q_proj", "k_proj"):
            weight = _unpermute(weight, weight.shape[0] // config.head_dim)
        if fused:
            for part, whole in split_fused(hf_name, weight, config).items():
                state_dict[part] = cut_weight(part, whole, cut_for(part, layout))
        elif experts:
            state_dict[hf_name] = cut_weight(hf_name, weight, cut_for(hf_name, layout))
        else:
            state_dict[hf_name] = weight
    return state_dict


def _cut_blocks(name: str, raw: np.ndarray, qtype: str, shape: tuple[int, int], cut: Cut | None):
    """The rank's part of a packed tensor, sliced from the (memory-mapped) file's bytes: only
    those bytes are ever read.  Rows are whole rows of blocks; a column cut takes whole blocks."""
    if cut is None:
        return raw, shape
    rows = raw.reshape(shape[0], -1)
    if cut.dim == 0:
        return rows[cut.start : cut.stop], cut.shape(shape)
    check_block_cut(name, cut, qtype)
    block = block_elements(qtype)
    blocks = rows.reshape(shape[0], shape[1] // block, -1)
    return blocks[:, cut.start // block : cut.stop // block], cut.shape(shape)


def _dequantized(tensor: GGUFTensor, shape: tuple[int, ...], path: Path, cut: Cut | None = None) -> torch.Tensor:
    from gguf.quants import dequantize

    raw = tensor.data
    if cut is not None and cut.dim == 0:
        # Rows are independent in every GGUF type: read only this rank's.
        raw, shape = raw.reshape(shape[0], -1)[cut.start : cut.stop], cut.shape(shape)
    try:
        values = dequantize(raw, tensor.qtype)
    except NotImplementedError as error:
        raise CheckpointError(f"{path}: cannot dequantize {tensor.name}: {error}") from error
    # Copies only what is still a read-only view of the file (F32 tensors); dequantized ones are fresh.
    weight = torch.from_numpy(np.require(values, np.float32, ["C", "W"]).reshape(shape))
    if cut is not None and cut.dim == 1:
        # K-quant blocks (256) need not align with the cut: dequantize the tensor, keep the columns.
        weight = weight[:, cut.start : cut.stop].clone()
    return weight


def _unpermute(weight: Weight, num_heads: int) -> Weight:
    # Blocks run along the input dimension, so a quantized weight's rows permute like a dense one's.
    if isinstance(weight, (QuantizedWeight, BlockWeight)):
        return weight.map_rows(lambda rows: unpermute_rotary_rows(rows, num_heads))
    return unpermute_rotary_rows(weight, num_heads)


def load_gguf_tokenizer(path: str | Path) -> Tokenizer:
    """Only the tokenizer of a GGUF file (skips dequantizing the weights)."""
    return Tokenizer.from_gguf(read_gguf(path).metadata)


def load_gguf(
    path: str | Path, name: str, dtype: torch.dtype = torch.float32, weights: str = "dequantize",
    tp_size: int = 1, tp_rank: int = 0,
) -> LoadedCheckpoint:
    """Read and rename a GGUF checkpoint: quantized tensors kept packed (`native`) or as `dtype`;
    with tp_size > 1, only tp_rank's part of each tensor (graphexec/models/sharding.py)."""
    if weights not in WEIGHT_MODES:
        raise CheckpointError(f"model.weights must be one of {list(WEIGHT_MODES)}, got {weights!r}")
    path = Path(path)
    file = read_gguf(path)
    metadata = file.metadata
    tensor_names = {tensor.name for tensor in file.tensors}
    rope_tensors = {t.name: _dequantized(t, t.shape, path).flatten().tolist() for t in file.tensors if t.name in ROPE_TENSORS}
    config = config_from_metadata(metadata, tensor_names, rope_tensors, name, path)
    layout = TPLayout.build(config, tp_size, tp_rank)
    state_dict = _state_dict(file, config, metadata["general.architecture"], dtype, weights, path, layout)
    check_state_dict(config, state_dict, path, layout)
    tokenizer = Tokenizer.from_gguf(metadata) if "tokenizer.ggml.tokens" in metadata else None
    return LoadedCheckpoint(config=config, state_dict=state_dict, tokenizer=tokenizer, tp_shard=(tp_size, tp_rank))
