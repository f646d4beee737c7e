"""Checkpoint loading: GGUF files and Hugging Face directories, both into Hugging Face tensor names."""

from __future__ import annotations

from graphexec.loader.checkpoint import LoadedCheckpoint
from graphexec.loader.default_model import SMOLLM2_GGUF_FILENAME, default_smollm2_gguf
from graphexec.loader.gguf import load_gguf, load_gguf_tokenizer
from graphexec.loader.hf import load_hf_dir

__all__ = [
    "LoadedCheckpoint",
    "SMOLLM2_GGUF_FILENAME",
    "default_smollm2_gguf",
    "load_gguf",
    "load_gguf_tokenizer",
    "load_hf_dir",
]
