"""Cutting one Hugging Face-named tensor down to a tensor-parallel rank's part (before q/k/v and
gate/up are fused), for dense tensors, packed QuantizedWeights and GGUF BlockWeights alike.

Every cut is one contiguous span of one dimension (graphexec/models/tp_layout.py): output rows
for the column-parallel q/k/v (per head), gate/up and the vocabulary (embedding, LM head); input
columns for the row-parallel o_proj and down_proj.  A mixture's stacked experts ([experts, rows,
cols]) are cut the same way one dimension further in: every expert keeps the same rows.  Loaders apply the same `Cut` to the file's
bytes while reading (graphexec/loader/), so a rank never holds the whole model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from graphexec.errors import ConfigError
from graphexec.models.tp_layout import TPLayout
from graphexec.quant import BlockWeight, QuantizedWeight, StackedBlocks, StackedQuantized, Weight, block_elements
from graphexec.quant.ops import QBLOCK



@dataclass(frozen=True)
class Cut:
    dim: int  # 0: output rows (or a 1-D bias), 1: input columns (stacked experts: 1 rows, 2 columns)
    start: int
    stop: int

    def shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        out = list(shape)
        out[self.dim] = self.stop - self.start
        return tuple(out)


def cut_for(name: str, layout: TPLayout) -> Cut | None:
    """How `name` (a Hugging Face tensor name) is cut for layout's rank; None: every rank keeps it whole."""
    if not layout.is_sharded:
        return None
    name = name.removeprefix("model.")
    if name in ("embed_tokens.weight", "lm_head.weight"):
        return Cut(0, *layout.vocab)
    parts = name.split(".")  # layers.<i>.<self_attn|mlp>.<module>.<weight|bias>
    if len(parts) == 6 and parts[0] == "layers" and parts[3] in ("experts", "shared_expert"):
        return _expert_cut(parts[3], parts[4], layout)
    if len(parts) != 5 or parts[0] != "layers":
        return None
    module, kind = parts[3], parts[4]
    if module == "q_proj":
        return Cut(0, *layout.q_rows())
    if module in ("k_proj", "v_proj"):
        return Cut(0, *layout.kv_rows())
    if module in ("gate_proj", "up_proj"):
        return Cut(0, *layout.intermediate)
    # Row-parallel: the input columns are cut; a bias (none in these models) would stay whole.
    if module == "o_proj" and kind == "weight":
        return Cut(1, *layout.q_rows())
    if module == "down_proj" and kind == "weight":
        return Cut(1, *layout.intermediate)
    return None


def _expert_cut(group: str, module: str, layout: TPLayout) -> Cut | None:
    """layers.<i>.mlp.experts.<proj>.weight (stacked: the expert dimension first) or
    layers.<i>.mlp.shared_expert.<proj>.weight (a dense MLP of its own width)."""
    stacked = group == "experts"
    span = layout.moe_intermediate if stacked else layout.shared_intermediate
    if module in ("gate_proj", "up_proj"):
        return Cut(int(stacked), *span)
    if module == "down_proj":
        return Cut(1 + int(stacked), *span)
    return None


def cut_weight(name: str, weight: Weight, cut: Cut | None) -> Weight:
    """weight's part under `cut` (a copy, so the whole tensor can be freed)."""
    if cut is None:
        return weight
    if isinstance(weight, QuantizedWeight):
        return _cut_quantized(name, weight, cut)
    if isinstance(weight, BlockWeight):
        if cut.dim == 0:
            return weight.map_rows(lambda t: t[cut.start : cut.stop].clone())
        check_block_cut(name, cut, weight.qtype)
        return weight.columns(cut.start, cut.stop)
    if isinstance(weight, StackedBlocks):
        return _cut_stacked(name, weight, cut)
    if isinstance(weight, StackedQuantized):
        return _cut_stacked_quantized(name, weight, cut)
    return weight.narrow(cut.dim, cut.start, cut.stop - cut.start).clone()


def _cut_stacked_quantized(name: str, weight: StackedQuantized, cut: Cut) -> StackedQuantized:
    if cut.dim == 1:
        return weight.map(lambda t, _: t[:, cut.start : cut.stop].clone())
    check_block_cut(name, Cut(1, cut.start, cut.stop), weight.qtype)  # columns: whole blocks only
    return weight.map(lambda t, per_column: t[:, :, cut.start // per_column : cut.stop // per_column].clone())


def _cut_stacked(name: str, weight: StackedBlocks, cut: Cut) -> StackedBlocks:
    if cut.dim == 1:
        return StackedBlocks(weight.qtype, weight.blocks[:, cut.start : cut.stop].clone())
    check_block_cut(name, Cut(1, cut.start, cut.stop), weight.qtype)  # columns: whole blocks only
    fmt = weight.format
    columns = slice(cut.start // fmt.elements * fmt.nbytes, cut.stop // fmt.elements * fmt.nbytes)
    return StackedBlocks(weight.qtype, weight.blocks[:, :, columns].clone())


def check_block_cut(name: str, cut: Cut, qtype: str) -> None:
    """A packed weight's input dimension can be cut only between its type's blocks (32 elements,
    256 for K-quant super-blocks)."""
    block = block_elements(qtype)
    if cut.dim == 1 and (cut.start % block or cut.stop % block):
        raise ConfigError(
            f"{name}: parallel.tp_size cuts its input columns at [{cut.start}, {cut.stop}), inside a "
            f"{block}-element {qtype} block; load with model.weights=dequantize or pick another tp_size"
        )


def _cut_quantized(name: str, weight: QuantizedWeight, cut: Cut) -> QuantizedWeight:
    if cut.dim == 0:
        return weight.map_rows(lambda t: t[cut.start : cut.stop].clone())
    check_block_cut(name, cut, weight.qtype)
    b0, b1 = cut.start // QBLOCK, cut.stop // QBLOCK
    per_block = weight.codes.shape[1] // weight.scales.shape[1]  # bytes of codes per block
    codes = weight.codes[:, b0 * per_block : b1 * per_block].clone()
    mins = None if weight.mins is None else weight.mins[:, b0:b1].clone()
    return QuantizedWeight(weight.qtype, codes, weight.scales[:, b0:b1].clone(), mins)


def shard_state_dict(state_dict: Mapping[str, Weight], layout: TPLayout) -> dict[str, Weight]:
    """A whole Hugging Face-named state dict cut for layout's rank (random weights, tests)."""
    return {name: cut_weight(name, w, cut_for(name, layout)) for name, w in state_dict.items()}
