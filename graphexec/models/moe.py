"""The mixture-of-experts MLP: a router picks each token's top-k experts, and only those experts'
weights are read.

Routing (a linear, softmax, top-k, optional renormalisation) is plain tensor code with static
shapes, so it lives inside captured graphs like any other layer op.  The experts run in one
opaque op, `graphexec::moe_experts`: capture sees one node whatever the routing, and the op
decides at run time which experts the batch needs and runs each of them once over the rows
routed to it (a grouped GEMM by expert).  A graph replays the op, not a frozen choice of experts:
the op tape records the call itself (graphexec/runner declares no trace through it), and inductor
calls it as an extern kernel.  On a GPU the op's host read of the routing would break a CUDA
graph: TODO(gpu) a device-side grouped GEMM that reads the expert ids on the device.

Experts are stacked: gate and up as one [experts, 2 * moe_intermediate, hidden] tensor (one matmul
per expert), down as [experts, hidden, moe_intermediate].  Qwen2-MoE's shared expert is a dense
gated MLP every token passes through, scaled by a sigmoid gate.
"""

from __future__ import annotations

import torch
from torch import nn

from graphexec.models.config import ModelConfig
from graphexec.models.layers import GatedMLP, Linear

_LIB = torch.library.Library("graphexec", "FRAGMENT")  # noqa: the library object keeps the op alive
# x: [tokens, hidden]; topk_ids / topk_weights: [tokens, k]; w_gate_up: [experts, 2 * inter, hidden];
# w_down: [experts, hidden, inter].  Returns sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t]).
_LIB.define(
    "moe_experts(Tensor x, Tensor topk_ids, Tensor topk_weights, Tensor w_gate_up, Tensor w_down, "
    "str activation) -> Tensor"
)

_ACTIVATIONS = {"silu": nn.functional.silu, "gelu_tanh": lambda x: nn.functional.gelu(x, approximate="tanh")}


def _moe_experts(x, topk_ids, topk_weights, w_gate_up, w_down, activation: str) -> torch.Tensor:
    act = _ACTIVATIONS[activation]
    if x.shape[0] == 1:
        return _one_token(x, topk_ids, topk_weights, w_gate_up, w_down, act)
    out = torch.zeros_like(x)
    k = topk_ids.shape[1]
    flat = topk_ids.reshape(-1)
    # The (token, choice) slots grouped by expert, in expert order: each expert's rows are one
    # matmul, and a token's contributions are added in expert order, as the reference adds them.
    slots = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=w_gate_up.shape[0]).tolist()
    weights = topk_weights.reshape(-1)
    start = 0
    for expert, n in enumerate(counts):
        if n == 0:
            continue  # never read: an expert no token chose costs nothing
        mine = slots[start : start + n]
        start += n
        rows = mine // k
        gate, up = nn.functional.linear(x[rows], w_gate_up[expert]).chunk(2, dim=-1)
        y = nn.functional.linear(act(gate) * up, w_down[expert])
        out.index_add_(0, rows, (y * weights[mine, None]).to(out.dtype))
    return out


def _one_token(x, topk_ids, topk_weights, w_gate_up, w_down, act) -> torch.Tensor:
    """B=1 decode, the latency that matters most: no grouping, no gather or scatter (they cost
    about half the experts' own time at SmolLM2's width: graphexec-bench startup on
    model=smollm2-135m-moe-random).  Same sum, in the same expert order."""
    ids = topk_ids[0].tolist()
    out = None
    for j in sorted(range(len(ids)), key=ids.__getitem__):
        gate, up = nn.functional.linear(x, w_gate_up[ids[j]]).chunk(2, dim=-1)
        y = nn.functional.linear(act(gate) * up, w_down[ids[j]]) * topk_weights[:, j : j + 1]
        out = y if out is None else out.add_(y)
    return out.to(x.dtype)


_LIB.impl("moe_experts", _moe_experts, "CompositeExplicitAutograd")


@torch.library.register_fake("graphexec::moe_experts")
def _moe_experts_fake(x, topk_ids, topk_weights, w_gate_up, w_down, activation):
    return torch.empty_like(x)


def route(logits: torch.Tensor, k: int, renormalise: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [tokens, k] fp32, expert ids [tokens, k]): softmax over every expert in fp32, the
    top k, renormalised to sum to one if asked (Mixtral always; Qwen by norm_topk_prob)."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, k, dim=-1)
    if renormalise:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


class Experts(nn.Module):
    """Stacked expert weights (Parameters set by LlamaForCausalLM.load_weights)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        e, i, h = config.num_experts, config.moe_intermediate_size, config.hidden_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(e, h, i), requires_grad=False)


class SparseMoE(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.renormalise = config.norm_topk_prob
        self.activation = config.hidden_act
        self.gate = Linear(config.hidden_size, config.num_experts, bias=False)  # the router
        self.experts = Experts(config)
        shared = config.shared_expert_intermediate_size
        self.shared_expert = GatedMLP(config.hidden_size, shared, config.hidden_act) if shared else None
        self.shared_expert_gate = Linear(config.hidden_size, 1, bias=False) if shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.gate(x), self.top_k, self.renormalise)
        out = torch.ops.graphexec.moe_experts.default(
            x, ids, weights, self.experts.gate_up_proj, self.experts.down_proj, self.activation
        )
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out
