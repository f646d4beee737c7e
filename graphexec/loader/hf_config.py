"""A Hugging Face config.json read into a ModelConfig: which family it is, its RoPE scaling, its
sliding-window layers, its experts, and every feature the engine cannot run refused by name
(other families and mixture-of-experts designs, bidirectional attention).

Both spellings are read: transformers 4 writes rope_theta and rope_scaling at the top level (Gemma
3: rope_local_base_freq for the sliding layers), transformers 5 nests them (and
partial_rotary_factor) in rope_parameters, per layer kind for Gemma 3.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from graphexec.errors import CheckpointError
from graphexec.models.config import ModelConfig, RopeScaling

ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Phi3ForCausalLM": "phi3",
    "GemmaForCausalLM": "gemma",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}
_MODEL_TYPES = {family: family for family in ARCHITECTURES.values()} | {"gemma3_text": "gemma3"}
_GEMMA = ("gemma", "gemma2", "gemma3")
_QWEN = ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe")  # a window only with use_sliding_window
_MOE = ("mixtral", "qwen2_moe", "qwen3_moe")
# hidden_act / hidden_activation spellings -> ModelConfig.hidden_act
_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
# Phi-3's first long-context checkpoints called LongRoPE "su".
_ROPE_ALIASES = {"su": "longrope"}


def _fail(path: Path, message: str) -> CheckpointError:
    return CheckpointError(f"{path}: {message}")


def family(config: dict[str, Any], path: Path) -> str:
    names = config.get("architectures") or ()
    for name in names:
        if name in ARCHITECTURES:
            return ARCHITECTURES[name]
    if not names and config.get("model_type") in _MODEL_TYPES:
        return _MODEL_TYPES[config["model_type"]]
    if any(key in config for key in ("num_experts", "num_local_experts", "n_routed_experts")) or any(
        "Moe" in name for name in names
    ):
        supported = sorted(name for name, arch in ARCHITECTURES.items() if arch in _MOE)
        raise _fail(path, f"mixture-of-experts model {list(names)!r} is not supported; supported: {supported}")
    raise _fail(path, f"unsupported model {list(names) or config.get('model_type')!r}; supported: {sorted(ARCHITECTURES)}")


def layer_kinds(config: dict[str, Any], arch: str, window: int | None) -> tuple[bool, ...] | None:
    """Which layers are sliding-window layers (None: all of them), in transformers' reading:
    `layer_types` when the config has it; else Qwen's max_window_layers (layers below it attend
    fully; 28, transformers' default), Gemma 2's alternation (even layers slide) and Gemma 3's
    sliding_window_pattern (every sixth layer attends fully)."""
    layers = int(config["num_hidden_layers"])
    layer_types = config.get("layer_types")
    if layer_types is None and arch in _QWEN and window is not None:
        first = int(config.get("max_window_layers", 28))
        layer_types = ["full_attention" if i < first else "sliding_attention" for i in range(layers)]
    elif layer_types is None and arch == "gemma2":
        layer_types = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]
    elif layer_types is None and arch == "gemma3":
        pattern = int(config.get("sliding_window_pattern", 6))
        layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
    if layer_types is None:
        return None
    return tuple(kind == "sliding_attention" for kind in layer_types)


def attention_window(config: dict[str, Any], arch: str, max_context: int, path: Path):
    """(window, sliding_layers): the sliding window (None: full attention everywhere) and which
    layers use it (None: every layer), in transformers' reading.  A window at least as long as
    the context is full attention."""
    window = config.get("sliding_window")
    # Mistral, Phi-3 and Gemma have no switch: a window is used when given.  Qwen2/Qwen3 default it off.
    uses_window = bool(config.get("use_sliding_window", arch not in _QWEN))
    if window is None or not uses_window:
        window = None
    layer_types = config.get("layer_types")
    if layer_types is not None:
        kinds = set(layer_types)
        if not kinds <= {"full_attention", "sliding_attention"}:
            raise _fail(path, f"attention layer types {sorted(kinds)} (layer_types) are not supported")
        if len(layer_types) != int(config["num_hidden_layers"]):
            raise _fail(path, f"layer_types names {len(layer_types)} layers, num_hidden_layers is {config['num_hidden_layers']}")
        if "sliding_attention" in kinds and window is None and uses_window:
            raise _fail(path, "layer_types names sliding_attention layers but sliding_window is not set")
    sliding = layer_kinds(config, arch, window)
    if window is not None and int(window) < 1:
        raise _fail(path, f"sliding_window={window} must be at least 1")
    if window is None or int(window) >= max_context or (sliding is not None and not any(sliding)):
        window = None
    return (None if window is None else int(window)), sliding


def local_rope_theta(config: dict[str, Any], arch: str, path: Path) -> float | None:
    """Gemma 3's sliding layers' RoPE base (plain RoPE; the scaling is the full layers')."""
    if arch != "gemma3":
        return None
    local = (config.get("rope_parameters") or {}).get("sliding_attention")
    if local is None:
        return float(config.get("rope_local_base_freq", 10000.0))
    if local.get("rope_type", "default") != "default":
        raise _fail(path, f"RoPE scaling {local['rope_type']!r} on the sliding layers (rope_parameters.sliding_attention) is not supported")
    return float(local.get("rope_theta", 10000.0))


def rope(config: dict[str, Any], path: Path) -> tuple[float, RopeScaling | None, int, float]:
    """(rope_theta, scaling, max_context, partial_rotary_factor).  max_context is capped at the
    original context for the scalings supported only in their static form (rope.py).  Gemma 3's
    per-kind rope_parameters: the full-attention layers' (local_rope_theta reads the others')."""
    parameters = dict(config.get("rope_parameters") or {})
    parameters = dict(parameters.get("full_attention", parameters))
    parameters.update(config.get("rope_scaling") or {})
    theta = float(config.get("rope_theta", parameters.get("rope_theta", 10000.0)))
    partial = float(config.get("partial_rotary_factor", parameters.get("partial_rotary_factor", 1.0)))
    declared = int(config["max_position_embeddings"])
    kind = parameters.get("rope_type", parameters.get("type", "default"))
    kind = _ROPE_ALIASES.get(kind, kind)
    if kind == "default":
        return theta, None, declared, partial
    if kind not in ("llama3", "linear", "dynamic", "yarn", "longrope"):
        raise _fail(path, f"RoPE scaling {kind!r} (rope_parameters.rope_type) is not supported")
    original = parameters.get("original_max_position_embeddings", config.get("original_max_position_embeddings"))
    original = int(original) if original is not None else declared

    def number(key: str, default=None):
        value = parameters.get(key)
        return default if value is None else float(value)

    scaling = RopeScaling(
        kind=kind,
        factor=number("factor"),
        original_max_positions=original,
        declared_max_positions=declared,
        low_freq_factor=number("low_freq_factor", 1.0),
        high_freq_factor=number("high_freq_factor", 4.0),
        beta_fast=number("beta_fast", 32.0),
        beta_slow=number("beta_slow", 1.0),
        truncate=bool(parameters.get("truncate", True)),
        attention_factor=number("attention_factor"),
        mscale=number("mscale"),
        mscale_all_dim=number("mscale_all_dim"),
        short_factor=tuple(float(f) for f in parameters["short_factor"]) if kind == "longrope" else None,
        long_factor=tuple(float(f) for f in parameters["long_factor"]) if kind == "longrope" and parameters.get("long_factor") else None,
    )
    if kind in ("linear", "dynamic", "llama3") and scaling.factor is None:
        raise _fail(path, f"RoPE scaling {kind!r} needs rope_parameters.factor")
    # Static forms only: beyond the original context dynamic NTK and LongRoPE's long factors change.
    capped = min(declared, original) if kind in ("dynamic", "longrope") else declared
    return theta, scaling, capped, partial


def rotary_dim(head_dim: int, partial: float) -> int:
    return int(head_dim * partial)


def unsupported_features(config: dict[str, Any], arch: str, path: Path) -> None:
    """Features ModelConfig cannot express: refuse rather than run a silently different model."""
    if config.get("mlp_bias"):
        raise _fail(path, "checkpoints with MLP biases (mlp_bias) are not supported")
    if arch in ("llama", "mistral", "qwen3", "phi3", "mixtral", "qwen3_moe") and config.get("attention_bias"):
        raise _fail(path, f"{arch} checkpoints with attention projection biases (attention_bias) are not supported")
    if arch in _GEMMA and config.get("attention_bias"):
        raise _fail(path, f"{arch} checkpoints with attention projection biases (attention_bias) are not supported")
    if config.get("use_bidirectional_attention"):
        raise _fail(path, "bidirectional attention (use_bidirectional_attention) is not supported: a causal LM only")
    activation(config, arch, path)


def activation(config: dict[str, Any], arch: str, path: Path) -> str:
    key = "hidden_activation" if config.get("hidden_activation") else "hidden_act"
    name = config.get(key) or "silu"
    if arch in _GEMMA and name == "gelu":
        name = "gelu_pytorch_tanh"  # the first Gemma releases' spelling of it (transformers reads it so)
    if name not in _ACTIVATIONS:
        raise _fail(path, f"activation {name!r} ({key}) is not supported (only {sorted(_ACTIVATIONS)})")
    return _ACTIVATIONS[name]


def experts(config: dict[str, Any], arch: str, path: Path) -> dict[str, Any]:
    """ModelConfig's mixture-of-experts fields (none for a dense family).  Qwen's sparse layers:
    those not in mlp_only_layers whose number (from 1) is a multiple of decoder_sparse_step."""
    if arch not in _MOE:
        return {}
    count = int(config.get("num_experts") or config.get("num_local_experts") or 0)
    if count < 1:
        raise _fail(path, f"a {arch} checkpoint needs num_experts (or num_local_experts) >= 1")
    layers = int(config["num_hidden_layers"])
    sparse = None
    if arch != "mixtral":
        dense, step = set(config.get("mlp_only_layers") or ()), int(config.get("decoder_sparse_step", 1))
        sparse = tuple(i not in dense and (i + 1) % step == 0 for i in range(layers))
    return dict(
        num_experts=count,
        num_experts_per_tok=int(config["num_experts_per_tok"]),
        moe_intermediate_size=int(config["intermediate_size"] if arch == "mixtral" else config["moe_intermediate_size"]),
        norm_topk_prob=True if arch == "mixtral" else bool(config.get("norm_topk_prob", False)),
        shared_expert_intermediate_size=int(config.get("shared_expert_intermediate_size") or 0) if arch == "qwen2_moe" else 0,
        sparse_layers=sparse,
    )


def _optional_float(config: dict[str, Any], key: str) -> float | None:
    value = config.get(key)
    return None if value is None else float(value)


def model_config(config: dict[str, Any], name: str, has_lm_head: bool, eos_ids: list[int], path: Path) -> ModelConfig:
    arch = family(config, path)
    unsupported_features(config, arch, path)
    theta, scaling, max_context, partial = rope(config, path)
    window, sliding_layers = attention_window(config, arch, max_context, path)
    hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    gemma = arch in _GEMMA
    head_dim = int(config.get("head_dim") or hidden // heads)
    bos = config.get("bos_token_id")
    return ModelConfig(
        name=name,
        architecture=arch,
        vocab_size=int(config["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(config["intermediate_size"]),
        num_layers=int(config["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(config.get("num_key_value_heads") or heads),
        head_dim=head_dim,
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        max_context=max_context,
        # Older configs omit the flag; then the files themselves say whether a head is stored.
        tie_word_embeddings=bool(config.get("tie_word_embeddings", not has_lm_head)),
        attention_bias=arch in ("qwen2", "qwen2_moe"),
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=tuple(dict.fromkeys(eos_ids)),
        qk_norm=arch in ("qwen3", "gemma3", "qwen3_moe"),
        rotary_dim=rotary_dim(head_dim, partial),
        rope_scaling=scaling,
        sliding_window=window,
        sliding_layers=sliding_layers,
        norm_unit_offset=gemma,
        sandwich_norms=arch in ("gemma2", "gemma3"),
        hidden_act=activation(config, arch, path),
        embed_scale=hidden**0.5 if gemma else 1.0,
        query_pre_attn_scalar=_optional_float(config, "query_pre_attn_scalar") if gemma else None,
        attn_logit_softcap=_optional_float(config, "attn_logit_softcapping"),
        final_logit_softcap=_optional_float(config, "final_logit_softcapping"),
        local_rope_theta=local_rope_theta(config, arch, path),
        **experts(config, arch, path),
    )
