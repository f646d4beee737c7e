"""Cut an FX graph at every call of a set of ops: [piece, op, piece, op, ..., piece].

A pure function over a GraphModule (no compiler, no model): the tc_piecewise backend splits the
one Dynamo trace of the forward with it, compiles the pieces and runs the split ops eagerly.

Ops are named by qualified name ("graphexec::attention"), whatever form the graph holds them
in: Dynamo records a custom op as its OpOverloadPacket, AOT graphs hold the OpOverload.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable, Collection

import torch
from torch.fx import GraphModule, Node
from torch.fx.passes.split_module import split_module


@dataclass(frozen=True)
class Piece:
    """One submodule of a split graph: `name` is its attribute on `SplitGraph.module`."""

    name: str
    is_split_op: bool


@dataclass(frozen=True)
class SplitGraph:
    # Calls its pieces in the original node order; same inputs and outputs as the graph it cut.
    module: GraphModule
    pieces: tuple[Piece, ...]  # in call order

    @property
    def num_splits(self) -> int:
        return sum(p.is_split_op for p in self.pieces)

    @property
    def num_pieces(self) -> int:
        """Pieces between split ops: what a backend compiles."""
        return sum(not p.is_split_op for p in self.pieces)


def op_qualname(target: Any) -> str | None:
    """'namespace::name' of an op call target (overload or packet); None for anything else."""
    if isinstance(target, torch._ops.OpOverload):
        target = target.overloadpacket
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name
    return None


def is_split_node(node: Node, split_ops: Collection[str]) -> bool:
    return node.op == "call_function" and op_qualname(node.target) in split_ops


def split_at_ops(gm: GraphModule, split_ops: Collection[str]) -> SplitGraph:
    """Partition `gm`: each split-op call alone in its own piece, the runs between them in one
    piece each.  Back-to-back split ops get no empty piece between them.  The original graph is
    left as it was."""
    partition_of: dict[Node, int] = {}
    current, current_used = 0, False
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if is_split_node(node, split_ops):
            if current_used:
                current += 1
            partition_of[node] = current
            current, current_used = current + 1, False
        else:
            partition_of[node], current_used = current, True

    # keep_original_order: a split op that mutates an argument (attention writes `out`) has no
    # data edge to the piece that reads the result, so a topological order of the pieces could
    # run the reader first.  The original order is the only correct one.
    module = split_module(
        gm, None, lambda node: partition_of[node], keep_original_order=True, **tuple_return_kwargs(split_module)
    )
    pieces = tuple(
        Piece(node.target, _holds_split_op(getattr(module, node.target), split_ops))
        for node in module.graph.nodes
        if node.op == "call_module"
    )
    return SplitGraph(module=module, pieces=pieces)


def tuple_return_kwargs(split: Callable[..., Any]) -> dict[str, bool]:
    """`tuple_return=True` where `split` takes it (torch >= 2.12): every piece then returns a
    tuple, the convention inductor compiles to.  torch 2.11 (the GPU image's) lacks the option: a
    one-output piece returns its value bare and the split module's code uses it bare, which runs
    the same, since compile_fx compiles a graph that returns no tuple into a callable returning
    the same structure (tests/test_tc_piecewise.py covers both)."""
    return {"tuple_return": True} if "tuple_return" in inspect.signature(split).parameters else {}


def _holds_split_op(piece: GraphModule, split_ops: Collection[str]) -> bool:
    return any(is_split_node(node, split_ops) for node in piece.graph.nodes)


@dataclass(frozen=True)
class _Ref:
    """An argument that is another node: by position, so node names do not matter."""

    index: int

    def __repr__(self) -> str:
        return f"%{self.index}"


def structure_key(gm: GraphModule) -> str:
    """Equal for two graphs that compute the same thing from their inputs, whatever their node
    names: the repeated middle pieces of a forward (o_proj, MLP, next layer's qkv and rope) differ
    only in names, so one compiled piece can serve them all.  Valid within one process only:
    functions and attributes a graph uses are keyed by identity, so a graph that reads
    attributes (get_attr, call_module) is equal only to itself."""
    index = {node: i for i, node in enumerate(gm.graph.nodes)}
    parts = []
    for node in gm.graph.nodes:
        args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: _Ref(index[n]))
        parts.append(repr((node.op, _target_key(gm, node), args, kwargs)))
    return "\n".join(parts)


def _target_key(gm: GraphModule, node: Node) -> Any:
    if node.op == "placeholder":
        return None  # its target is its name
    if node.op in ("get_attr", "call_module"):
        value: Any = gm
        for name in node.target.split("."):
            value = getattr(value, name)
        return node.target, id(value)
    if node.op == "call_function":
        return str(node.target), id(node.target)
    return node.target  # call_method: the method name; output: "output"
