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

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, sliding_window: int | None = None):
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        # Mistral-style: a query at position p attends keys p - sliding_window + 1 .. p (None: all).
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be at least 1 or None, got {sliding_window}")
        self.sliding_window = sliding_window

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
    sliding_window: int | None = None,
) -> AttentionBackend:
    """`sliding_window`: the model's window (ModelConfig.sliding_window; None: full attention)."""
    module_name, class_name = _BACKENDS[resolve_attention_backend(name, device)].split(":")
    backend_cls = getattr(importlib.import_module(module_name), class_name)
    backend_cls.check_device(device)
    return backend_cls(num_heads, num_kv_heads, head_dim, sliding_window=sliding_window)
