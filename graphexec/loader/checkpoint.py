"""What every loader returns, and the Hugging Face tensor names and shapes a ModelConfig implies."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from graphexec.errors import CheckpointError
from graphexec.models.config import ModelConfig
from graphexec.models.sharding import cut_for
from graphexec.models.tp_layout import TPLayout
from graphexec.text.tokenizer import Tokenizer


# eq=False: comparing dicts of tensors with == raises, and identity is what callers mean anyway.
@dataclass(frozen=True, eq=False)
class LoadedCheckpoint:
    """A model's architecture, its weights under Hugging Face names, and its tokenizer if it ships one.

    Tied checkpoints carry no "lm_head.weight": the model reuses "model.embed_tokens.weight".
    """

    config: ModelConfig  # the whole model's, even when the weights are one rank's part
    state_dict: dict[str, torch.Tensor]
    tokenizer: Tokenizer | None
    # (tp_size, tp_rank) the weights were cut for (graphexec/models/sharding.py); (1, 0): whole.
    tp_shard: tuple[int, int] = (1, 0)


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a causal LM with this config needs, as [out_features, in_features] for linears."""
    hidden, ffn = config.hidden_size, config.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config.vocab_size, hidden),
        "model.norm.weight": (hidden,),
    }
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, hidden)
    for i in range(config.num_layers):
        layer = f"model.layers.{i}"
        shapes[f"{layer}.input_layernorm.weight"] = (hidden,)
        shapes[f"{layer}.post_attention_layernorm.weight"] = (hidden,)
        if config.sandwich_norms:  # Gemma: the MLP's input and output norms too
            shapes[f"{layer}.pre_feedforward_layernorm.weight"] = (hidden,)
            shapes[f"{layer}.post_feedforward_layernorm.weight"] = (hidden,)
        shapes[f"{layer}.self_attn.q_proj.weight"] = (config.q_size, hidden)
        shapes[f"{layer}.self_attn.k_proj.weight"] = (config.kv_size, hidden)
        shapes[f"{layer}.self_attn.v_proj.weight"] = (config.kv_size, hidden)
        shapes[f"{layer}.self_attn.o_proj.weight"] = (hidden, config.q_size)
        if config.attention_bias:
            shapes[f"{layer}.self_attn.q_proj.bias"] = (config.q_size,)
            shapes[f"{layer}.self_attn.k_proj.bias"] = (config.kv_size,)
            shapes[f"{layer}.self_attn.v_proj.bias"] = (config.kv_size,)
        if config.qk_norm:
            shapes[f"{layer}.self_attn.q_norm.weight"] = (config.head_dim,)
            shapes[f"{layer}.self_attn.k_norm.weight"] = (config.head_dim,)
        if config.is_sparse_layer(i):
            shapes.update(_moe_shapes(config, f"{layer}.mlp"))
            continue
        shapes[f"{layer}.mlp.gate_proj.weight"] = (ffn, hidden)
        shapes[f"{layer}.mlp.up_proj.weight"] = (ffn, hidden)
        shapes[f"{layer}.mlp.down_proj.weight"] = (hidden, ffn)
    return shapes


def _moe_shapes(config: ModelConfig, mlp: str) -> dict[str, tuple[int, ...]]:
    """A sparse layer's router, its experts stacked [experts, rows, cols] (the loaders stack a
    checkpoint's per-expert tensors) and its shared expert, if any."""
    hidden, experts, inter = config.hidden_size, config.num_experts, config.moe_intermediate_size
    shapes = {
        f"{mlp}.gate.weight": (experts, hidden),
        f"{mlp}.experts.gate_proj.weight": (experts, inter, hidden),
        f"{mlp}.experts.up_proj.weight": (experts, inter, hidden),
        f"{mlp}.experts.down_proj.weight": (experts, hidden, inter),
    }
    shared = config.shared_expert_intermediate_size
    if shared:
        shapes[f"{mlp}.shared_expert.gate_proj.weight"] = (shared, hidden)
        shapes[f"{mlp}.shared_expert.up_proj.weight"] = (shared, hidden)
        shapes[f"{mlp}.shared_expert.down_proj.weight"] = (hidden, shared)
        shapes[f"{mlp}.shared_expert_gate.weight"] = (1, hidden)
    return shapes


def check_state_dict(
    config: ModelConfig, state_dict: dict[str, torch.Tensor], source: Path, layout: TPLayout | None = None
) -> None:
    """Fail loudly at load time rather than with a shape error deep inside a forward pass.
    With a layout, the shapes are those of its rank's part."""
    expected = expected_shapes(config)
    if layout is not None:
        expected = {key: _cut_shape(key, shape, layout) for key, shape in expected.items()}
    missing = sorted(expected.keys() - state_dict.keys())
    unexpected = sorted(state_dict.keys() - expected.keys())
    if missing or unexpected:
        raise CheckpointError(
            f"{source}: tensors do not match the config (missing {missing[:5]}, unexpected {unexpected[:5]})"
        )
    for key, shape in expected.items():
        if tuple(state_dict[key].shape) != shape:
            raise CheckpointError(f"{source}: {key} has shape {tuple(state_dict[key].shape)}, expected {shape}")


def _cut_shape(key: str, shape: tuple[int, ...], layout: TPLayout) -> tuple[int, ...]:
    cut = cut_for(key, layout)
    return shape if cut is None else cut.shape(shape)
