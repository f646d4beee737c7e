"""The mixture-of-experts MLP: a router picks each token's top-k experts, and only those experts'
weights are read.

Routing (a linear, softmax, top-k, optional renormalisation) is plain tensor code with static
shapes, so it lives inside captured graphs like any other layer op.  The experts run in one
opaque op: capture sees one node whatever the routing, and the op decides at run time which
experts the batch needs and runs each of them once over the rows routed to it (a grouped GEMM by
expert).  A graph replays the op, not a frozen choice of experts: the op tape records the call
itself, and inductor calls it as an extern kernel.  On a GPU the op's host read of the routing
would break a CUDA graph: TODO(gpu) a device-side grouped GEMM that reads the expert ids there.

Two kinds of expert weights, one op each:
  graphexec::moe_experts         float: gate and up stacked as one [experts, 2 * inter, hidden]
                                 tensor (one matmul per expert), down [experts, hidden, inter].
  graphexec::moe_experts_packed  a GGUF file's packed experts, gate, up and down each in its own
                                 type: the file's bytes (StackedBlocks: K-quants, Q5_x) through
                                 graphexec::qlinear_blocks, or QuantizedWeight's arrays
                                 (StackedQuantized: Q4_0, Q4_1, Q8_0) through graphexec::qlinear;
                                 under model.activations=q8 every expert converted at load to
                                 qlinear_q8's layout (graphexec/quant/repack.py), as dense weights are.
Qwen2-MoE's shared expert is a dense gated MLP every token passes through, scaled by a sigmoid gate.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from graphexec.models.config import ModelConfig
from graphexec.models.layers import GatedMLP, Linear
from graphexec.quant import StackedBlocks, StackedQuantized
from graphexec.quant.repack import block_rows16, repack_rows16

_LIB = torch.library.Library("graphexec", "FRAGMENT")  # noqa: the library object keeps the ops alive
# x: [tokens, hidden]; topk_ids / topk_weights: [tokens, k].  Both return
# sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t]), a token's terms added in expert order.
_LIB.define(
    "moe_experts(Tensor x, Tensor topk_ids, Tensor topk_weights, Tensor w_gate_up, Tensor w_down, "
    "str activation) -> Tensor"
)
# gate / up / down: a projection's stacked arrays, [blocks] (uint8 [experts, rows, row bytes]; its
# `types` entry the GGML type id), [codes, scales(, mins)] row-major (QuantizedWeight's; type
# ROW_MAJOR) or interleaved for qlinear_q8 (type Q8, `rows` its real output rows).  An empty `up`
# means gate holds gate and up rows together (one kernel call an expert, when their types match).
_LIB.define(
    "moe_experts_packed(Tensor x, Tensor topk_ids, Tensor topk_weights, Tensor[] gate, Tensor[] up, "
    "Tensor[] down, int[] types, int[] rows, str activation) -> Tensor"
)
ROW_MAJOR, Q8 = -1, -2

_ACTIVATIONS = {"silu": nn.functional.silu, "gelu_tanh": lambda x: nn.functional.gelu(x, approximate="tanh")}
Expert = Callable[[torch.Tensor, int], torch.Tensor]  # (rows of x, expert) -> the expert's output rows
Stacked = StackedBlocks | StackedQuantized


def _grouped(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, expert: Expert) -> torch.Tensor:
    if x.shape[0] == 1:
        return _one_token(x, topk_ids, topk_weights, expert)
    tokens, k = topk_ids.shape
    # Each token's choices in expert order (slot t * k + j), then the slots grouped by expert: each
    # expert's rows are one matmul, written to their slots, and a token's k terms are added in
    # expert order, as the reference adds them.  index_copy_ and k row adds, not index_add_
    # (a scatter_add: ~0.7 ms a call at SmolLM2's width).
    order = torch.argsort(topk_ids, dim=1, stable=True)
    flat = topk_ids.gather(1, order).reshape(-1)
    weights = topk_weights.gather(1, order).reshape(-1)
    slots = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat).tolist()
    terms = x.new_zeros(tokens * k, x.shape[1])
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue  # never read: an expert no token chose costs nothing
        mine = slots[start : start + n]
        start += n
        terms.index_copy_(0, mine, (expert(x[mine // k], e) * weights[mine, None]).to(x.dtype))
    terms = terms.view(tokens, k, x.shape[1])
    out = terms[:, 0].clone()
    for j in range(1, k):
        out += terms[:, j]
    return out


def _one_token(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, expert: Expert) -> torch.Tensor:
    """B=1 decode, the latency that matters most: no grouping, no gather or scatter (they cost
    about half the experts' own time at SmolLM2's width: graphexec-bench startup on
    model=smollm2-135m-moe-random).  Same sum, in the same expert order."""
    ids = topk_ids[0].tolist()
    out = None
    for j in sorted(range(len(ids)), key=ids.__getitem__):
        y = expert(x, ids[j]) * topk_weights[:, j : j + 1]
        out = y if out is None else out.add_(y)
    return out.to(x.dtype)


def _moe_experts(x, topk_ids, topk_weights, w_gate_up, w_down, activation: str) -> torch.Tensor:
    act = _ACTIVATIONS[activation]

    def expert(rows: torch.Tensor, e: int) -> torch.Tensor:
        gate, up = nn.functional.linear(rows, w_gate_up[e]).chunk(2, dim=-1)
        return nn.functional.linear(act(gate) * up, w_down[e])

    return _grouped(x, topk_ids, topk_weights, expert)


def _project(x: torch.Tensor, arrays: list[torch.Tensor], type_id: int, rows: int, e: int) -> torch.Tensor:
    if type_id >= 0:
        return torch.ops.graphexec.qlinear_blocks.default(x, arrays[0][e], type_id)
    mins = arrays[2][e] if len(arrays) > 2 else None
    if type_id == Q8:
        return torch.ops.graphexec.qlinear_q8.default(x, arrays[0][e], arrays[1][e], mins, rows)
    return torch.ops.graphexec.qlinear.default(x, arrays[0][e], arrays[1][e], mins)


def _moe_experts_packed(x, topk_ids, topk_weights, gate, up, down, types, rows, activation: str) -> torch.Tensor:
    act = _ACTIVATIONS[activation]

    def expert(h: torch.Tensor, e: int) -> torch.Tensor:
        if up:
            h = act(_project(h, gate, types[0], rows[0], e)) * _project(h, up, types[1], rows[1], e)
        else:
            g, u = _project(h, gate, types[0], rows[0], e).chunk(2, dim=-1)
            h = act(g) * u
        return _project(h, down, types[2], rows[2], e)

    return _grouped(x, topk_ids, topk_weights, expert)


_LIB.impl("moe_experts", _moe_experts, "CompositeExplicitAutograd")
_LIB.impl("moe_experts_packed", _moe_experts_packed, "CompositeExplicitAutograd")


@torch.library.register_fake("graphexec::moe_experts")
def _moe_experts_fake(x, topk_ids, topk_weights, w_gate_up, w_down, activation):
    return torch.empty_like(x)


@torch.library.register_fake("graphexec::moe_experts_packed")
def _moe_experts_packed_fake(x, topk_ids, topk_weights, gate, up, down, types, rows, activation):
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
    """Stacked float expert weights (Parameters set by LlamaForCausalLM.load_weights)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        e, i, h = config.num_experts, config.moe_intermediate_size, config.hidden_size
        self.activation = config.hidden_act
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(e, h, i), requires_grad=False)

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return torch.ops.graphexec.moe_experts.default(x, ids, weights, self.gate_up_proj, self.down_proj, self.activation)


class PackedExperts(nn.Module):
    """A GGUF file's packed experts, kept packed (buffers, like BlockLinear's and QuantLinear's);
    under activations=q8 in qlinear_q8's layout instead, every expert converted at load."""

    def __init__(self, gate: Stacked, up: Stacked, down: Stacked, activation: str, activations: str = "float"):
        super().__init__()
        self.activation = activation
        self.qtypes = "/".join(w.qtype for w in (gate, up, down))
        # One plain int or str attribute per setting: constants to Dynamo, and part of the layer
        # structure a compiled layer is keyed by (capture/aot_region.py's layer_structure), so
        # layers whose experts differ only in type never share a graph.
        projections = [("gate", gate), ("up", up), ("down", down)]
        if gate.qtype == up.qtype:
            # One kernel call an expert reads both (and under q8 quantizes the activations once).
            projections = [("gate", _rows_together(gate, up)), ("up", None), ("down", down)]
        for name, weight in projections:
            if weight is None:
                self.up_type, self.up_rows, self.up_arrays = 0, 0, 0
                continue
            type_id, arrays = _q8_arrays(weight) if activations == "q8" else _arrays(weight)
            setattr(self, f"{name}_type", type_id)
            setattr(self, f"{name}_rows", weight.shape[1])
            setattr(self, f"{name}_arrays", len(arrays))
            for i, array in enumerate(arrays):
                self.register_buffer(f"{name}_{i}", array)

    @property
    def types(self) -> list[int]:
        return [self.gate_type, self.up_type, self.down_type]

    def _arrays(self, name: str) -> list[torch.Tensor]:
        return [getattr(self, f"{name}_{i}") for i in range(getattr(self, f"{name}_arrays"))]

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return torch.ops.graphexec.moe_experts_packed.default(
            x, ids, weights, self._arrays("gate"), self._arrays("up"), self._arrays("down"), self.types,
            [self.gate_rows, self.up_rows, self.down_rows], self.activation,
        )

    def extra_repr(self) -> str:
        return f"experts={self.gate_0.shape[0]}, qtypes={self.qtypes}, types={self.types}"


def _rows_together(gate: Stacked, up: Stacked) -> Stacked:
    """Each expert's gate rows then its up rows, as one projection of the same type."""
    if isinstance(gate, StackedBlocks):
        return StackedBlocks(gate.qtype, torch.cat([gate.blocks, up.blocks], dim=1))
    mins = None if gate.mins is None else torch.cat([gate.mins, up.mins], dim=1)
    return StackedQuantized(gate.qtype, torch.cat([gate.codes, up.codes], dim=1),
                            torch.cat([gate.scales, up.scales], dim=1), mins)


def _arrays(weight: Stacked) -> tuple[int, tuple[torch.Tensor, ...]]:
    if isinstance(weight, StackedBlocks):
        return weight.format.type_id, (weight.blocks,)
    return ROW_MAJOR, weight.tensors()


def _q8_arrays(weight: Stacked) -> tuple[int, tuple[torch.Tensor, ...]]:
    """Each expert in qlinear_q8's layout (as packed_linear converts a dense weight), stacked."""
    convert = block_rows16 if isinstance(weight, StackedBlocks) else repack_rows16
    parts = [convert(weight.expert(e)) for e in range(weight.shape[0])]
    arrays = [torch.stack([p.codes for p in parts]), torch.stack([p.scales for p in parts])]
    if parts[0].mins is not None:
        arrays.append(torch.stack([p.mins for p in parts]))
    return Q8, tuple(arrays)


class SparseMoE(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.renormalise = config.norm_topk_prob
        self.gate = Linear(config.hidden_size, config.num_experts, bias=False)  # the router
        self.experts = Experts(config)  # PackedExperts once load_weights is given packed experts
        shared = config.shared_expert_intermediate_size
        self.shared_expert = GatedMLP(config.hidden_size, shared, config.hidden_act) if shared else None
        self.shared_expert_gate = Linear(config.hidden_size, 1, bias=False) if shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.gate(x), self.top_k, self.renormalise)
        out = self.experts(x, ids, weights)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out
