"""A Hugging Face config.json read into a ModelConfig: which family it is, its RoPE scaling, and
every feature the engine cannot run refused by name (MoE, per-layer sliding windows, other families).

Both spellings are read: transformers 4 writes rope_theta and rope_scaling at the top level,
transformers 5 nests them (and partial_rotary_factor) in rope_parameters.
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
}
_MODEL_TYPES = {family: family for family in ARCHITECTURES.values()}
# Phi-3's first long-context checkpoints called LongRoPE "su".
_ROPE_ALIASES = {"su": "longrope"}


def _fail(path: Path, message: str) -> CheckpointError:
    return CheckpointError(f"{path}: {message}")


def family(config: dict[str, Any], path: Path) -> str:
    names = config.get("architectures") or ()
    if any(key in config for key in ("num_experts", "num_local_experts", "n_routed_experts")) or any(
        "Moe" in name for name in names
    ):
        raise _fail(path, f"mixture-of-experts models ({list(names)}) are not supported")
    for name in names:
        if name in ARCHITECTURES:
            return ARCHITECTURES[name]
    if not names and config.get("model_type") in _MODEL_TYPES:
        return _MODEL_TYPES[config["model_type"]]
    raise _fail(path, f"unsupported model {list(names) or config.get('model_type')!r}; supported: {sorted(ARCHITECTURES)}")


def attention_window(config: dict[str, Any], arch: str, max_context: int, path: Path) -> int | None:
    """The sliding window every layer uses (None: full attention), in transformers' reading.

    A window at least as long as the context is full attention.  Layers that differ (Qwen's
    max_window_layers, a mixed `layer_types`) are refused: the engine runs one window for all."""
    window = config.get("sliding_window")
    # Mistral and Phi-3 have no switch: a window is used when given.  Qwen2/Qwen3 default it off.
    uses_window = bool(config.get("use_sliding_window", arch not in ("qwen2", "qwen3")))
    if window is None or not uses_window:
        window = None
    layers = int(config["num_hidden_layers"])
    layer_types = config.get("layer_types")
    if layer_types is None and window is not None and arch in ("qwen2", "qwen3"):
        # Qwen: layers below max_window_layers attend fully (transformers' Qwen2Config.layer_types;
        # 28, its default, when the config omits it).
        first = int(config.get("max_window_layers", 28))
        layer_types = ["full_attention" if i < first else "sliding_attention" for i in range(layers)]
    if layer_types is not None:
        kinds = set(layer_types)
        if not kinds <= {"full_attention", "sliding_attention"}:
            raise _fail(path, f"attention layer types {sorted(kinds)} (layer_types) are not supported")
        if "sliding_attention" not in kinds:
            return None
        if window is None:
            raise _fail(path, "layer_types names sliding_attention layers but sliding_window is not set")
        if "full_attention" in kinds and int(window) < max_context:
            counts = {kind: list(layer_types).count(kind) for kind in sorted(kinds)}
            raise _fail(
                path,
                f"per-layer sliding-window attention (sliding_window={window} < context {max_context} on some "
                f"layers only: {counts}, from layer_types / max_window_layers) is not supported; "
                "only one window for every layer is",
            )
    if window is None or int(window) >= max_context:
        return None
    if int(window) < 1:
        raise _fail(path, f"sliding_window={window} must be at least 1")
    return int(window)


def rope(config: dict[str, Any], path: Path) -> tuple[float, RopeScaling | None, int, float]:
    """(rope_theta, scaling, max_context, partial_rotary_factor).  max_context is capped at the
    original context for the scalings supported only in their static form (rope.py)."""
    parameters = dict(config.get("rope_parameters") or {})
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
    if arch in ("llama", "mistral", "qwen3", "phi3") and config.get("attention_bias"):
        raise _fail(path, f"{arch} checkpoints with attention projection biases (attention_bias) are not supported")
    if config.get("hidden_act", "silu") != "silu":
        raise _fail(path, f"activation {config['hidden_act']!r} (hidden_act) is not supported (only silu)")


def model_config(config: dict[str, Any], name: str, has_lm_head: bool, eos_ids: list[int], path: Path) -> ModelConfig:
    arch = family(config, path)
    unsupported_features(config, arch, path)
    theta, scaling, max_context, partial = rope(config, path)
    window = attention_window(config, arch, max_context, path)
    hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
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
        attention_bias=arch == "qwen2",
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=tuple(dict.fromkeys(eos_ids)),
        qk_norm=arch == "qwen3",
        rotary_dim=rotary_dim(head_dim, partial),
        rope_scaling=scaling,
        sliding_window=window,
    )
