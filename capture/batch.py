"""What capture/ needs of a batch: the protocol a caller's forward batch implements.

A bucketed backend pads a batch up to a captured size, runs the graph and slices the real rows
back.  It reads and pads only the fields below; every other field rides along unchanged, since
padding makes a copy with `dataclasses.replace` (so the batch must be a dataclass).  The caller
says what a padded row holds (`PaddingPolicy`) and what an empty batch of each phase looks like
(`CaptureEnv.empty_batches`): capture itself knows no KV pool, table or request.
"""

from __future__ import annotations

import enum
from typing import Protocol

import torch


class Phase(enum.Enum):
    """How a backend buckets its batches."""

    ROWS = "rows"  # decode: one token per request; a bucket counts requests, every per-row field pads
    TOKENS = "tokens"  # extend/mixed: a bucket counts tokens; only per-token fields pad


class BucketableBatch(Protocol):
    batch_size: int  # requests (rows, in the ROWS phase)
    num_token_non_padded: int  # real tokens; rows past it are padding
    # The same count on the device, in a fixed-address buffer: set on padded batches only (None on
    # a batch as the caller built it, which has no padding).
    num_token_non_padded_device: torch.Tensor | None
    input_ids: torch.Tensor  # per token
    positions: torch.Tensor  # per token
    out_cache_loc: torch.Tensor  # per token: the KV slot each new token writes
    req_pool_indices: torch.Tensor  # per request
    seq_lens: torch.Tensor  # per request
    seq_lens_cpu: tuple[int, ...]
    seq_lens_sum: int

    @property
    def num_tokens(self) -> int: ...

    @property
    def phase(self) -> Phase:
        """How a backend buckets this batch (graphexec: ROWS for decode/idle, TOKENS for extend/mixed)."""
        ...
