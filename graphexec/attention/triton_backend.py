"""The `triton` attention backend: paged decode and extend kernels (attention/triton_kernels.py,
launched as ops by attention/triton_ops.py) that read the KV pool in place through the
request -> token table, on GPU tensors, or on CPU tensors through Triton's interpreter
(TRITON_INTERPRET=1, for tests).

Graph-ready decode: a launch reads only fixed-address tensors (the batch's req_pool_indices and
seq_lens, which a captured batch's static inputs already are; the table; the pool; a workspace
allocated once), and its grid depends on the bucket alone: rows x KV heads x a split count fixed
when static metadata is enabled.  Each row splits its own keys on the device, by its length of
this step.  So a replayed graph needs nothing rewritten but the static inputs the capture backend
writes anyway.  A padded row points at the dummy table row with length `padded_seq_len`: it
reads the dummy slot and nothing else, and its output is zeroed like torch_native's.

triton is imported when this backend is built, never by `import graphexec`.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING

import torch

from graphexec.attention.backend import AttentionBackend
from graphexec.errors import ConfigError

if TYPE_CHECKING:
    from graphexec.attention.backend import ForwardContext, Windows
    from graphexec.batch.forward_batch import ForwardBatch


def load_kernels() -> ModuleType:
    """The launch module (imports triton, registers the ops); a ConfigError naming the option if
    triton is missing."""
    try:
        from graphexec.attention import triton_ops
    except ImportError as error:
        raise ConfigError(
            f"attention_backend=triton needs the triton package ({error}); install graphexec[gpu] "
            "or choose attention_backend=auto"
        ) from error
    return triton_ops


@dataclass(frozen=True)
class _DecodeWorkspace:
    """Per-split partial results of a decode, shared by every layer (they run one at a time)."""

    acc: torch.Tensor  # [rows, heads, splits, head_dim] fp32
    lse: torch.Tensor  # [rows, heads, splits] fp32
    num_splits: int  # the grid's split dimension

    @classmethod
    def allocate(cls, rows: int, heads: int, head_dim: int, num_splits: int, device) -> "_DecodeWorkspace":
        return cls(
            acc=torch.empty(rows, heads, num_splits, head_dim, dtype=torch.float32, device=device),
            lse=torch.empty(rows, heads, num_splits, dtype=torch.float32, device=device),
            num_splits=num_splits,
        )


class TritonAttnBackend(AttentionBackend):
    # A padded decode row attends to one key: the dummy table row's first entry, the dummy slot.
    padded_seq_len = 1

    @classmethod
    def check_device(cls, device: torch.device) -> None:
        kernels = load_kernels()
        if device.type == "cpu" and not kernels.INTERPRETED:
            raise ConfigError(
                "attention_backend=triton on the CPU runs Triton's interpreter, which needs TRITON_INTERPRET=1 "
                "in the environment before triton is first imported; on the CPU choose attention_backend=cpu "
                "(or auto)"
            )

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, sliding_window: "Windows" = None,
                 scale: float | None = None, logit_softcap: float | None = None):  # fmt: skip
        super().__init__(num_heads, num_kv_heads, head_dim, sliding_window, scale, logit_softcap)
        self._softcap = self.logit_softcap or 0.0  # the kernels' "no softcap"
        if num_heads % num_kv_heads:
            raise ConfigError(
                f"attention_backend=triton needs num_heads ({num_heads}) a multiple of num_kv_heads ({num_kv_heads})"
            )
        self._kernels = load_kernels()
        self._static: _DecodeWorkspace | None = None
        self._req_to_token: torch.Tensor | None = None
        self._workspace: _DecodeWorkspace | None = None  # this decode's
        self._max_extend_len = 0  # this extend's (its grid)

    def enable_static_decode_metadata(self, max_rows: int, max_kv_len: int, device: torch.device) -> None:
        splits = self._kernels.num_splits_for(max_kv_len)
        self._static = _DecodeWorkspace.allocate(max_rows, self.num_heads, self.head_dim, splits, device)

    def init_forward_metadata(self, fb: "ForwardBatch", req_to_token: torch.Tensor) -> None:
        self._req_to_token = req_to_token
        if fb.forward_mode.is_extend():
            self._max_extend_len = max(fb.extend_seq_lens_cpu, default=0)
        elif self._static is not None and fb.batch_size <= self._static.acc.shape[0]:
            # The grid of a captured bucket: never sized by this batch's lengths.
            self._workspace = self._static
        else:
            splits = self._kernels.num_splits_for(max(fb.seq_lens_cpu, default=1))
            self._workspace = _DecodeWorkspace.allocate(
                fb.batch_size, self.num_heads, self.head_dim, splits, req_to_token.device
            )

    def end_forward(self) -> None:
        self._req_to_token = self._workspace = None

    def forward(self, q, k, v, out, layer_id, ctx: "ForwardContext") -> None:
        fb = ctx.forward_batch
        h, kvh, d = self.num_heads, self.num_kv_heads, self.head_dim
        ctx.kv_pool.write(layer_id, fb.out_cache_loc, k.view(-1, kvh, d), v.view(-1, kvh, d))
        k_buf, v_buf = ctx.kv_pool.k_buffers[layer_id], ctx.kv_pool.v_buffers[layer_id]
        q3, out3 = q.view(-1, h, d), out.view(-1, h, d)
        window = self.window(layer_id) or 0  # this layer's; the kernels' "no window" is 0
        if fb.forward_mode.is_extend():
            torch.ops.graphexec.triton_extend.default(
                q3, out3, k_buf, v_buf, self._req_to_token, fb.req_pool_indices,
                fb.extend_prefix_lens, fb.extend_seq_lens, fb.extend_start_loc, self.scale, self._max_extend_len,
                window, self._softcap,
            )  # fmt: skip
        else:
            bs, ws = fb.batch_size, self._workspace
            torch.ops.graphexec.triton_decode.default(
                q3[:bs], out3[:bs], k_buf, v_buf, self._req_to_token, fb.req_pool_indices[:bs], fb.seq_lens[:bs],
                ws.acc, ws.lse, self.scale, ws.num_splits, window, self._softcap,
            )  # fmt: skip
        real = fb.num_token_non_padded_device
        if real is not None:
            # Padded rows are zeroed as in torch_native: the count is read on the device, so a
            # replayed graph zeroes this step's padding (padded extend tokens are never written).
            out.masked_fill_(torch.arange(out.shape[0], device=out.device)[:, None] >= real, 0)
