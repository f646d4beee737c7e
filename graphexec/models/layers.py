"""Building blocks of a Llama-family decoder, numerically matched to Hugging Face transformers."""

from __future__ import annotations

import torch
from torch import nn


class Linear(nn.Linear):
    """nn.Linear left uninitialised: the checkpoint's weights replace its parameters
    (LlamaForCausalLM.load_weights).  Initialising them on the meta device would import Dynamo
    (torch's meta normal_/uniform_ are refs behind torch._disable_dynamo): ~2 s of an eager start."""

    def reset_parameters(self) -> None:
        pass


class Embedding(nn.Embedding):
    """nn.Embedding left uninitialised, for the reason Linear is."""

    def reset_parameters(self) -> None:
        pass


class RMSNorm(nn.Module):
    """`unit_offset` (Gemma): scale by 1 + weight, in fp32 before the cast back, as Gemma's
    reference does; otherwise by weight after the cast, as Llama's does."""

    def __init__(self, hidden_size: int, eps: float, unit_offset: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.unit_offset = unit_offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalize in fp32 whatever the storage dtype, as the reference does.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.unit_offset:
            return (x32 * (1.0 + self.weight.float())).to(x.dtype)
        return self.weight * x32.to(x.dtype)


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE over the first `rotary_dim` dims of each head (all of them unless the
    model has partial rotary), with a cos/sin table precomputed for every position up to the
    context.  `attention_factor` scales cos and sin (YaRN, LongRoPE), as the reference does."""

    def __init__(self, inv_freq: torch.Tensor, max_positions: int, attention_factor: float = 1.0):
        super().__init__()
        # Built on the CPU even when the model is constructed on the meta device (before its weights
        # arrive): the tables are derived, not loaded.
        self.rotary_dim = 2 * inv_freq.shape[0]
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32, device="cpu"), inv_freq.float().cpu())
        emb = torch.cat([freqs, freqs], dim=-1)
        # Not parameters: derived from the config, never loaded or saved.
        self.register_buffer("cos_table", emb.cos() * attention_factor, persistent=False)
        self.register_buffer("sin_table", emb.sin() * attention_factor, persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, heads, head_dim], k: [T, kv_heads, head_dim]."""
        cos = self.cos_table[positions].unsqueeze(1).to(q.dtype)
        sin = self.sin_table[positions].unsqueeze(1).to(q.dtype)
        if self.rotary_dim == q.shape[-1]:
            return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        return _rotate_part(q, cos, sin, self.rotary_dim), _rotate_part(k, cos, sin, self.rotary_dim)


def _rotate_part(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, dim: int) -> torch.Tensor:
    # Partial rotary: only the leading dims rotate, the rest pass through unchanged.
    rot, rest = x[..., :dim], x[..., dim:]
    return torch.cat([rot * cos + _rotate_half(rot) * sin, rest], dim=-1)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)): SwiGLU with silu, GeGLU (Gemma) with gelu_tanh.  gate and up
    are fused into one matmul: one weight read instead of two."""

    def __init__(self, hidden_size: int, intermediate_size: int, activation: str = "silu"):
        super().__init__()
        self.intermediate_size = intermediate_size
        self.activation = activation
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        if self.activation == "gelu_tanh":
            return self.down_proj(nn.functional.gelu(gate, approximate="tanh") * up)
        return self.down_proj(nn.functional.silu(gate) * up)
