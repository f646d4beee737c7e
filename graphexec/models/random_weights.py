"""Deterministic random weights in Hugging Face naming, for tiny test models.

Scaled so that logits are peaked (std well above 1): greedy decoding is then decided by clear
margins, not by float noise, and comparisons with a reference implementation are meaningful.
"""

from __future__ import annotations

import torch

from graphexec.models.config import ModelConfig


def random_state_dict(config: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)

    def linear(out_features: int, in_features: int) -> torch.Tensor:
        return torch.randn(out_features, in_features, generator=gen) / in_features**0.5

    def norm(size: int) -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(size, generator=gen)

    h, i = config.hidden_size, config.intermediate_size
    sd = {"model.embed_tokens.weight": torch.randn(config.vocab_size, h, generator=gen)}
    for layer in range(config.num_layers):
        p = f"model.layers.{layer}"
        sd[f"{p}.input_layernorm.weight"] = norm(h)
        sd[f"{p}.self_attn.q_proj.weight"] = linear(config.q_size, h)
        sd[f"{p}.self_attn.k_proj.weight"] = linear(config.kv_size, h)
        sd[f"{p}.self_attn.v_proj.weight"] = linear(config.kv_size, h)
        if config.attention_bias:
            for name, size in (("q", config.q_size), ("k", config.kv_size), ("v", config.kv_size)):
                sd[f"{p}.self_attn.{name}_proj.bias"] = 0.1 * torch.randn(size, generator=gen)
        if config.qk_norm:
            sd[f"{p}.self_attn.q_norm.weight"] = norm(config.head_dim)
            sd[f"{p}.self_attn.k_norm.weight"] = norm(config.head_dim)
        sd[f"{p}.self_attn.o_proj.weight"] = linear(h, config.q_size)
        sd[f"{p}.post_attention_layernorm.weight"] = norm(h)
        if config.sandwich_norms:
            sd[f"{p}.pre_feedforward_layernorm.weight"] = norm(h)
            sd[f"{p}.post_feedforward_layernorm.weight"] = norm(h)
        if config.is_sparse_layer(layer):
            sd.update(_experts(config, f"{p}.mlp", linear))
            continue
        sd[f"{p}.mlp.gate_proj.weight"] = linear(i, h)
        sd[f"{p}.mlp.up_proj.weight"] = linear(i, h)
        sd[f"{p}.mlp.down_proj.weight"] = linear(h, i)
    sd["model.norm.weight"] = norm(h)
    if not config.tie_word_embeddings:
        sd["lm_head.weight"] = torch.randn(config.vocab_size, h, generator=gen)
    return sd


def _experts(config: ModelConfig, mlp: str, linear) -> dict[str, torch.Tensor]:
    """A sparse layer's router and stacked experts (graphexec/loader/checkpoint.py's names)."""
    h, i, n = config.hidden_size, config.moe_intermediate_size, config.num_experts
    sd = {
        f"{mlp}.gate.weight": linear(n, h),
        f"{mlp}.experts.gate_proj.weight": torch.stack([linear(i, h) for _ in range(n)]),
        f"{mlp}.experts.up_proj.weight": torch.stack([linear(i, h) for _ in range(n)]),
        f"{mlp}.experts.down_proj.weight": torch.stack([linear(h, i) for _ in range(n)]),
    }
    shared = config.shared_expert_intermediate_size
    if shared:
        sd[f"{mlp}.shared_expert.gate_proj.weight"] = linear(shared, h)
        sd[f"{mlp}.shared_expert.up_proj.weight"] = linear(shared, h)
        sd[f"{mlp}.shared_expert.down_proj.weight"] = linear(h, shared)
        sd[f"{mlp}.shared_expert_gate.weight"] = linear(1, h)
    return sd
