"""Resolve a model config entry to a loaded checkpoint (config, weights, tokenizer)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

import torch

from graphexec.config import ModelSourceConfig
from graphexec.errors import ConfigError
from graphexec.loader import LoadedCheckpoint, default_smollm2_gguf, load_gguf, load_hf_dir
from graphexec.models.config import ModelConfig, RopeScaling
from graphexec.models.random_weights import random_state_dict
from graphexec.models.rope import with_long_factors
from graphexec.models.sharding import shard_state_dict
from graphexec.models.tp_layout import TPLayout
from graphexec.text.tokenizer import ByteTokenizer


def load_checkpoint(source: ModelSourceConfig, dtype: torch.dtype, tp_size: int = 1, tp_rank: int = 0) -> LoadedCheckpoint:
    """The checkpoint, its weights cut for tensor-parallel rank tp_rank of tp_size while reading."""
    checkpoint = _load(source, dtype, tp_size, tp_rank)
    if not source.rope_long_factors:
        return checkpoint
    try:
        return replace(checkpoint, config=with_long_factors(checkpoint.config))
    except ValueError as err:
        raise ConfigError(f"model.rope_long_factors=true: {err}") from err


def _load(source: ModelSourceConfig, dtype: torch.dtype, tp_size: int, tp_rank: int) -> LoadedCheckpoint:
    if source.source == "gguf":
        path = source.path if source.path is not None else default_smollm2_gguf()
        return load_gguf(path, name=source.name, dtype=dtype, weights=source.weights, tp_size=tp_size, tp_rank=tp_rank)
    if source.source == "hf":
        return load_hf_dir(source.path, name=source.name, dtype=dtype, tp_size=tp_size, tp_rank=tp_rank)
    whole = _random_checkpoint(source, dtype)
    if tp_size == 1:
        return whole
    # Random weights are generated whole (one seed, one stream) and then cut.
    layout = TPLayout.build(whole.config, tp_size, tp_rank)
    return replace(whole, state_dict=shard_state_dict(whole.state_dict, layout), tp_shard=(tp_size, tp_rank))


def _random_checkpoint(source: ModelSourceConfig, dtype: torch.dtype) -> LoadedCheckpoint:
    tokenizer = ByteTokenizer(vocab_size=source.architecture.get("vocab_size", 0))
    architecture = dict(source.architecture)
    try:
        if isinstance(architecture.get("rope_scaling"), Mapping):  # as a YAML spells it
            scaling = dict(architecture["rope_scaling"])
            for key in ("short_factor", "long_factor"):
                if scaling.get(key) is not None:
                    scaling[key] = tuple(scaling[key])
            architecture["rope_scaling"] = RopeScaling(**scaling)
        config = ModelConfig(
            name=source.name,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_ids=tuple(tokenizer.eos_token_ids),
            **architecture,
        )
    except (TypeError, ValueError) as err:
        raise ConfigError(f"model.architecture of {source.name!r} is incomplete or has unknown fields: {err}") from err
    state_dict = {k: v.to(dtype) for k, v in random_state_dict(config, source.seed).items()}
    return LoadedCheckpoint(config=config, state_dict=state_dict, tokenizer=tokenizer)
