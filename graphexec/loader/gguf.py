"""Load a llama.cpp GGUF file (Llama or Qwen2) into Hugging Face-named tensors.

`weights="native"` keeps Q4_0 / Q4_1 / Q8_0 tensors block-quantized (graphexec.quant); every other
tensor type is dequantized to float only under `weights="dequantize"` (the fp32 reference path).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from graphexec.errors import CheckpointError
from graphexec.loader.checkpoint import LoadedCheckpoint, check_state_dict
from graphexec.loader.gguf_file import GGUFFile, GGUFTensor, read_gguf
from graphexec.models.config import ModelConfig
from graphexec.models.sharding import Cut, check_block_cut, cut_for
from graphexec.models.tp_layout import TPLayout
from graphexec.quant import SUPPORTED_GGUF_TYPES, QuantizedWeight, from_gguf_blocks
from graphexec.quant.ops import QBLOCK
from graphexec.text.tokenizer import Tokenizer

SUPPORTED_ARCHITECTURES = ("llama", "qwen2")
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
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def hf_tensor_name(gguf_name: str) -> str | None:
    """The Hugging Face name of a GGUF tensor, or None for tensors a plain causal LM cannot use."""
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    match = _BLOCK_NAME.fullmatch(gguf_name)
    if match is None or match[2] not in _BLOCK_TENSORS:
        return None
    return f"model.layers.{match[1]}.{_BLOCK_TENSORS[match[2]]}.{match[3]}"


def unpermute_rotary_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation, back to Hugging Face's rotate-half layout.

    llama.cpp's converter interleaves each head's two rotary halves (row r of the first half and row r of
    the second half become rows 2r and 2r+1) because its RoPE rotates adjacent pairs.  Works for the
    [rows, in] weight and the [rows] bias alike.
    """
    head_dim = weight.shape[0] // num_heads
    pairs = weight.reshape(num_heads, head_dim // 2, 2, *weight.shape[1:])
    return pairs.transpose(1, 2).reshape(weight.shape).contiguous()


def _float32(value: Any) -> float:
    """GGUF stores floats as float32; keep the shortest spelling (1e-05, not 9.999999747378752e-06)."""
    return float(str(np.float32(value)))


def _config_from_metadata(metadata: dict[str, Any], tensor_names: set[str], name: str, path: Path) -> ModelConfig:
    arch = metadata.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise CheckpointError(f"{path}: GGUF architecture {arch!r} is not supported (only {SUPPORTED_ARCHITECTURES})")

    def field(key: str, default: Any = None) -> Any:
        value = metadata.get(f"{arch}.{key}", default)
        if value is None:
            raise CheckpointError(f"{path}: GGUF metadata lacks {arch}.{key}")
        return value

    scaling = metadata.get(f"{arch}.rope.scaling.type", "none")
    if scaling not in ("none", None) or "rope_freqs.weight" in tensor_names:
        raise CheckpointError(f"{path}: RoPE scaling ({scaling}) is not supported")
    hidden, heads = int(field("embedding_length")), int(field("attention.head_count"))
    head_dim = int(field("attention.key_length", hidden // heads))
    if int(field("rope.dimension_count", head_dim)) != head_dim:
        raise CheckpointError(f"{path}: partial rotary embeddings are not supported")
    tokens = metadata.get("tokenizer.ggml.tokens")
    has_bias = "blk.0.attn_q.bias" in tensor_names
    eos_ids = [
        int(metadata[key])
        for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
        if metadata.get(key) is not None
    ]
    bos = metadata.get("tokenizer.ggml.bos_token_id")
    return ModelConfig(
        name=name,
        architecture="qwen2" if has_bias else "llama",
        vocab_size=int(field("vocab_size", len(tokens) if tokens is not None else None)),
        hidden_size=hidden,
        intermediate_size=int(field("feed_forward_length")),
        num_layers=int(field("block_count")),
        num_heads=heads,
        num_kv_heads=int(field("attention.head_count_kv", heads)),
        head_dim=head_dim,
        rms_norm_eps=_float32(field("attention.layer_norm_rms_epsilon")),
        rope_theta=_float32(field("rope.freq_base", 10000.0)),
        max_context=int(field("context_length")),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias=has_bias,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=tuple(dict.fromkeys(eos_ids)),
    )


def _state_dict(file: GGUFFile, config: ModelConfig, gguf_arch: str, dtype: torch.dtype, weights: str, path: Path,
                layout: TPLayout):
    state_dict: dict[str, torch.Tensor | QuantizedWeight] = {}
    for tensor in file.tensors:
        hf_name = hf_tensor_name(tensor.name)
        if hf_name is None:
            raise CheckpointError(f"{path}: tensor {tensor.name!r} has no place in a {gguf_arch} causal LM")
        shape, qtype = tensor.shape, tensor.qtype.name
        cut = cut_for(hf_name, layout)
        if weights == "native" and qtype in SUPPORTED_GGUF_TYPES:
            raw, part_shape = _cut_blocks(hf_name, tensor.data, qtype, shape, cut)
            weight: torch.Tensor | QuantizedWeight = from_gguf_blocks(raw, qtype, part_shape)
        elif weights == "native" and qtype not in _DENSE_TYPES:
            raise CheckpointError(
                f"{path}: tensor {tensor.name} is {qtype}, which model.weights=native cannot keep quantized "
                f"(supported: {', '.join(SUPPORTED_GGUF_TYPES)}); load it with model.weights=dequantize"
            )
        else:
            weight = _dequantized(tensor, shape, path, cut).to(dtype)
        # Only llama-arch files were permuted by the converter; Qwen2 files keep HF's layout.  The
        # permutation is within a head, so a rank's whole heads unpermute on their own.
        if gguf_arch == "llama" and hf_name.split(".")[-2] in ("q_proj", "k_proj"):
            weight = _unpermute(weight, weight.shape[0] // config.head_dim)
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
    blocks = rows.reshape(shape[0], shape[1] // QBLOCK, -1)
    return blocks[:, cut.start // QBLOCK : cut.stop // QBLOCK], cut.shape(shape)


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


def _unpermute(weight: torch.Tensor | QuantizedWeight, num_heads: int) -> torch.Tensor | QuantizedWeight:
    # Blocks run along the input dimension, so a quantized weight's rows permute like a dense one's.
    if isinstance(weight, QuantizedWeight):
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
    config = _config_from_metadata(metadata, tensor_names, name, path)
    layout = TPLayout.build(config, tp_size, tp_rank)
    state_dict = _state_dict(file, config, metadata["general.architecture"], dtype, weights, path, layout)
    check_state_dict(config, state_dict, path, layout)
    tokenizer = Tokenizer.from_gguf(metadata) if "tokenizer.ggml.tokens" in metadata else None
    return LoadedCheckpoint(config=config, state_dict=state_dict, tokenizer=tokenizer, tp_shard=(tp_size, tp_rank))
