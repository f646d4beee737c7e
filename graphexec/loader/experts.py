"""A mixture of experts' tensors in the one layout the model loads: per layer, the router
`mlp.gate.weight` and each projection's experts stacked as `mlp.experts.<proj>.weight`
[experts, rows, cols] (the layout of a GGUF file's `ffn_*_exps`).

Hugging Face checkpoints spell experts three ways: one tensor per expert (Qwen-MoE's
`mlp.experts.<e>.<proj>.weight`, Mixtral's `block_sparse_moe.experts.<e>.w1/w3/w2.weight`, what
the Hub holds) or transformers 5's stacked parameters (`mlp.experts.gate_up_proj` [experts,
2 * intermediate, hidden], gate rows first, and `mlp.experts.down_proj`).
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from graphexec.errors import CheckpointError
from graphexec.models.config import ModelConfig

_MIXTRAL = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_PER_EXPERT = re.compile(r"(model\.layers\.\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight")
_STACKED = re.compile(r"(model\.layers\.\d+)\.mlp\.experts\.(gate_up_proj|down_proj)")


def stack_experts(tensors: dict[str, torch.Tensor], config: ModelConfig, path: Path) -> dict[str, torch.Tensor]:
    """`tensors` with every expert tensor in the stacked layout (unchanged for a dense model)."""
    if not config.num_experts:
        return tensors
    out: dict[str, torch.Tensor] = {}
    per_expert: dict[str, dict[int, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        if (match := _PER_EXPERT.fullmatch(key)) is not None:
            name = f"{match[1]}.mlp.experts.{_MIXTRAL.get(match[3], match[3])}.weight"
            per_expert.setdefault(name, {})[int(match[2])] = tensor
        elif (match := _STACKED.fullmatch(key)) is not None and match[2] == "down_proj":
            out[f"{match[1]}.mlp.experts.down_proj.weight"] = tensor
        elif match is not None:
            gate, up = tensor.chunk(2, dim=1)
            out[f"{match[1]}.mlp.experts.gate_proj.weight"] = gate.contiguous()
            out[f"{match[1]}.mlp.experts.up_proj.weight"] = up.contiguous()
        else:
            out[key.replace(".block_sparse_moe.gate.", ".mlp.gate.")] = tensor
    for name, by_expert in per_expert.items():
        if sorted(by_expert) != list(range(config.num_experts)):
            raise CheckpointError(
                f"{path}: {name} has experts {sorted(by_expert)[:8]}, expected 0..{config.num_experts - 1}"
            )
        out[name] = torch.stack([by_expert[e] for e in range(config.num_experts)])
    return out
