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
        sd[f"{p}.mlp.gate_proj.weight"] = linear(i, h)
        sd[f"{p}.mlp.up_proj.weight"] = linear(i, h)
        sd[f"{p}.mlp.down_proj.weight"] = linear(h, i)
    sd["model.norm.weight"] = norm(h)
    if not config.tie_word_embeddings:
        sd["lm_head.weight"] = torch.randn(config.vocab_size, h, generator=gen)
    return sd
