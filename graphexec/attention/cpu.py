"""The `cpu` attention backend: graphexec's C++ paged-attention kernels for CPU tensors.

Decode and extend attention read the KV pool in place through the request -> token table (no
gathered copies), with the step's K/V write fused in (graphexec/kernels/csrc/attention.cpp).
Per forward, `init_forward_metadata` binds the pool and this batch's metadata tensors to the
calling thread (`graphexec::attention_bind`) and `end_forward` unbinds them: the binding lives
exactly as long as the runner's forward scope.  In between, each layer's `graphexec::attention`
call goes straight from the dispatcher to the kernel, with no Python on the way.  The metadata tensors are
the ForwardBatch's own, which a captured graph's static input buffers already are, so a replayed
graph reads the current step's values.

On any other device this is the torch_native backend.  Replacing `forward` on an instance (a
spy, a test) routes that instance's calls through Python, to the same kernels.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from graphexec.attention.forward_context import get_forward_context
from graphexec.attention.op import bind_cpu_kernels, unbind_cpu_kernels
from graphexec.attention.torch_native import TorchNativeAttnBackend
from graphexec.errors import CheckpointError, ConfigError

if TYPE_CHECKING:
    from graphexec.attention.backend import ForwardContext, Windows
    from graphexec.batch.forward_batch import ForwardBatch


def load_kernels() -> None:
    """Build/load the C++ kernels; a ConfigError naming the way out if they cannot be built."""
    from graphexec import kernels

    try:
        kernels.load()
    except CheckpointError as error:
        raise ConfigError(
            f"attention_backend=cpu needs graphexec's C++ kernels, which failed to build ({error}); "
            "use attention_backend=torch_native"
        ) from error


class CpuAttnBackend(TorchNativeAttnBackend):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, sliding_window: "Windows" = None,
                 scale: float | None = None, logit_softcap: float | None = None):  # fmt: skip
        super().__init__(num_heads, num_kv_heads, head_dim, sliding_window, scale, logit_softcap)
        # paged_attention's arguments after layer_id up to its window, for this forward (None: not on the CPU).
        self._kernel_args: tuple | None = None
        # The options as the kernels take them, 0 meaning the default: no window, head_dim ** -0.5
        # (the kernels' own, so the default scale is computed exactly as before) and no soft-cap.
        # The binding gets every layer's window, the Python route the called layer's.
        self._kernel_windows = [w or 0 for w in (self._layer_windows or (self.sliding_window,))]
        self._kernel_scale = self.scale if self._scale_given else 0.0
        self._kernel_softcap = self.logit_softcap or 0.0

    def init_forward_metadata(self, fb: "ForwardBatch", req_to_token: torch.Tensor) -> None:
        if req_to_token.device.type != "cpu":
            self._kernel_args = None
            super().init_forward_metadata(fb, req_to_token)
            return
        load_kernels()  # built and loaded once per process (kernels.load is cached)
        pool = get_forward_context().kv_pool
        extend = fb.forward_mode.is_extend()
        self._kernel_args = (
            req_to_token,
            fb.req_pool_indices,
            fb.seq_lens,
            fb.out_cache_loc,
            fb.extend_prefix_lens if extend else None,
            fb.extend_seq_lens if extend else None,
            fb.extend_start_loc if extend else None,
            fb.num_token_non_padded,
        )
        self._pools = (pool.k_pool, pool.v_pool)
        if "forward" not in vars(self):
            # Every layer's window: the kernel picks the called layer's.
            bind_cpu_kernels(
                *self._pools, *self._kernel_args, self._kernel_windows, self._kernel_scale, self._kernel_softcap
            )

    def end_forward(self) -> None:
        unbind_cpu_kernels()

    def forward(self, q, k, v, out, layer_id, ctx: "ForwardContext") -> None:
        """The Python route (the C++ route never comes here)."""
        if self._kernel_args is None:
            return super().forward(q, k, v, out, layer_id, ctx)
        torch.ops.graphexec.paged_attention.default(
            q, k, v, out, *self._pools, int(layer_id), *self._kernel_args,
            self.window(layer_id) or 0, self._kernel_scale, self._kernel_softcap,
        )  # fmt: skip
