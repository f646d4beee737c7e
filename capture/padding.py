"""The padding policy: what every ForwardBatch field holds in rows added to reach a bucket.

Padded rows must be inert: they read the dummy request row (whose table entries all point at
the dummy KV slot), write only the dummy slot, and sit after `num_token_non_padded`, so no
consumer downstream ever reads them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from graphexec.forward_batch import ForwardBatch
from graphexec.kv_pool import DUMMY_SLOT
from graphexec.req_to_token_pool import DUMMY_REQ_ROW


@dataclass(frozen=True)
class PaddingPolicy:
    input_id: int = 0
    position: int = 0
    req_pool_index: int = DUMMY_REQ_ROW
    out_cache_loc: int = DUMMY_SLOT
    # Declared by the attention backend: a length its kernels accept for a padded row.
    seq_len: int = 1


class StaticInputs:
    """Per-row input buffers sized for the largest bucket; a bucket uses a prefix slice.

    Decode pads requests (`load`: every per-row field); extend pads tokens (`load_tokens`).

    The addresses never change, which is what a captured CUDA graph requires; the CPU compiled
    path uses the very same buffers so the same code is tested everywhere.
    """

    def __init__(self, max_rows: int, device: torch.device):
        def buf() -> torch.Tensor:
            return torch.zeros(max_rows, dtype=torch.int64, device=device)

        self.max_rows = max_rows
        self.input_ids, self.positions, self.req_pool_indices = buf(), buf(), buf()
        self.seq_lens, self.out_cache_loc = buf(), buf()

    def load(self, fb: ForwardBatch, bucket: int, policy: PaddingPolicy) -> ForwardBatch:
        """Copy fb's rows in, fill rows [n, bucket) by the policy, return the padded view."""
        n = fb.batch_size
        if not n <= bucket <= self.max_rows:
            raise ValueError(f"batch of {n} rows does not fit bucket {bucket} (buffers hold {self.max_rows})")
        _copy_then_fill(
            n,
            bucket,
            (self.input_ids, fb.input_ids, policy.input_id),
            (self.positions, fb.positions, policy.position),
            (self.req_pool_indices, fb.req_pool_indices, policy.req_pool_index),
            (self.seq_lens, fb.seq_lens, policy.seq_len),
            (self.out_cache_loc, fb.out_cache_loc, policy.out_cache_loc),
        )
        pad = bucket - n
        seq_lens_cpu = fb.seq_lens_cpu + (policy.seq_len,) * pad
        return dataclasses.replace(
            fb,
            batch_size=bucket,
            input_ids=self.input_ids[:bucket],
            positions=self.positions[:bucket],
            req_pool_indices=self.req_pool_indices[:bucket],
            seq_lens=self.seq_lens[:bucket],
            seq_lens_cpu=seq_lens_cpu,
            seq_lens_sum=sum(seq_lens_cpu),
            out_cache_loc=self.out_cache_loc[:bucket],
            num_token_non_padded=fb.num_token_non_padded,
        )

    def load_tokens(self, fb: ForwardBatch, bucket: int, policy: PaddingPolicy) -> ForwardBatch:
        """Extend/mixed: pad the token rows only; the per-request layout (extend_* fields,
        seq_lens) stays that of the real requests, so attention never sees a padded token."""
        n = fb.num_tokens
        if not n <= bucket <= self.max_rows:
            raise ValueError(f"batch of {n} tokens does not fit bucket {bucket} (buffers hold {self.max_rows})")
        _copy_then_fill(
            n,
            bucket,
            (self.input_ids, fb.input_ids, policy.input_id),
            (self.positions, fb.positions, policy.position),
            (self.out_cache_loc, fb.out_cache_loc, policy.out_cache_loc),
        )
        return dataclasses.replace(
            fb,
            input_ids=self.input_ids[:bucket],
            positions=self.positions[:bucket],
            out_cache_loc=self.out_cache_loc[:bucket],
            num_token_non_padded=fb.num_token_non_padded,
        )

    def dummy_batch(self, bucket: int, policy: PaddingPolicy, mode) -> ForwardBatch:
        """A batch of `bucket` padding rows only: what capture and warm-up run on."""
        empty = ForwardBatch.empty(mode, self.input_ids.device)
        if mode.is_extend():
            return self.load_tokens(empty, bucket, policy)
        return self.load(empty, bucket, policy)


def _copy_then_fill(n: int, bucket: int, *fields: tuple[torch.Tensor, torch.Tensor, int]) -> None:
    """For each (static buffer, live values, fill): rows [0, n) get the live values, rows
    [n, bucket) the policy's fill."""
    for buffer, live, fill in fields:
        buffer[:n].copy_(live)
        buffer[n:bucket].fill_(fill)
