"""The padding policy: what every padded field holds in rows added to reach a bucket.

Padded rows must be inert: the caller's policy points them at a request row and a KV slot that
hold nothing live (graphexec: the dummy row and the dummy slot), and they sit after
`num_token_non_padded`, so no consumer downstream ever reads them.  A padded batch also carries
that count on the device (`num_token_non_padded_device`, a fixed-address buffer rewritten before
every run): code inside a replayed graph reads the count there, where the host int would be the
one frozen at capture.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TypeVar

import torch

from capture.batch import BucketableBatch, Phase

Batch = TypeVar("Batch", bound=BucketableBatch)


@dataclass(frozen=True)
class PaddingPolicy:
    """Fill values of padded rows, declared by the caller (graphexec: forward_batch.padding_policy)."""

    req_pool_index: int  # a request row whose table maps nothing live
    out_cache_loc: int  # a KV slot nothing reads as live KV
    seq_len: int  # a length the attention kernels accept for a padded row
    input_id: int = 0
    position: int = 0


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
        self.num_token_non_padded = torch.zeros(1, dtype=torch.int64, device=device)

    def load(self, fb: Batch, bucket: int, policy: PaddingPolicy) -> Batch:
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
            num_token_non_padded_device=self._real_count(fb),
        )

    def load_tokens(self, fb: Batch, bucket: int, policy: PaddingPolicy) -> Batch:
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
            num_token_non_padded_device=self._real_count(fb),
        )

    def _real_count(self, fb: BucketableBatch) -> torch.Tensor:
        self.num_token_non_padded.fill_(fb.num_token_non_padded)
        return self.num_token_non_padded

    def dummy_batch(self, bucket: int, policy: PaddingPolicy, phase: Phase, empty: Batch) -> Batch:
        """`empty` (a batch with no rows) padded to `bucket` rows: what capture and warm-up run on."""
        if phase is Phase.TOKENS:
            return self.load_tokens(empty, bucket, policy)
        return self.load(empty, bucket, policy)


def _copy_then_fill(n: int, bucket: int, *fields: tuple[torch.Tensor, torch.Tensor, int]) -> None:
    """For each (static buffer, live values, fill): rows [0, n) get the live values, rows
    [n, bucket) the policy's fill."""
    for buffer, live, fill in fields:
        buffer[:n].copy_(live)
        buffer[n:bucket].fill_(fill)
