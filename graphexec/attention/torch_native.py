"""Attention in plain torch (SDPA), correct on any device: the reference every other backend matches.

Masks are built once per forward for each distinct sliding window (`AttentionBackend.windows`)
and each layer picks its own window's (Gemma alternates windowed and full layers).  SDPA cannot
soft-cap logits: with a `logit_softcap` the scores are computed explicitly in fp32 instead."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from graphexec.attention.backend import AttentionBackend

if TYPE_CHECKING:
    from graphexec.attention.backend import ForwardContext
    from graphexec.batch.forward_batch import ForwardBatch


@dataclass(frozen=True)
class _DecodeMetadata:
    kv_indices: torch.Tensor  # [rows, max_seq_len] KV slots; unused tail points at the dummy slot
    # window -> [rows, 1, 1, max_seq_len] bool, True where the key is live (and in that window)
    attn_masks: dict[int | None, torch.Tensor]
    rows: torch.Tensor | None = None  # which batch rows (None: all of them, in order)


# Decode rows are attended in groups of this many, sorted by length, each gathering keys up to
# its own longest row: fewer padded keys, and gathered blocks that stay in cache.  Measured on
# 64 rows of 50-380 keys (SmolLM2 heads): 46 ms per layer as one block, 15-17 ms in groups of 8.
_DECODE_GROUP_ROWS = 8


# Query rows per step of the soft-capped (explicit) attention: bounds its fp32 scores.
_SOFTCAP_QUERY_CHUNK = 512


@dataclass(frozen=True)
class _ExtendRun:
    q_start: int
    q_len: int
    kv_indices: torch.Tensor  # [seq_len] KV slots of the whole sequence (prefix + new tokens)
    # window -> [q_len, seq_len] bool; None means plain causal (no prefix, no window that bites)
    attn_masks: dict[int | None, torch.Tensor | None]


class TorchNativeAttnBackend(AttentionBackend):
    _static: _DecodeMetadata | None = None  # [max_rows, max_kv_len] buffers once enabled

    def init_forward_metadata(self, fb: "ForwardBatch", req_to_token: torch.Tensor) -> None:
        if fb.forward_mode.is_extend():
            self._metadata = self._extend_metadata(fb, req_to_token)
        elif self._static is not None and fb.batch_size <= self._static.kv_indices.shape[0]:
            self._metadata = [self._static_decode_metadata(fb, req_to_token)]
        else:
            self._metadata = self._decode_metadata(fb, req_to_token)

    def enable_static_decode_metadata(self, max_rows: int, max_kv_len: int, device: torch.device) -> None:
        # One fixed-address mask per distinct window: a replayed graph's layers each read theirs.
        self._static = _DecodeMetadata(
            kv_indices=torch.zeros(max_rows, max_kv_len, dtype=torch.int64, device=device),
            attn_masks={
                w: torch.zeros(max_rows, 1, 1, max_kv_len, dtype=torch.bool, device=device) for w in self.windows
            },
        )
        self._key_positions = torch.arange(max_kv_len, device=device)

    def _static_decode_metadata(self, fb: "ForwardBatch", req_to_token: torch.Tensor) -> _DecodeMetadata:
        """Shapes depend on the batch size only and addresses never move: safe to replay."""
        bs, max_kv_len = fb.batch_size, self._static.kv_indices.shape[1]
        kv_indices = self._static.kv_indices[:bs]
        kv_indices.copy_(req_to_token[fb.req_pool_indices, :max_kv_len])
        masks = {}
        for window, buffer in self._static.attn_masks.items():
            mask = masks[window] = buffer[:bs]
            torch.lt(self._key_positions[None, :], fb.seq_lens[:, None], out=mask.view(bs, max_kv_len))
            if window is not None:
                # From the device's seq_lens, like the causal bound: a replayed graph windows this step's lengths.
                mask.view(bs, max_kv_len).logical_and_(self._key_positions[None, :] >= fb.seq_lens[:, None] - window)
        return _DecodeMetadata(kv_indices=kv_indices, attn_masks=masks)

    def _decode_metadata(self, fb: "ForwardBatch", req_to_token: torch.Tensor) -> list[_DecodeMetadata]:
        bs = fb.batch_size
        lens = fb.seq_lens_cpu[:bs]
        if bs <= _DECODE_GROUP_ROWS:
            groups = [list(range(bs))]
        else:
            by_len = sorted(range(bs), key=lens.__getitem__)
            groups = [by_len[i : i + _DECODE_GROUP_ROWS] for i in range(0, bs, _DECODE_GROUP_ROWS)]
        device = fb.seq_lens.device
        out = []
        for group in groups:
            rows = None if len(groups) == 1 else torch.tensor(group, device=device)
            max_len = max((lens[i] for i in group), default=1)
            pool_rows = fb.req_pool_indices[:bs] if rows is None else fb.req_pool_indices[rows]
            seq_lens = fb.seq_lens[:bs] if rows is None else fb.seq_lens[rows]
            positions = torch.arange(max_len, device=device)[None, :]
            causal = positions < seq_lens[:, None]
            masks = {}
            for window in self.windows:
                live = causal
                if window is not None:
                    # The row's query sits at seq_len - 1 (decode and verify rows alike): its window
                    # is keys seq_len - W .. seq_len - 1.
                    live = causal & (positions >= seq_lens[:, None] - window)
                masks[window] = live[:, None, None, :]
            out.append(_DecodeMetadata(req_to_token[pool_rows, :max_len], masks, rows))
        return out

    def _extend_metadata(self, fb: "ForwardBatch", req_to_token: torch.Tensor) -> list[_ExtendRun]:
        runs, q_start = [], 0
        rows = fb.req_pool_indices.tolist()
        device = fb.input_ids.device
        for row, prefix, q_len in zip(rows, fb.extend_prefix_lens_cpu, fb.extend_seq_lens_cpu):
            seq_len = prefix + q_len
            masks = {}
            for window in self.windows:
                mask = None
                if prefix or (window is not None and seq_len > window):
                    # Query i sits at position prefix + i and sees keys 0..prefix + i, the last W of them
                    # under a window: prefix + i - W + 1 .. prefix + i.
                    q_pos = torch.arange(prefix, seq_len, device=device)
                    k_pos = torch.arange(seq_len, device=device)[None, :]
                    mask = k_pos <= q_pos[:, None]
                    if window is not None:
                        mask &= k_pos > q_pos[:, None] - window
                masks[window] = mask
            runs.append(_ExtendRun(q_start, q_len, req_to_token[row, :seq_len], masks))
            q_start += q_len
        return runs

    def forward(self, q, k, v, out, layer_id, ctx: "ForwardContext") -> None:
        fb = ctx.forward_batch
        kvh, d = self.num_kv_heads, self.head_dim
        ctx.kv_pool.write(layer_id, fb.out_cache_loc, k.view(-1, kvh, d), v.view(-1, kvh, d))
        k_cache, v_cache = ctx.kv_pool.k_buffers[layer_id], ctx.kv_pool.v_buffers[layer_id]
        window = self.window(layer_id)
        if fb.forward_mode.is_extend():
            self._extend(q, out, k_cache, v_cache, window)
        else:
            self._decode(q, out, k_cache, v_cache, fb.batch_size, window)
        real = fb.num_token_non_padded_device
        if real is not None:
            # A padded batch: rows past the real tokens stay zero (padded extend tokens are in no
            # run, their rows unwritten).  The count is read on the device, so a replayed graph
            # zeroes this step's padding, not the padding of the batch it was captured on.
            out.masked_fill_(torch.arange(out.shape[0], device=out.device)[:, None] >= real, 0)

    def _decode(self, q, out, k_cache, v_cache, bs: int, window: int | None) -> None:
        h, d = self.num_heads, self.head_dim
        for meta in self._metadata:
            n = meta.kv_indices.shape[0]
            keys = _gather(k_cache, meta.kv_indices, q.dtype).transpose(1, 2)  # [n, kvh, max_len, d]
            values = _gather(v_cache, meta.kv_indices, q.dtype).transpose(1, 2)
            queries = (q[:bs] if meta.rows is None else q.index_select(0, meta.rows)).view(n, h, 1, d)
            o = self._attend(queries, keys, values, meta.attn_masks[window], False).reshape(n, h * d)
            if meta.rows is None:
                out[:bs] = o
            else:
                out.index_copy_(0, meta.rows, o)

    def _extend(self, q, out, k_cache, v_cache, window: int | None) -> None:
        h, d = self.num_heads, self.head_dim
        for run in self._metadata:
            queries = q[run.q_start : run.q_start + run.q_len].view(run.q_len, h, d).transpose(0, 1)
            keys = _gather(k_cache, run.kv_indices, q.dtype).transpose(0, 1)  # [kvh, seq_len, d]
            values = _gather(v_cache, run.kv_indices, q.dtype).transpose(0, 1)
            mask = run.attn_masks[window]
            o = self._attend(queries[None], keys[None], values[None], mask, mask is None)
            out[run.q_start : run.q_start + run.q_len] = o[0].transpose(0, 1).reshape(run.q_len, h * d)

    def _attend(self, queries, keys, values, mask: torch.Tensor | None, is_causal: bool) -> torch.Tensor:
        """softmax(scale q k^T, masked) v over [n, heads, len, d] blocks; `mask` broadcasts to the
        scores (True: attended), `is_causal` stands for a plain causal one."""
        h, kvh = self.num_heads, self.num_kv_heads
        if self.logit_softcap is None:
            return F.scaled_dot_product_attention(
                queries, keys, values, attn_mask=mask, is_causal=is_causal, scale=self.scale, enable_gqa=h != kvh
            )
        # Soft-capped (Gemma 2, as transformers' eager attention): cap * tanh(s / cap) before the
        # mask and an fp32 softmax.  SDPA has no hook for it.  Queries go in chunks so that a long
        # prompt's scores never exist whole ([heads, chunk, keys] fp32 at a time).
        if h != kvh:
            keys, values = keys.repeat_interleave(h // kvh, 1), values.repeat_interleave(h // kvh, 1)
        keys_t, values = keys.float().transpose(-1, -2), values.float()
        q_len, k_len = queries.shape[-2], keys.shape[-2]
        if is_causal:
            mask = torch.ones(q_len, k_len, dtype=torch.bool, device=queries.device).tril(k_len - q_len)
        outputs = []
        for q0 in range(0, q_len, _SOFTCAP_QUERY_CHUNK):
            q1 = min(q_len, q0 + _SOFTCAP_QUERY_CHUNK)
            scores = torch.matmul(queries[..., q0:q1, :].float(), keys_t) * self.scale
            scores = torch.tanh(scores / self.logit_softcap) * self.logit_softcap
            if mask is not None:
                scores = scores.masked_fill(~mask[..., q0:q1, :], float("-inf"))
            outputs.append(torch.matmul(torch.softmax(scores, dim=-1), values))
        return torch.cat(outputs, dim=-2).to(queries.dtype)


def _gather(cache: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """cache[slots] for any shape of slots, as `dtype` (cache.dtype may differ from the model's).
    index_select on the flattened slots, because advanced indexing takes 4-6x longer on CPU
    (measured: 32 x 320 slots of [3, 64] fp32, 4.8 vs 1.2 ms), and this gather is most of a
    decode step's attention."""
    return cache.index_select(0, slots.reshape(-1)).view(*slots.shape, *cache.shape[1:]).to(dtype)
