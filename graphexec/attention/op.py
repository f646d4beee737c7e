"""`graphexec::attention`, the opaque custom op every attention layer calls.

Opaque so that graph capture can keep it inside a whole-forward graph (decode) or split the graph
at it (piecewise prefill) without the compiler ever tracing the KV pool or ragged metadata.

Why `torch.library.custom_op` and not the lower-level `Library.define`/`impl` (7 µs per call
against 55 µs here): with the latter, Dynamo specializes the `layer_id` int on every call, so a
regionally compiled decoder layer recompiles once per layer (30 graphs, recompile limit hit)
instead of sharing one graph with a symbolic layer_id.
"""

from __future__ import annotations

import torch

from capture.break_points import ATTENTION, break_point
from graphexec.forward_context import get_forward_context


@torch.library.custom_op("graphexec::attention", mutates_args=("out",))
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, layer_id: int) -> None:
    """Write k/v for this step's tokens into the pool, then attend; the result lands in `out`.

    q/out: [num_tokens, num_heads * head_dim]; k/v: [num_tokens, num_kv_heads * head_dim].
    """
    ctx = get_forward_context()
    ctx.attn_backend.forward(q, k, v, out, layer_id, ctx)


@attention.register_fake
def _attention_fake(q, k, v, out, layer_id) -> None:
    return None


@break_point(ATTENTION)
def unified_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int) -> torch.Tensor:
    out = torch.empty_like(q)
    torch.ops.graphexec.attention(q, k, v, out, layer_id)
    return out
