"""The attention backend interface, the ForwardContext it is handed each forward, and the
name → backend table used by config."""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from graphexec.batch.forward_batch import ForwardBatch
from graphexec.errors import ConfigError

if TYPE_CHECKING:
    from graphexec.cache.kv_pool import TokenToKVPool
    from graphexec.cache.req_to_token_pool import ReqToTokenPool

# A backend's sliding windows: one for every layer (an int, or None for full attention), or a
# tuple with one such entry per layer.
Windows = int | None | tuple[int | None, ...]


@dataclass(frozen=True)
class ForwardContext:
    """What attention reads during one forward (set by the runner's forward scope:
    forward_context.py): the batch, this backend, and the KV pools it reads and writes."""

    forward_batch: ForwardBatch
    attn_backend: AttentionBackend
    kv_pool: TokenToKVPool
    req_to_token_pool: ReqToTokenPool


class AttentionBackend(ABC):
    """Prepares per-step metadata once per forward (outside any graph), then serves every layer."""

    # seq_lens value of a padded row: a length the kernels accept (it attends to the dummy slot).
    padded_seq_len: int = 1

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        sliding_window: Windows = None,
        scale: float | None = None,
        logit_softcap: float | None = None,
    ):
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        # The softmax scale: head_dim ** -0.5 unless the model says otherwise (Gemma:
        # query_pre_attn_scalar ** -0.5).  `_scale_given` tells the C++ kernels whether to use it
        # or their own head_dim ** -0.5 (bit-identical to before the scale was an argument).
        self.scale = head_dim**-0.5 if scale is None else float(scale)
        self._scale_given = scale is not None
        if self.scale <= 0:
            raise ValueError(f"scale must be positive, got {scale}")
        # Gemma 2: scores s = scale * q.k become cap * tanh(s / cap) before masking and softmax.
        if logit_softcap is not None and logit_softcap < 0:
            raise ValueError(f"logit_softcap must be positive, 0 or None, got {logit_softcap}")
        self.logit_softcap = float(logit_softcap) if logit_softcap else None
        # Mistral-style: a query at position p attends keys p - W + 1 .. p (None: all), with one W
        # for every layer or, as a tuple, one per layer (Gemma alternates windowed and full layers).
        per_layer = isinstance(sliding_window, (tuple, list))
        if per_layer:
            if not sliding_window:
                raise ValueError("sliding_window: a per-layer tuple needs one entry per layer, got none")
            sliding_window = tuple(_window_arg(w, sliding_window) for w in sliding_window)
        else:
            sliding_window = _window_arg(sliding_window, sliding_window)
        if per_layer and len(set(sliding_window)) == 1:
            # One window after all (a model config's per-layer list of a Mistral or a Llama): the
            # single-window form, one mask per forward and the kernels' single-window binding.
            sliding_window, per_layer = sliding_window[0], False
        self.sliding_window = tuple(sliding_window) if per_layer else sliding_window
        self._layer_windows = self.sliding_window if per_layer else None
        # The distinct windows, for metadata built once per window rather than once per layer.
        self.windows: tuple[int | None, ...] = (
            tuple(dict.fromkeys(self._layer_windows)) if per_layer else (sliding_window,)
        )

    def window(self, layer_id: int) -> int | None:
        """Layer `layer_id`'s sliding window (None: full attention)."""
        if self._layer_windows is None:
            return self.sliding_window
        layer_id = int(layer_id)
        if not 0 <= layer_id < len(self._layer_windows):
            raise ValueError(f"layer {layer_id} has no sliding_window entry ({len(self._layer_windows)} layers given)")
        return self._layer_windows[layer_id]

    @classmethod
    def check_device(cls, device: torch.device) -> None:
        """Raise ConfigError (naming attention_backend) if this backend cannot run on `device`."""

    @abstractmethod
    def init_forward_metadata(self, fb: "ForwardBatch", req_to_token: torch.Tensor) -> None:
        """Build whatever the layers need (KV index lists, masks) for this forward.

        Called by the runner's forward scope, inside the forward context, before every forward;
        `end_forward` is called when the scope closes, however it closes.
        """

    def end_forward(self) -> None:
        """Drop anything bound for the forward that just ended (the cpu backend's kernel binding)."""

    def enable_static_decode_metadata(self, max_rows: int, max_kv_len: int, device: torch.device) -> None:
        """From now on, build decode metadata into fixed-address, bucket-shaped buffers (for CUDA graphs)."""
        raise NotImplementedError(f"{type(self).__name__} cannot run inside a captured CUDA graph")

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        layer_id: int,
        ctx: ForwardContext,
    ) -> None:
        """Store k/v at `out_cache_loc` and write attention over each request's KV into `out`."""


def _window_arg(window, given) -> int | None:
    """One window of the `sliding_window` argument (`given`), checked: an integer >= 1, or None."""
    if window is None:
        return None
    if isinstance(window, bool) or not hasattr(window, "__index__") or window.__index__() < 1:
        raise ValueError(f"sliding_window must be at least 1 or None (per layer: a tuple of those), got {given}")
    return window.__index__()


# Imported on demand so that naming a backend in config costs nothing until it is used.
_BACKENDS = {
    "torch_native": "graphexec.attention.torch_native:TorchNativeAttnBackend",
    # C++ paged kernels for CPU tensors (graphexec/kernels/csrc/attention.cpp); torch_native elsewhere.
    "cpu": "graphexec.attention.cpu:CpuAttnBackend",
    # Triton paged kernels: GPU tensors, or CPU tensors under Triton's interpreter (tests).
    "triton": "graphexec.attention.triton_backend:TritonAttnBackend",
}
# `auto`: the paged kernels made for the device, the reference anywhere else.
_AUTO = {"cuda": "triton", "cpu": "cpu"}


def resolve_attention_backend(name: str, device: torch.device) -> str:
    """The backend `name` means on `device` (`auto` picks by device type)."""
    if name == "auto":
        return _AUTO.get(device.type, "torch_native")
    if name not in _BACKENDS:
        raise ConfigError(f"attention_backend={name!r} is unknown; choose one of {sorted(_BACKENDS) + ['auto']}")
    return name


def create_attention_backend(
    name: str,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    device: torch.device,
    sliding_window: Windows = None,
    scale: float | None = None,
    logit_softcap: float | None = None,
) -> AttentionBackend:
    """`sliding_window`: the model's window (ModelConfig.sliding_window; None: full attention), or
    a tuple of one window (or None) per layer; `scale`: the softmax scale (None: head_dim ** -0.5);
    `logit_softcap`: cap * tanh(score / cap) before the softmax (None or 0: none)."""
    module_name, class_name = _BACKENDS[resolve_attention_backend(name, device)].split(":")
    backend_cls = getattr(importlib.import_module(module_name), class_name)
    backend_cls.check_device(device)
    return backend_cls(
        num_heads, num_kv_heads, head_dim, sliding_window=sliding_window, scale=scale, logit_softcap=logit_softcap
    )
