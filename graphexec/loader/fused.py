"""Checkpoints that store q/k/v or gate/up as one tensor (Phi-3's qkv_proj and gate_up_proj, and
llama.cpp's attn_qkv / phi3 ffn_up) split back into the Hugging Face per-projection names.

The model fuses them again itself (graphexec/models/llama.py); splitting first keeps one naming,
one shape check and one tensor-parallel cut (graphexec/models/sharding.py) for every family.
"""

from __future__ import annotations

from graphexec.models.config import ModelConfig
from graphexec.quant import BlockWeight, QuantizedWeight, Weight

FUSED_SUFFIXES = ("self_attn.qkv_proj.weight", "mlp.gate_up_proj.weight")


def is_fused(name: str) -> bool:
    return name.endswith(FUSED_SUFFIXES)


def split_fused(name: str, weight: Weight, config: ModelConfig) -> dict[str, Weight]:
    """`name`'s rows as the per-projection tensors they hold, under their Hugging Face names."""
    prefix = name.rsplit(".", 2)[0]  # ...layers.<i>.self_attn | ...layers.<i>.mlp
    if name.endswith("qkv_proj.weight"):
        spans = {"q_proj": config.q_size, "k_proj": config.kv_size, "v_proj": config.kv_size}
    else:
        spans = {"gate_proj": config.intermediate_size, "up_proj": config.intermediate_size}
    if weight.shape[0] != sum(spans.values()):
        raise ValueError(f"{name}: {weight.shape[0]} rows, expected {sum(spans.values())} ({' + '.join(spans)})")
    parts, start = {}, 0
    for part, rows in spans.items():
        parts[f"{prefix}.{part}.weight"] = _rows(weight, start, start + rows)
        start += rows
    return parts


def _rows(weight: Weight, start: int, stop: int) -> Weight:
    if isinstance(weight, (QuantizedWeight, BlockWeight)):
        return weight.map_rows(lambda t: t[start:stop].clone())
    return weight[start:stop].clone()
