"""`graphexec::attention`, the opaque op every attention layer calls, and the ops behind it.

Opaque so that graph capture can keep it inside a whole-forward graph (decode) or split the graph
at it (piecewise prefill) without the compiler ever tracing the KV pool or ragged metadata.

Defined with `Library.define`, not `torch.library.custom_op`: a call goes through the dispatcher
with no Python wrapper (custom_op's wrapper cost ~55 µs a call, 30 calls a step).  `layer_id` is
a `SymInt` in the schema, so Dynamo keeps it symbolic and a regionally compiled decoder layer is
one graph for every layer (with an `int` schema Dynamo specializes it: one graph per layer).

Two ways a call is served (the KV pool and per-step metadata never appear as op arguments):
  C++     the CPU kernel (graphexec/kernels/csrc/attention.cpp), when the `cpu` attention backend
          has bound this forward's pool and metadata on this thread (`attention_bind`, once per
          forward, for the length of the runner's forward scope): ~1 µs of dispatch, then the
          kernel.
  Python  everything else (other devices, the torch_native backend, a binding-free forward):
          the op runs `attention_py`, which hands the call to the forward context's backend.
"""

from __future__ import annotations

import threading

import torch

from capture.break_points import ATTENTION, break_point
from graphexec.attention.forward_context import get_forward_context

# The op a traced forward is cut at (tc_piecewise's split op; ModelRunner declares it to capture/).
ATTENTION_OP = "graphexec::attention"
# The ops whose Python route reads this forward's metadata on the host: a graph that contains
# attention must record the kernels they launch (ModelRunner declares them to capture/).
PYTHON_ROUTED_OPS = (ATTENTION_OP, "graphexec::attention_py")

_LIB = torch.library.Library("graphexec", "FRAGMENT")  # noqa: the library object keeps the ops alive
_LIB.define("attention(Tensor q, Tensor k, Tensor v, Tensor(a!) out, SymInt layer_id) -> ()")
# The Python route of `attention` (the C++ kernel redispatches to it when nothing is bound).
_LIB.define("attention_py(Tensor q, Tensor k, Tensor v, Tensor(a!) out, SymInt layer_id) -> ()")
# The CPU kernels with every input explicit (the cpu backend's Python route, tests, benchmarks).
# k_pool/v_pool: [layers, slots, kv_heads, head_dim]; extend iff the three extend_* are given.
# sliding_window: layer_id's window, a query at position p attends keys p - sliding_window + 1 .. p;
# 0 or less: all.  scale: the softmax scale (0 or less: head_dim ** -0.5).  logit_softcap: scores
# s = scale * q.k become cap * tanh(s / cap) before masking and softmax (0 or less: none).
_LIB.define(
    "paged_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) out, Tensor(b!) k_pool, Tensor(c!) v_pool, "
    "int layer_id, Tensor req_to_token, Tensor req_pool_indices, Tensor seq_lens, Tensor out_cache_loc, "
    "Tensor? extend_prefix_lens, Tensor? extend_seq_lens, Tensor? extend_start_loc, int num_token_non_padded, "
    "int sliding_window=0, float scale=0.0, float logit_softcap=0.0) -> ()"
)
# This thread's binding for the C++ route of `attention` (arguments as paged_attention's, but the
# windows of every layer: sliding_windows[layer_id], or sliding_windows[0] for all when it has one
# entry; the layer is known only when the op is called).
_LIB.define(
    "attention_bind(Tensor k_pool, Tensor v_pool, Tensor req_to_token, Tensor req_pool_indices, "
    "Tensor seq_lens, Tensor out_cache_loc, Tensor? extend_prefix_lens, Tensor? extend_seq_lens, "
    "Tensor? extend_start_loc, int num_token_non_padded, int[] sliding_windows, float scale=0.0, "
    "float logit_softcap=0.0) -> ()"
)
_LIB.define("attention_unbind() -> ()")


def _python_route(q, k, v, out, layer_id) -> None:
    """q/out: [num_tokens, num_heads * head_dim]; k/v: [num_tokens, num_kv_heads * head_dim]."""
    ctx = get_forward_context()
    ctx.attn_backend.forward(q, k, v, out, layer_id, ctx)


_LIB.impl("attention", _python_route, "CompositeExplicitAutograd")
_LIB.impl("attention_py", _python_route, "CompositeExplicitAutograd")


@torch.library.register_fake("graphexec::attention")
def _attention_fake(q, k, v, out, layer_id) -> None:
    return None


@torch.library.register_fake("graphexec::attention_py")
def _attention_py_fake(q, k, v, out, layer_id) -> None:
    return None


@torch.library.register_fake("graphexec::paged_attention")
def _paged_attention_fake(q, k, v, out, k_pool, v_pool, layer_id, *metadata) -> None:
    return None


# Whether this thread holds a C++ binding, so that ending a forward that bound nothing costs an
# attribute read.
_bound = threading.local()


def bind_cpu_kernels(*args) -> None:
    """Arm the C++ route of `attention` on this thread for the coming forward (see attention_bind)."""
    torch.ops.graphexec.attention_bind.default(*args)
    _bound.value = True


def unbind_cpu_kernels() -> None:
    """Route `attention` through Python on this thread again (at the end of every forward scope
    of the cpu backend, so a binding never outlives its forward)."""
    if getattr(_bound, "value", False):
        torch.ops.graphexec.attention_unbind.default()
        _bound.value = False


@break_point(ATTENTION)
def unified_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int) -> torch.Tensor:
    out = torch.empty_like(q)
    torch.ops.graphexec.attention.default(q, k, v, out, layer_id)
    return out
