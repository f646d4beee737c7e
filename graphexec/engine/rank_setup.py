"""What every rank builds before serving: the checkpoint (its shard), the KV cache, the runner,
and its captured graphs.  Rank 0 (the Engine) and the other tensor-parallel ranks
(graphexec/engine/tp_worker.py) build through the same function, so their capture plans match
collective for collective."""

from __future__ import annotations

import torch

from graphexec.cache.manager import KVCacheManager
from graphexec.config import EngineConfig
from graphexec.loader import LoadedCheckpoint
from graphexec.loader.resolve import load_checkpoint
from graphexec.models.tp_layout import TPLayout
from graphexec.parallel.group import SINGLE, TPGroup
from graphexec.runner.model_runner import ModelRunner


def load_and_capture(config: EngineConfig, tp: TPGroup = SINGLE, capture: bool = True) -> tuple[LoadedCheckpoint, ModelRunner]:
    """Load and build; capture every bucket now unless `capture` is false (the engine will
    capture them in the background, `ModelRunner.capture_next`)."""
    device = torch.device(config.device)
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)  # the current CUDA device is per thread (as in EngineLoop)
    # Each rank reads only its part of the weights and caches only its KV heads.
    checkpoint = load_checkpoint(config.model, config.torch_dtype, tp_size=tp.size, tp_rank=tp.rank)
    model = checkpoint.config
    max_context = min(config.cache.max_context or model.max_context, model.max_context)
    local = TPLayout.build(model, tp.size, tp.rank).local_config()
    kv_cache = KVCacheManager.from_config(config, local, max_context, tp)
    runner = ModelRunner(config, checkpoint, kv_cache, tp)
    if capture:
        runner.capture()
    return checkpoint, runner
