"""A GGUF file's metadata (and its RoPE factor tensors) read into a ModelConfig.

Families by llama.cpp architecture name: `llama` (also what llama.cpp's converter writes for
Mistral 7B; Llama 3's RoPE scaling arrives as the rope_freqs tensor of per-pair divisors),
`qwen2`, `qwen3` (attn_q_norm / attn_k_norm), `phi3` (fused attn_qkv and ffn_up, LongRoPE as
rope_factors_short / rope_factors_long), `gemma`, `gemma2` and `gemma3` (llama.cpp's hard-coded choices:
sliding layers alternate (Gemma 2) or five of every six slide (Gemma 3), the attention scale is
head_dim's except for the 27B shapes, Gemma 3's sliding layers rotate at base 10000).
`<arch>.attention.sliding_window` is the window (shorter than the context: sliding-window
attention) of every layer, or of Gemma's sliding layers.  Everything else is refused by name.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable

import numpy as np

from graphexec.errors import CheckpointError
from graphexec.models.config import ModelConfig, RopeScaling

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "phi3", "gemma", "gemma2", "gemma3", "qwen2moe", "qwen3moe")
# GGUF architecture -> ModelConfig.architecture where they differ (a llama file with experts: Mixtral).
_FAMILY = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe"}
# llama.cpp's default for renormalising the top-k expert weights, where a file does not say.
_NORM_TOPK = {"llama": True, "qwen2moe": False, "qwen3moe": True}
GEMMA_ARCHITECTURES = ("gemma", "gemma2", "gemma3")
# llama.cpp's Gemma layer patterns: layer i slides iff i % n < n - 1.
_SWA_PATTERN = {"gemma2": 2, "gemma3": 6}
# The 27B shapes (by layer count, as llama.cpp tells them) scale attention by hidden / heads.
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
# Tensors that configure RoPE instead of holding weights.
ROPE_TENSORS = ("rope_freqs.weight", "rope_factors_short.weight", "rope_factors_long.weight")


def float32(value: Any) -> float:
    """GGUF stores floats as float32; keep the shortest spelling (1e-05, not 9.999999747378752e-06)."""
    return float(str(np.float32(value)))


def _rope(arch: str, field: Callable, metadata: dict, rope_tensors: dict, context: int, path: Path):
    """(scaling, max_context); LongRoPE caps the context at its original length (graphexec/models/rope.py)."""
    kind = metadata.get(f"{arch}.rope.scaling.type", "none")
    original = int(metadata.get(f"{arch}.rope.scaling.original_context_length", context))
    attn = metadata.get(f"{arch}.rope.scaling.attn_factor")
    attn = None if attn is None else float32(attn)
    if "rope_factors_short.weight" in rope_tensors:
        short = tuple(float(v) for v in rope_tensors["rope_factors_short.weight"])
        long = rope_tensors.get("rope_factors_long.weight")
        scaling = RopeScaling("longrope", None, original, context, attention_factor=attn, short_factor=short,
                              long_factor=None if long is None else tuple(float(v) for v in long))
        return scaling, min(context, original)
    if "rope_freqs.weight" in rope_tensors:
        if kind not in ("none", None):
            raise CheckpointError(f"{path}: both rope_freqs and RoPE scaling {kind!r} are set")
        return RopeScaling("factors", short_factor=tuple(float(v) for v in rope_tensors["rope_freqs.weight"])), context
    if kind in ("none", None):
        return None, context
    factor = float32(field("rope.scaling.factor"))
    if kind == "linear":
        return RopeScaling("linear", factor), context
    if kind == "yarn":
        beta_fast = metadata.get(f"{arch}.rope.scaling.yarn_beta_fast", 32.0)
        beta_slow = metadata.get(f"{arch}.rope.scaling.yarn_beta_slow", 1.0)
        # llama.cpp's attn_factor multiplies YaRN's own magnitude correction (ggml's rope_yarn),
        # which transformers computes as 0.1 ln(factor) + 1; the product is the cos/sin factor.
        yarn_mscale = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0
        scaling = RopeScaling("yarn", factor, original, context, beta_fast=float32(beta_fast),
                              beta_slow=float32(beta_slow), attention_factor=None if attn is None else attn * yarn_mscale)
        return scaling, context
    raise CheckpointError(f"{path}: RoPE scaling {kind!r} ({arch}.rope.scaling.type) is not supported")


def _sliding_layers(arch: str, metadata: dict, layers: int) -> tuple[bool, ...] | None:
    pattern = metadata.get(f"{arch}.attention.sliding_window_pattern", _SWA_PATTERN.get(arch))
    if pattern is None:
        return None
    if isinstance(pattern, (list, tuple)):  # one flag per layer, where a file spells it out
        return tuple(bool(p) for p in pattern)
    n = int(pattern)
    return tuple(i % n < n - 1 for i in range(layers))


def _gemma_fields(arch: str, metadata: dict, hidden: int, heads: int, head_dim: int, layers: int) -> dict[str, Any]:
    """ModelConfig's Gemma switches for a GGUF file (none for other families)."""
    if arch not in GEMMA_ARCHITECTURES:
        return {}

    def optional(key: str) -> float | None:
        value = metadata.get(f"{arch}.{key}")
        return None if value is None else float32(value)

    big = layers == _GEMMA_27B_LAYERS.get(arch)
    return dict(
        norm_unit_offset=True,
        sandwich_norms=arch != "gemma",
        hidden_act="gelu_tanh",
        embed_scale=hidden**0.5,
        query_pre_attn_scalar=float(hidden // heads if big else head_dim),
        attn_logit_softcap=optional("attn_logit_softcapping"),
        final_logit_softcap=optional("final_logit_softcapping"),
        local_rope_theta=float32(metadata.get(f"{arch}.rope.freq_base_swa", 10000.0)) if arch == "gemma3" else None,
    )


def _expert_fields(arch: str, metadata: dict, field: Callable, layers: int) -> dict[str, Any]:
    """ModelConfig's mixture-of-experts fields (none without `<arch>.expert_count`)."""
    count = int(metadata.get(f"{arch}.expert_count") or 0)
    if not count:
        return {}
    if arch not in _NORM_TOPK:
        raise CheckpointError(f"mixture-of-experts {arch} files are not supported (only {sorted(_NORM_TOPK)})")
    dense = int(metadata.get(f"{arch}.leading_dense_block_count", 0))
    return dict(
        num_experts=count,
        num_experts_per_tok=int(field("expert_used_count")),
        moe_intermediate_size=int(metadata.get(f"{arch}.expert_feed_forward_length") or field("feed_forward_length")),
        norm_topk_prob=bool(metadata.get(f"{arch}.expert_weights_norm", _NORM_TOPK[arch])),
        shared_expert_intermediate_size=int(metadata.get(f"{arch}.expert_shared_feed_forward_length", 0)),
        sparse_layers=tuple(i >= dense for i in range(layers)) if dense else None,
    )


def config_from_metadata(metadata: dict[str, Any], tensor_names: set[str], rope_tensors: dict, name: str,
                         path: Path) -> ModelConfig:
    arch = metadata.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise CheckpointError(f"{path}: GGUF architecture {arch!r} is not supported (only {SUPPORTED_ARCHITECTURES})")

    def field(key: str, default: Any = None) -> Any:
        value = metadata.get(f"{arch}.{key}", default)
        if value is None:
            raise CheckpointError(f"{path}: GGUF metadata lacks {arch}.{key}")
        return value

    context = int(field("context_length"))
    scaling, max_context = _rope(arch, field, metadata, rope_tensors, context, path)
    window = metadata.get(f"{arch}.attention.sliding_window")
    if window is not None and int(window) < 1:
        raise CheckpointError(f"{path}: {arch}.attention.sliding_window={window} must be at least 1")
    window = None if window is None or int(window) >= max_context else int(window)
    hidden, heads = int(field("embedding_length")), int(field("attention.head_count"))
    head_dim = int(field("attention.key_length", hidden // heads))
    layers = int(field("block_count"))
    tokens = metadata.get("tokenizer.ggml.tokens")
    has_bias = "blk.0.attn_q.bias" in tensor_names
    if "blk.0.attn_qkv.bias" in tensor_names:
        # Only separate q/k/v biases are read (Qwen2's; llama-arch files with them load as before).
        raise CheckpointError(f"{path}: a fused attn_qkv with a bias (blk.N.attn_qkv.bias) is not supported")
    eos_ids = [
        int(metadata[key])
        for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
        if metadata.get(key) is not None
    ]
    bos = metadata.get("tokenizer.ggml.bos_token_id")
    experts = _expert_fields(arch, metadata, field, layers)
    family = "mixtral" if arch == "llama" and experts else _FAMILY.get(arch, arch)
    return ModelConfig(
        name=name,
        architecture=family,
        vocab_size=int(field("vocab_size", len(tokens) if tokens is not None else None)),
        hidden_size=hidden,
        intermediate_size=int(field("feed_forward_length")),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(field("attention.head_count_kv", heads)),
        head_dim=head_dim,
        rms_norm_eps=float32(field("attention.layer_norm_rms_epsilon")),
        rope_theta=float32(field("rope.freq_base", 10000.0)),
        max_context=max_context,
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias=has_bias,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=tuple(dict.fromkeys(eos_ids)),
        qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
        rotary_dim=int(field("rope.dimension_count", head_dim)),
        rope_scaling=scaling,
        sliding_window=window,
        sliding_layers=_sliding_layers(arch, metadata, layers),
        **_gemma_fields(arch, metadata, hidden, heads, head_dim, layers),
        **experts,
    )
