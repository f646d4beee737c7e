"""Which part of the model one tensor-parallel rank owns (Megatron-style), from the shapes alone.

Query heads split evenly; KV heads split evenly when there are at least as many as ranks, else
each rank keeps a copy of the one KV head its query heads read (SmolLM2: 9 query, 3 KV heads;
tp_size 3 gives each rank 3 query heads and 1 KV head; tiny-llama at tp_size 4 replicates each of
its 2 KV heads on 2 ranks).  MLP rows (gate/up outputs, down inputs) split in 32-element units
when the size allows, so a block-quantized down_proj is cut on block boundaries; a mixture's
experts split the same way, every expert its own rows of moe_intermediate_size (the router stays
whole on every rank; each rank's experts sum a part of each row, like a dense MLP's).  The vocabulary
is padded to a multiple of tp_size; the padding rows exist only in the logits gather and are
dropped after it.  Every unsupported combination is a ConfigError naming `parallel.tp_size`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from graphexec.errors import ConfigError
from graphexec.models.config import ModelConfig
from graphexec.quant.ops import QBLOCK

Span = tuple[int, int]  # [start, stop)


@dataclass(frozen=True)
class TPLayout:
    config: ModelConfig  # the whole model's
    size: int
    rank: int
    q_heads: Span
    kv_heads: Span
    intermediate: Span
    vocab: Span  # real vocabulary rows this rank holds (may be shorter than vocab_shard)
    vocab_shard: int  # padded rows per rank: every rank's logits are this wide in the gather
    moe_intermediate: Span = (0, 0)  # every expert's rows this rank holds (a mixture of experts)
    shared_intermediate: Span = (0, 0)  # the shared expert's (Qwen2-MoE)

    @classmethod
    def build(cls, config: ModelConfig, size: int = 1, rank: int = 0) -> "TPLayout":
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} outside a tensor-parallel group of {size}")
        _check(config, size)
        heads = config.num_heads // size
        if config.num_kv_heads >= size:
            kv_per = config.num_kv_heads // size
            kv_heads = (rank * kv_per, (rank + 1) * kv_per)
        else:
            # Every query head of this rank maps to one KV head (tp_size % num_kv_heads == 0).
            group = config.num_heads // config.num_kv_heads
            kv = rank * heads // group
            kv_heads = (kv, kv + 1)
        shard = -(-config.vocab_size // size)
        vocab = (min(rank * shard, config.vocab_size), min((rank + 1) * shard, config.vocab_size))
        return cls(
            config=config, size=size, rank=rank,
            q_heads=(rank * heads, (rank + 1) * heads),
            kv_heads=kv_heads,
            intermediate=_unit_span(config.intermediate_size, size, rank),
            vocab=vocab,
            vocab_shard=shard,
            moe_intermediate=_unit_span(config.moe_intermediate_size, size, rank),
            shared_intermediate=_unit_span(config.shared_expert_intermediate_size, size, rank),
        )

    @property
    def is_sharded(self) -> bool:
        return self.size > 1

    def local_config(self) -> ModelConfig:
        """What this rank's layers, KV cache and attention backend see.  vocab_size stays the
        whole vocabulary: batches, the sampler and the gathered logits are not sharded."""
        return dataclasses.replace(
            self.config,
            num_heads=_len(self.q_heads),
            num_kv_heads=_len(self.kv_heads),
            intermediate_size=_len(self.intermediate),
            moe_intermediate_size=_len(self.moe_intermediate),
            shared_expert_intermediate_size=_len(self.shared_intermediate),
        )

    @property
    def vocab_rows(self) -> int:
        return _len(self.vocab)

    def q_rows(self) -> Span:
        return _scale(self.q_heads, self.config.head_dim)

    def kv_rows(self) -> Span:
        return _scale(self.kv_heads, self.config.head_dim)


def _check(config: ModelConfig, size: int) -> None:
    heads = f"the model has {config.num_heads} query and {config.num_kv_heads} KV heads"
    if size < 1:
        raise ConfigError(f"parallel.tp_size must be >= 1, got {size}")
    if config.num_heads % size:
        raise ConfigError(f"parallel.tp_size={size} must divide the query heads: {heads}")
    if config.num_kv_heads >= size and config.num_kv_heads % size:
        raise ConfigError(f"parallel.tp_size={size} must divide the KV heads when it does not exceed them: {heads}")
    if config.num_kv_heads < size and size % config.num_kv_heads:
        raise ConfigError(
            f"parallel.tp_size={size} exceeds the KV heads, so it must be a multiple of them (each KV head "
            f"replicated on tp_size / num_kv_heads ranks): {heads}"
        )
    widths = {"intermediate_size": config.intermediate_size}
    if config.num_experts:
        widths["moe_intermediate_size"] = config.moe_intermediate_size
    if config.shared_expert_intermediate_size:
        widths["shared_expert_intermediate_size"] = config.shared_expert_intermediate_size
    for name, width in widths.items():
        unit = QBLOCK if width % QBLOCK == 0 else 1
        if width // unit < size:
            raise ConfigError(f"parallel.tp_size={size} exceeds the MLP's {width // unit} units of {unit} ({name} {width})")


def _unit_span(total: int, size: int, rank: int) -> Span:
    """[start, stop) of rank's share of `total`, in 32-element units when total allows (the
    first ranks take one unit more when they do not divide evenly)."""
    unit = QBLOCK if total % QBLOCK == 0 else 1
    units = total // unit
    base, extra = divmod(units, size)
    start = rank * base + min(rank, extra)
    stop = start + base + (1 if rank < extra else 0)
    return (start * unit, stop * unit)


def _len(span: Span) -> int:
    return span[1] - span[0]


def _scale(span: Span, factor: int) -> Span:
    return (span[0] * factor, span[1] * factor)
