"""Llama-family causal LM over the paged KV pool: one decoder for every family (Llama with or
without RoPE scaling, Mistral, Qwen2, Qwen3, Phi-3, Gemma 1, 2 and 3, and the mixtures Mixtral,
Qwen2-MoE, Qwen3-MoE), told apart only by ModelConfig's switches.  Gemma's layers normalise each
sublayer's output too (SandwichDecoderLayer, with Gemma's Hugging Face names); a mixture's MLP is
SparseMoE (graphexec/models/moe.py); everything else is a switch of the shared parts.
What differs between one model's layers (Gemma's sliding and full-attention layers, Gemma 3's two
RoPE bases) is never a Python attribute of the layer: a compiled layer serves every layer.  The
window is the attention backend's, looked up by layer_id at run time; the RoPE tables are an
argument.

`forward(input_ids, positions)` is the whole callable a capture backend sees: flat token rows in,
final-norm hidden rows out.  Attention reaches the KV pool through the opaque custom op; the LM
head runs later, in the LogitsProcessor, on the pruned rows only.

Under tensor parallelism (a TPGroup of several ranks) the model is this rank's part, as
graphexec/models/tp_layout.py lays it out: its query and KV heads, its MLP rows and its vocabulary
rows.  Two all-reduces per layer (after o_proj and after down_proj, the row-parallel linears) and
one after the embedding make every rank's hidden rows whole; the logits are gathered.  With one
rank every collective is the identity and the graphs are those of the unsharded model.
"""

from __future__ import annotations

from typing import Callable, Mapping

import torch
from torch import nn

from graphexec.attention.op import unified_attention
from graphexec.models.config import ModelConfig
from graphexec.models.layers import Embedding, GatedMLP, Linear, RMSNorm, RotaryEmbedding
from graphexec.models.moe import PackedExperts, SparseMoE
from graphexec.models.parallel_layers import embed, gather_logits
from graphexec.models.rope import inverse_frequencies, local_inverse_frequencies
from graphexec.models.tp_layout import TPLayout
from graphexec.parallel.group import SINGLE, TPGroup
from graphexec.quant import (
    EMBEDDINGS,
    PACKED_MODULES,
    PACKED_WEIGHTS,
    STACKED_WEIGHTS,
    RowParts,
    fuse_rows,
    packed_embedding,
    packed_linear,
)
from graphexec.quant import Weight as LoadedWeight

Weight = LoadedWeight | RowParts  # a fused q/k/v or gate/up may be parts in different formats


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.q_size, self.kv_size = config.q_size, config.kv_size
        # q, k and v fused: one matmul reads all three weights.
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=False)
        # Qwen3, Gemma 3: each head's q and k are RMS-normalised (one weight over head_dim) before RoPE.
        self.q_norm = _norm(config, self.head_dim) if config.qk_norm else None
        self.k_norm = _norm(config, self.head_dim) if config.qk_norm else None

    def forward(self, positions: torch.Tensor, x: torch.Tensor, rotary: RotaryEmbedding, layer_id: int) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = q.view(-1, self.num_heads, self.head_dim), k.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotary(positions, q, k)
        out = unified_attention(q.reshape(-1, self.q_size), k.reshape(-1, self.kv_size), v.contiguous(), layer_id)
        return self.o_proj(out)


def _norm(config: ModelConfig, size: int) -> RMSNorm:
    return RMSNorm(size, config.rms_norm_eps, unit_offset=config.norm_unit_offset)


def _mlp(config: ModelConfig, sparse: bool) -> nn.Module:
    if sparse:
        return SparseMoE(config)
    return GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, tp: TPGroup = SINGLE, sparse: bool = False):
        super().__init__()
        self.tp = tp
        self.input_layernorm = _norm(config, config.hidden_size)
        self.self_attn = LlamaAttention(config)
        self.post_attention_layernorm = _norm(config, config.hidden_size)  # before the MLP
        self.mlp = _mlp(config, sparse)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, rotary: RotaryEmbedding, layer_id: int) -> torch.Tensor:
        # layer_id is an argument, not an attribute, so one compiled layer serves every layer.
        # o_proj and down_proj are row-parallel: each rank holds a partial sum of the whole rows.
        x = x + self.tp.all_reduce(self.self_attn(positions, self.input_layernorm(x), rotary, layer_id))
        return x + self.tp.all_reduce(self.mlp(self.post_attention_layernorm(x)))


class SandwichDecoderLayer(nn.Module):
    """Gemma 2 / 3: a norm before and after each sublayer (Gemma's post_attention_layernorm
    normalises the attention output; pre_feedforward_layernorm is what Llama's is)."""

    def __init__(self, config: ModelConfig, tp: TPGroup = SINGLE, sparse: bool = False):
        super().__init__()
        self.tp = tp
        self.input_layernorm = _norm(config, config.hidden_size)
        self.self_attn = LlamaAttention(config)
        self.post_attention_layernorm = _norm(config, config.hidden_size)
        self.pre_feedforward_layernorm = _norm(config, config.hidden_size)
        self.mlp = _mlp(config, sparse)
        self.post_feedforward_layernorm = _norm(config, config.hidden_size)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, rotary: RotaryEmbedding, layer_id: int) -> torch.Tensor:
        # The output norms run on whole rows: after the row-parallel linears' all-reduce.
        attn = self.tp.all_reduce(self.self_attn(positions, self.input_layernorm(x), rotary, layer_id))
        x = x + self.post_attention_layernorm(attn)
        mlp = self.tp.all_reduce(self.mlp(self.pre_feedforward_layernorm(x)))
        return x + self.post_feedforward_layernorm(mlp)


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, tp: TPGroup = SINGLE):
        super().__init__()
        self.config = config  # the whole model's; `layout.local_config()` is this rank's part
        self.tp = tp
        self.layout = TPLayout.build(config, tp.size, tp.rank)
        local, vocab_rows = self.layout.local_config(), self.layout.vocab_rows
        self.embed_tokens = Embedding(vocab_rows, config.hidden_size)
        # Gemma scales the embedding rows (by sqrt(hidden_size)); load_weights rounds the factor
        # to the model's dtype, as the reference multiplies in that dtype.
        self.embed_scale = config.embed_scale
        inv_freq, attention_factor = inverse_frequencies(config)
        self.rotary = RotaryEmbedding(inv_freq, config.max_context, attention_factor)
        local_freq = local_inverse_frequencies(config)
        self.local_rotary = None if local_freq is None else RotaryEmbedding(local_freq, config.max_context)
        # Each layer's RoPE tables (a plain list: the modules are registered once, above).
        self.layer_rotary = [
            self.local_rotary if self.local_rotary is not None and config.is_sliding_layer(i) else self.rotary
            for i in range(config.num_layers)
        ]
        layer_class = SandwichDecoderLayer if config.sandwich_norms else LlamaDecoderLayer
        self.layers = nn.ModuleList(layer_class(local, tp, config.is_sparse_layer(i)) for i in range(config.num_layers))
        self.norm = _norm(config, config.hidden_size)
        self.lm_head = None if config.tie_word_embeddings else Linear(config.hidden_size, vocab_rows, bias=False)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, layer_runner: Callable | None = None
    ) -> torch.Tensor:
        """`layer_runner(layer, positions, x, rotary, layer_id)`, when given, runs each decoder
        layer: how a capture backend compiles the repeated layer once (regional compilation)."""
        x = embed(self.embed_tokens, input_ids, self.layout, self.tp)
        if self.embed_scale != 1.0:
            x = x * self.embed_scale
        for layer_id, (layer, rotary) in enumerate(zip(self.layers, self.layer_rotary)):
            if layer_runner is None:
                x = layer(positions, x, rotary, layer_id)
            else:
                x = layer_runner(layer, positions, x, rotary, layer_id)
        return self.norm(x)

    def rope_tables(self) -> list[torch.Tensor]:
        """The RoPE cos/sin tables: derived from the config, not weights."""
        return [t for rotary in (self.rotary, self.local_rotary) if rotary is not None for t in rotary.buffers()]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits over the whole vocabulary for `hidden`'s rows (gathered from every rank);
        Gemma 2 soft-caps them, as its reference does after the head."""
        logits = gather_logits(self._local_logits(hidden), self.layout, self.tp)
        cap = self.config.final_logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def _local_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is not None:
            return self.lm_head(hidden)
        if isinstance(self.embed_tokens, EMBEDDINGS):
            return self.embed_tokens.project(hidden)  # the tied head reads the packed rows
        return torch.nn.functional.linear(hidden, self.embed_tokens.weight)

    @torch.no_grad()
    def load_weights(self, state_dict: Mapping[str, Weight], dtype: torch.dtype, activations: str = "float") -> None:
        """Take Hugging Face-named weights, fusing q/k/v and gate/up; every parameter must be set.

        Weights are assigned, not copied, so the model may be built on the meta device and never
        holds a second copy.  Under tensor parallelism they must already be this rank's part
        (graphexec/models/sharding.py; the loaders cut while reading).  Dense tensors become
        `dtype` parameters; a packed weight (QuantizedWeight, BlockWeight, or RowParts for fused
        parts in different formats) replaces its linear (or the embedding) with the module that
        reads it, meeting its activations as `activations` says (float | q8: graphexec/quant/layers.py).
        """
        self.embed_scale = float(torch.tensor(self.config.embed_scale, dtype=dtype))
        fused = _fuse_hf_names(state_dict, self.config)
        for name, experts in _packed_experts(fused):
            self.set_submodule(name, PackedExperts(*experts, self.config.hidden_act, activations))
        if self.lm_head is None:
            # Tied checkpoints sometimes store the shared matrix twice.
            fused.pop("lm_head.weight", None)
        params = dict(self.named_parameters())
        missing = sorted(set(params) - set(fused))
        unexpected = sorted(set(fused) - set(params))
        if missing or unexpected:
            raise ValueError(f"checkpoint does not match the model: missing {missing[:4]}, unexpected {unexpected[:4]}")
        for name, weight in fused.items():
            if params[name].shape != tuple(weight.shape):
                raise ValueError(f"{name}: checkpoint shape {tuple(weight.shape)} != model {tuple(params[name].shape)}")
        for name, weight in fused.items():
            module_name, _, attr = name.rpartition(".")
            if isinstance(weight, PACKED_WEIGHTS):
                bias = fused.get(f"{module_name}.bias")
                self.set_submodule(module_name, self._quantized(module_name, weight, bias, dtype, activations))
            elif not isinstance(self.get_submodule(module_name), PACKED_MODULES):
                setattr(self.get_submodule(module_name), attr, nn.Parameter(weight.to(dtype), requires_grad=False))

    def _quantized(
        self, name: str, weight: Weight, bias: torch.Tensor | None, dtype: torch.dtype, activations: str
    ) -> nn.Module:
        if name == "embed_tokens":
            return packed_embedding(weight, dtype, activations)
        return packed_linear(weight, None if bias is None else bias.to(dtype), dtype, activations)


def _fuse_hf_names(state_dict: Mapping[str, Weight], config: ModelConfig) -> dict[str, Weight]:
    sd = {name.removeprefix("model."): t for name, t in state_dict.items()}
    fused: dict[str, Weight] = {}

    def gate_up(prefix: str) -> None:
        parts = [sd.pop(f"{prefix}.gate_proj.weight"), sd.pop(f"{prefix}.up_proj.weight")]
        fused[f"{prefix}.gate_up_proj.weight"] = fuse_rows(parts, f"{prefix}.gate_up_proj")

    for i in range(config.num_layers):
        attn, mlp = f"layers.{i}.self_attn", f"layers.{i}.mlp"
        fused[f"{attn}.qkv_proj.weight"] = fuse_rows([sd.pop(f"{attn}.{p}_proj.weight") for p in "qkv"], f"{attn}.qkv_proj")
        if f"{attn}.q_proj.bias" in sd:
            fused[f"{attn}.qkv_proj.bias"] = torch.cat([sd.pop(f"{attn}.{p}_proj.bias") for p in "qkv"])
        if not config.is_sparse_layer(i):
            gate_up(mlp)
            continue
        # Stacked experts ([experts, rows, cols], as the loaders give them): float ones with gate
        # and up fused per expert along the rows, as a dense MLP's are; packed ones as they are.
        experts = f"{mlp}.experts"
        stacked = [sd.pop(f"{experts}.{p}_proj.weight") for p in ("gate", "up", "down")]
        if any(isinstance(w, STACKED_WEIGHTS) for w in stacked):
            fused.update({f"{experts}.{p}": w for p, w in zip(("gate", "up", "down"), stacked)})
        else:
            fused[f"{experts}.gate_up_proj"] = torch.cat(stacked[:2], dim=1)
            fused[f"{experts}.down_proj"] = stacked[2]
        if config.shared_expert_intermediate_size:
            gate_up(f"{mlp}.shared_expert")
    fused.update(sd)
    return fused


def _packed_experts(fused: dict[str, Weight]) -> list[tuple[str, tuple]]:
    """(module name, (gate, up, down)) of every layer whose experts came packed, taken out of
    `fused`: they replace that layer's float Experts whole."""
    names = [n.removesuffix(".gate") for n, w in fused.items() if n.endswith(".experts.gate")]
    packed = []
    for name in names:
        parts = tuple(fused.pop(f"{name}.{p}") for p in ("gate", "up", "down"))
        if not all(isinstance(w, STACKED_WEIGHTS) for w in parts):
            raise ValueError(
                f"{name}: gate, up and down experts come partly packed, partly float; load the file with "
                "model.weights=dequantize"
            )
        packed.append((name, parts))
    return packed

