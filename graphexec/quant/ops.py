"""`graphexec::qlinear`, `qlinear_q8` and `qdequantize`: the ops every quantized weight is read through.

`qlinear` takes float activations as they are; `qlinear_q8` (`model.activations=q8`) first
quantizes each activation row per 32-element block to 8 bits, as llama.cpp does, and computes
integer block dot products (graphexec/kernels/csrc/qlinear_q8.cpp) on a weight whose rows are
interleaved in groups of 16 (repack.py; `n` is the real row count).  `quantize_q8` is that
quantization alone: d = max|x| / 127, q = round-half-even(x * 127 / max|x|), s = d * sum(q).

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
_LIB.define("qlinear_q8(Tensor x, Tensor codes, Tensor scales, Tensor? mins, int n) -> Tensor")
_LIB.define("quantize_q8(Tensor x) -> (Tensor, Tensor, Tensor)")


def in_features(codes: torch.Tensor) -> int:
    return codes.shape[1] * 2 if codes.dtype == torch.uint8 else codes.shape[1]


@torch.library.register_fake("graphexec::qlinear")
def _qlinear_fake(x, codes, scales, mins):
    return x.new_empty((*x.shape[:-1], codes.shape[0]))


@torch.library.register_fake("graphexec::qlinear_q8")
def _qlinear_q8_fake(x, codes, scales, mins, n):
    return x.new_empty((*x.shape[:-1], n))


@torch.library.register_fake("graphexec::quantize_q8")
def _quantize_q8_fake(x):
    blocks = (*x.shape[:-1], x.shape[-1] // QBLOCK)
    return x.new_empty(x.shape, dtype=torch.int8), x.new_empty(blocks, dtype=torch.float32), x.new_empty(blocks, dtype=torch.float32)


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


def quantize_q8_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per 32-element block of the last dimension: int8 codes q, scale d and d * sum(q), in plain
    torch ops (any device), computed as the C++ kernel computes them (fp32, ties to even)."""
    blocks = x.float().reshape(*x.shape[:-1], -1, QBLOCK)
    amax = blocks.abs().amax(-1)
    # A true division (a Python number over a tensor would be reciprocal-then-multiply, off by an ulp).
    inverse = torch.where(amax != 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    q = torch.round(blocks * inverse.unsqueeze(-1))
    d = amax / 127.0
    return q.to(torch.int8).reshape(x.shape), d, d * q.sum(-1)


def rows16_to_row_major(
    codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, n: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A weight interleaved in groups of 16 rows (repack.py) back in GGUF's row-major arrays
    (scales per half-block, Q6_K's, come two a block)."""
    rows = codes.permute(0, 3, 1, 2, 4).reshape(-1, codes.shape[1] * codes.shape[2] * 4)[:n]

    def per_row(grouped: torch.Tensor) -> torch.Tensor:
        return grouped.movedim(-1, 1).reshape(grouped.shape[0] * grouped.shape[-1], -1)[:n]

    return rows, per_row(scales), None if mins is None else per_row(mins)


def fake_quantize_q8(x: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """x as qlinear_q8 sees it: quantized per block (quantize_q8_reference), then q * d in `dtype`."""
    q, d, _ = quantize_q8_reference(x)
    return (q.to(dtype).reshape(*x.shape[:-1], -1, QBLOCK) * d.to(dtype).unsqueeze(-1)).reshape(x.shape)


def qlinear_q8_reference(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None) -> torch.Tensor:
    """What qlinear_q8 computes, in float64 torch ops: the quantized activations times the
    (row-major) weight."""
    weight = dequantize_reference(codes, scales, mins, torch.float64)
    return (fake_quantize_q8(x, torch.float64) @ weight.T).to(x.dtype)


def rows16_codes(codes: torch.Tensor, n: int) -> torch.Tensor:
    """Every weight's integer code, int32 [n, K], from qlinear_q8's interleaved codes of any kind
    (4-bit; 5- and 6-bit with their bit planes, 6-bit offset by 32; 8-bit signed; the layout is in
    qlinear_q8.cpp)."""
    groups, blocks, j = codes.shape[:3]
    if codes.dtype == torch.int8:
        return codes.permute(0, 3, 1, 2, 4).reshape(groups * 16, -1)[:n].int()
    nibbles = codes[:, :, :4].permute(0, 3, 1, 2, 4).reshape(groups * 16, blocks, QBLOCK // 2).int()
    q = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=-1)  # byte 4j+t: elements 4j+t and 16+4j+t
    for plane in range(j - 4):  # mask v = 2j + half, bit 4r+t: element 16 half + 4j + t of lane r
        masks = codes[:, :, 4 + plane].reshape(groups, blocks, 8, 8, 1).int()
        bits = ((masks >> torch.arange(8, dtype=torch.int32, device=codes.device)) & 1).view(groups, blocks, 4, 2, 16, 4)
        q = q | (bits.permute(0, 4, 1, 3, 2, 5).reshape(groups * 16, blocks, QBLOCK) << (4 + plane))
    return q.reshape(groups * 16, -1)[:n] - (32 if j == 6 else 0)


def qlinear_q8_rows16_reference(
    x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, n: int
) -> torch.Tensor:
    """qlinear_q8's arguments as the op takes them (interleaved by 16; any code kind and scale
    layout), in float64 torch ops: what other devices run."""
    _, row_scales, row_mins = rows16_to_row_major(codes, scales, mins, n)
    q = rows16_codes(codes, n)
    values = q.double().view(n, row_scales.shape[1], -1) * row_scales.double().unsqueeze(-1)
    if row_mins is not None:
        values = values + row_mins.double().unsqueeze(-1)
    return (fake_quantize_q8(x, torch.float64) @ values.reshape(n, -1).T).to(x.dtype)


def _qlinear_any_device(x, codes, scales, mins):
    # TODO(gpu): a fused dequantize-GEMV kernel; this materializes the weight per call.
    return torch.nn.functional.linear(x, dequantize_reference(codes, scales, mins, x.dtype))


def _qdequantize_any_device(codes, scales, mins, dtype):
    return dequantize_reference(codes, scales, mins, dtype)


_LIB.impl("qlinear", _qlinear_any_device, "CUDA")
_LIB.impl("qdequantize", _qdequantize_any_device, "CUDA")
# TODO(gpu): an integer (dp4a / int8 tensor-core) kernel; this is the float64 reference's math.
_LIB.impl("qlinear_q8", lambda x, codes, scales, mins, n: qlinear_q8_rows16_reference(x, codes, scales, mins, n), "CUDA")
_LIB.impl("quantize_q8", quantize_q8_reference, "CUDA")


def ensure_kernels() -> None:
    """Build/load the CPU kernels (raises CheckpointError naming `model.weights=dequantize` if it cannot)."""
    kernels.load()
