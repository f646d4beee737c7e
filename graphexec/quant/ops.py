"""`graphexec::qlinear` and `graphexec::qdequantize`: the ops every quantized weight is read through.

Schemas and fake implementations live here, so Dynamo and inductor see each call as one opaque node
(never tracing into the dequantization) on any device.  The CPU kernels are C++
(graphexec/kernels/csrc/qlinear.cpp, loaded by `ensure_kernels()`); every other device runs the
plain-torch reference below.

Defined with `torch.library.define`, not `custom_op`: the call goes straight to the C++ kernel
through the dispatcher, with no Python wrapper in between (custom_op's wrapper is ~50 µs a call
here, and a decode step makes ~120 of these calls).
"""

from __future__ import annotations

import torch

from graphexec import kernels

QBLOCK = 32  # elements per GGUF block for every supported type

_LIB = torch.library.Library("graphexec", "FRAGMENT")  # noqa: the library object keeps the ops alive
_LIB.define("qlinear(Tensor x, Tensor codes, Tensor scales, Tensor? mins) -> Tensor")
_LIB.define("qdequantize(Tensor codes, Tensor scales, Tensor? mins, ScalarType dtype) -> Tensor")


def in_features(codes: torch.Tensor) -> int:
    return codes.shape[1] * 2 if codes.dtype == torch.uint8 else codes.shape[1]


@torch.library.register_fake("graphexec::qlinear")
def _qlinear_fake(x, codes, scales, mins):
    return x.new_empty((*x.shape[:-1], codes.shape[0]))


@torch.library.register_fake("graphexec::qdequantize")
def _qdequantize_fake(codes, scales, mins, dtype):
    return codes.new_empty((codes.shape[0], in_features(codes)), dtype=dtype)


def dequantize_reference(
    codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """The packed weight as a dense [N, K] tensor, in plain torch ops (any device): d*q + m per block."""
    n = codes.shape[0]
    if codes.dtype == torch.uint8:
        blocks = codes.view(n, -1, QBLOCK // 2)
        q = torch.cat([blocks & 0x0F, blocks >> 4], dim=-1)
    else:
        q = codes.view(n, -1, QBLOCK)
    d = scales.float().unsqueeze(-1)
    values = q.float() * d if mins is None else torch.addcmul(mins.float().unsqueeze(-1), q.float(), d)
    return values.reshape(n, -1).to(dtype)


def _qlinear_any_device(x, codes, scales, mins):
    # TODO(gpu): a fused dequantize-GEMV kernel; this materializes the weight per call.
    return torch.nn.functional.linear(x, dequantize_reference(codes, scales, mins, x.dtype))


def _qdequantize_any_device(codes, scales, mins, dtype):
    return dequantize_reference(codes, scales, mins, dtype)


_LIB.impl("qlinear", _qlinear_any_device, "CUDA")
_LIB.impl("qdequantize", _qdequantize_any_device, "CUDA")


def ensure_kernels() -> None:
    """Build/load the CPU kernels (raises CheckpointError naming `model.weights=dequantize` if it cannot)."""
    kernels.load()
