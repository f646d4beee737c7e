"""Load a Hugging Face checkpoint directory (config.json + *.safetensors) of a family graphexec
runs (graphexec/loader/hf_config.py says which, and refuses the rest); a mixture's experts are
stacked per layer (graphexec/loader/experts.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from graphexec.errors import CheckpointError
from graphexec.loader.checkpoint import LoadedCheckpoint, check_state_dict
from graphexec.loader.experts import stack_experts
from graphexec.loader.fused import is_fused, split_fused
from graphexec.loader.hf_config import model_config
from graphexec.models.config import ModelConfig
from graphexec.models.sharding import Cut, cut_for, cut_weight
from graphexec.models.tp_layout import TPLayout
from graphexec.text.tokenizer import Tokenizer


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise CheckpointError(f"cannot read {path}: {error}") from error


def _token_ids(value: Any) -> list[int]:
    """eos_token_id may be absent, one id, or a list of ids."""
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def _config(config: dict[str, Any], generation: dict[str, Any], name: str, has_lm_head: bool, path: Path):
    eos_ids = _token_ids(config.get("eos_token_id")) + _token_ids(generation.get("eos_token_id"))
    return model_config(config, name, has_lm_head, eos_ids, path)


def _read_safetensors(files: list[Path], keep, layout: TPLayout, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The tensors `keep(key)` accepts, each cut for layout's rank through safetensors' lazy
    slices: only the rank's part of each tensor is read from the file.  A fused tensor (Phi-3)
    is read whole, split per projection, then cut."""
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            with safe_open(file, framework="pt") as f:
                for key in f.keys():
                    if not keep(key):
                        continue
                    if is_fused(key):
                        for part, weight in split_fused(key, f.get_tensor(key), layout.config).items():
                            tensors[part] = cut_weight(part, weight, cut_for(part, layout)).to(dtype)
                    else:
                        tensors[key] = _read_part(f, key, cut_for(key, layout)).to(dtype)
        except Exception as error:  # safetensors raises its own SafetensorError besides OSError
            raise CheckpointError(f"cannot read {file}: {error}") from error
    return tensors


def _read_part(f, key: str, cut: Cut | None) -> torch.Tensor:
    if cut is None:
        return f.get_tensor(key)
    part = f.get_slice(key)
    return part[cut.start : cut.stop] if cut.dim == 0 else part[:, cut.start : cut.stop]


def _keys(files: list[Path]) -> set[str]:
    keys: set[str] = set()
    for file in files:
        try:
            with safe_open(file, framework="pt") as f:
                keys.update(f.keys())
        except Exception as error:
            raise CheckpointError(f"cannot read {file}: {error}") from error
    return keys


def _unused(key: str, config: ModelConfig) -> bool:
    """Tensors a checkpoint may carry that a causal LM with this config has no use for."""
    if key.endswith("rotary_emb.inv_freq"):  # recomputed from rope_theta
        return True
    # Some tied checkpoints still store a copy of the embedding as the head.
    return key == "lm_head.weight" and config.tie_word_embeddings


def load_hf_dir(
    path: str | Path, name: str, dtype: torch.dtype = torch.float32, tp_size: int = 1, tp_rank: int = 0
) -> LoadedCheckpoint:
    """Load config.json, every *.safetensors file, and the tokenizer if the directory has one;
    with tp_size > 1, only tp_rank's part of each tensor (graphexec/models/sharding.py)."""
    directory = Path(path)
    if not directory.is_dir():
        raise CheckpointError(f"checkpoint directory not found: {directory}")
    config_file = directory / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"no config.json in {directory}")
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors files in {directory}")
    generation_file = directory / "generation_config.json"
    generation = _read_json(generation_file) if generation_file.is_file() else {}
    keys = _keys(files)
    try:
        config = _config(_read_json(config_file), generation, name, "lm_head.weight" in keys, config_file)
    except (KeyError, TypeError) as error:
        raise CheckpointError(f"{config_file}: missing or malformed field {error}") from error
    layout = TPLayout.build(config, tp_size, tp_rank)
    state_dict = _read_safetensors(files, lambda key: not _unused(key, config), layout, dtype)
    # Per-expert tensors were read whole; their stacks are cut here (the rest was cut while read).
    stacked = stack_experts(state_dict, config, directory)
    state_dict = {k: w if k in state_dict else cut_weight(k, w, cut_for(k, layout)) for k, w in stacked.items()}
    check_state_dict(config, state_dict, directory, layout)
    tokenizer = Tokenizer.from_hf_dir(directory) if (directory / "tokenizer.json").is_file() else None
    return LoadedCheckpoint(config=config, state_dict=state_dict, tokenizer=tokenizer, tp_shard=(tp_size, tp_rank))
