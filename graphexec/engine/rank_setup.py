"""What every rank builds before serving: the checkpoint (its shard), the KV cache, the runner,
and its captured graphs.  Rank 0 (the Engine) and the other tensor-parallel ranks
(graphexec/engine/tp_worker.py) build through the same function, so their capture plans match
collective for collective.  A draft model (speculative.method=draft_model) is built the same way,
on rank 0 alone (`load_draft`)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from graphexec.cache.manager import KVCacheManager
from graphexec.config import EngineConfig, draft_model_source
from graphexec.engine.engine_loop import cuda_index
from graphexec.errors import ConfigError
from graphexec.loader import LoadedCheckpoint
from graphexec.loader.resolve import load_checkpoint
from graphexec.models.tp_layout import TPLayout
from graphexec.parallel.group import SINGLE, TPGroup
from graphexec.parallel.step_channel import NO_PEERS, StepChannel
from graphexec.runner.model_runner import ModelRunner


@dataclass(frozen=True)
class RankParts:
    checkpoint: LoadedCheckpoint
    kv_cache: KVCacheManager
    runner: ModelRunner


def load_and_capture(
    config: EngineConfig, tp: TPGroup = SINGLE, channel: StepChannel = NO_PEERS, capture: bool = True
) -> RankParts:
    """Load and build; capture every bucket now unless `capture` is false (the engine will
    capture them in the background, `ModelRunner.capture_next`).  `channel` announces each step
    to the other ranks (rank 0 of several); a rank with one keeps a journal of its table changes
    to send down it."""
    index = cuda_index(torch.device(config.device))
    if index is not None:
        torch.cuda.set_device(index)  # the current CUDA device is per thread (as in EngineLoop)
    # Each rank reads only its part of the weights and caches only its KV heads.
    checkpoint = load_checkpoint(config.model, config.torch_dtype, tp_size=tp.size, tp_rank=tp.rank)
    return _build(config, checkpoint, tp, channel, capture)


def _build(config: EngineConfig, checkpoint: LoadedCheckpoint, tp: TPGroup, channel: StepChannel, capture: bool) -> RankParts:
    model = checkpoint.config
    max_context = min(config.cache.max_context or model.max_context, model.max_context)
    local = TPLayout.build(model, tp.size, tp.rank).local_config()
    kv_cache = KVCacheManager.from_config(config, local, max_context, journal=channel is not NO_PEERS)
    runner = ModelRunner(config, checkpoint, kv_cache, tp, channel)
    if capture:
        runner.capture()
    return RankParts(checkpoint, kv_cache, runner)


def load_draft(config: EngineConfig, target: LoadedCheckpoint, capture: bool = True) -> RankParts:
    """The draft model's own checkpoint, KV cache (speculative.draft_num_slots slots, else
    cache.num_slots) and runner, under the engine's capture plan (captured now unless `capture`
    is false).  On one rank, whole: the draft model is small, and only rank 0 drafts.
    ConfigError when its vocabulary is not the target's (a draft token would mean another token
    to the target); checked before its KV pool and runner are built."""
    spec = config.speculative
    # No prefix cache: a shadow computes its own request's ids and frees them when it goes.
    cache = replace(config.cache, num_slots=spec.draft_num_slots or config.cache.num_slots, prefix_cache=False)
    draft_config = replace(config, model=draft_model_source(spec), cache=cache)
    checkpoint = load_checkpoint(draft_config.model, draft_config.torch_dtype)
    draft_vocab, target_vocab = checkpoint.config.vocab_size, target.config.vocab_size
    if draft_vocab != target_vocab:
        raise ConfigError(
            f"speculative.draft_model={spec.draft_model!r} has a vocabulary of {draft_vocab} tokens but the "
            f"model {target.config.name!r} has {target_vocab}; a draft model must share the target's vocabulary"
        )
    return _build(draft_config, checkpoint, SINGLE, NO_PEERS, capture)
