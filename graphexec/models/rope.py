"""Rotary-embedding frequencies: plain RoPE and the scaled variants checkpoints declare.

`inverse_frequencies(config)` returns the per-pair inverse frequencies and the factor cos/sin are
multiplied by (YaRN's and LongRoPE's attention scaling; 1.0 otherwise).  The formulas follow the
published methods as transformers' ROPE_INIT_FUNCTIONS compute them, and the tests hold the two
equal.  Everything here is static: tables are built once for positions [0, max_context).

- llama3: Llama 3.1+ frequency smoothing between low- and high-frequency wavelengths.
- linear: positions interpolated by `factor` (every frequency divided by it).
- dynamic: NTK-aware base rescale.  Only its static form: within original_max_positions it *is*
  plain RoPE, and the loaders cap the context there (a batch-wide rescale past it would change
  the rotation of tokens already in the KV cache as the batch grows).
- yarn: ramp between interpolated and extrapolated frequencies, plus the attention factor.
- longrope (Phi-3 "su"): per-pair short factors, and the context capped at original_max_positions,
  where transformers also uses the short factors; or, with `long` (model.rope_long_factors), the
  long factors at every position of the declared context.  Not transformers' switch per forward
  (long for the whole forward once it reaches past the original context): with a KV cache shared
  by requests of every length, one rotation for every cached key is the consistent choice, and
  llama.cpp's when its context exceeds the original.
- factors: llama.cpp's per-pair frequency divisors (a GGUF's rope_freqs tensor, how its converter
  stores Llama 3's scaling).
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from graphexec.models.config import ModelConfig, RopeScaling


def inverse_frequencies(config: ModelConfig) -> tuple[torch.Tensor, float]:
    """(inv_freq [rotary_dim / 2] fp32 on the CPU, attention factor)."""
    dim, base, scaling = config.rotary_dim, config.rope_theta, config.rope_scaling
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    plain = 1.0 / (base**exponents)
    if scaling is None or scaling.kind == "dynamic":
        return plain, 1.0
    if scaling.kind == "linear":
        return plain / scaling.factor, 1.0
    if scaling.kind == "llama3":
        return _llama3(plain, scaling), 1.0
    if scaling.kind == "yarn":
        return _yarn(base**exponents, dim, base, scaling)
    if scaling.kind == "longrope":
        factors = scaling.long_factor if scaling.long else scaling.short_factor
        return 1.0 / (_factors(factors, dim) * base**exponents), _longrope_attention(config, scaling)
    if scaling.kind == "factors":
        return plain / _factors(scaling.short_factor, dim), scaling.attention_factor or 1.0
    raise ValueError(f"unknown RoPE scaling {scaling.kind!r}")


def with_long_factors(config: ModelConfig) -> ModelConfig:
    """A LongRoPE model running its declared context on its long factors (model.rope_long_factors);
    ValueError if it has none."""
    s = config.rope_scaling
    if s is None or s.kind != "longrope" or s.long_factor is None:
        raise ValueError(f"{config.name} has no LongRoPE long factors (its RoPE scaling: {s.kind if s else None})")
    return replace(config, rope_scaling=replace(s, long=True), max_context=max(config.max_context, s.declared_max_positions))


def local_inverse_frequencies(config: ModelConfig) -> torch.Tensor | None:
    """Gemma 3's sliding layers rotate with plain RoPE at their own base (local_rope_theta); the
    checkpoint's scaling is the full-attention layers' alone.  None: every layer rotates alike."""
    if config.local_rope_theta is None:
        return None
    return inverse_frequencies(replace(config, rope_theta=config.local_rope_theta, rope_scaling=None))[0]


def _factors(values: tuple[float, ...] | None, dim: int) -> torch.Tensor:
    if values is None or len(values) != dim // 2:
        raise ValueError(f"RoPE scaling needs {dim // 2} per-pair factors, got {None if values is None else len(values)}")
    return torch.tensor(values, dtype=torch.float32, device="cpu")


def _llama3(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    low_wavelen = s.original_max_positions / s.low_freq_factor
    high_wavelen = s.original_max_positions / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths (beyond the original context) are interpolated by `factor`, short ones kept,
    # and those in between blended linearly in 1/wavelength.
    scaled = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_positions / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    blended = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, blended, scaled)


def _yarn(pos_freqs: torch.Tensor, dim: int, base: float, s: RopeScaling) -> tuple[torch.Tensor, float]:
    factor = s.factor if s.factor is not None else s.declared_max_positions / s.original_max_positions
    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if s.attention_factor is not None:
        attention = s.attention_factor
    elif s.mscale and s.mscale_all_dim:
        attention = mscale(factor, s.mscale) / mscale(factor, s.mscale_all_dim)
    else:
        attention = mscale(factor)

    def correction_dim(rotations: float) -> float:
        # The pair index whose wavelength fits `rotations` times into the original context.
        return dim * math.log(s.original_max_positions / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a zero-width ramp would divide by zero
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low), 0, 1)
    extrapolated = 1 - ramp  # weight of the unscaled frequency: 1 for the fast-rotating pairs
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolated) + (1.0 / pos_freqs) * extrapolated
    return inv_freq, float(attention)


def _longrope_attention(config: ModelConfig, s: RopeScaling) -> float:
    if s.attention_factor is not None:
        return s.attention_factor
    # The factor the checkpoint was extended by: its declared context over the pretraining one.
    factor = s.factor if s.factor is not None else s.declared_max_positions / s.original_max_positions
    if factor <= 1.0:
        return 1.0
    return math.sqrt(1 + math.log(factor) / math.log(s.original_max_positions))
