"""The architecture of a Llama-family checkpoint, independent of where its weights come from."""

from __future__ import annotations

from dataclasses import dataclass

FAMILIES = ("llama", "qwen2", "qwen3", "phi3", "mistral")
ROPE_SCALINGS = ("llama3", "linear", "dynamic", "yarn", "longrope", "factors")


@dataclass(frozen=True)
class RopeScaling:
    """A checkpoint's RoPE scaling (graphexec/models/rope.py computes the frequencies from it).

    `short_factor` holds LongRoPE's short factors, or for kind "factors" llama.cpp's per-pair
    frequency divisors.  `declared_max_positions` is the checkpoint's own max_position_embeddings,
    which YaRN and LongRoPE derive their factor from when the config gives none.
    """

    kind: str
    factor: float | None = None
    original_max_positions: int = 0
    declared_max_positions: int = 0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    short_factor: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if self.kind not in ROPE_SCALINGS:
            raise ValueError(f"RoPE scaling must be one of {ROPE_SCALINGS}, got {self.kind!r}")


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and constants of a Llama-family decoder.

    `architecture` names the family (FAMILIES) for messages and the reference model; the decoder
    itself reads only the switches: attention_bias (Qwen2), qk_norm (Qwen3: per-head RMSNorm of
    q and k before RoPE), rotary_dim (Phi-4-mini: partial rotary; None is the whole head) and
    rope_scaling, and sliding_window (Mistral-style: every layer attends to the last
    `sliding_window` positions, the query's own included; None is full attention).  Weights use
    Hugging Face tensor names (q/k/v and gate/up unfused), so one model class serves GGUF,
    safetensors and random checkpoints alike.
    """

    name: str
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_context: int
    tie_word_embeddings: bool
    attention_bias: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    qk_norm: bool = False
    rotary_dim: int | None = None
    rope_scaling: RopeScaling | None = None
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        if self.architecture not in FAMILIES:
            raise ValueError(f"model architecture must be one of {FAMILIES}, got {self.architecture!r}")
        if self.rotary_dim is None:
            object.__setattr__(self, "rotary_dim", self.head_dim)
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise ValueError(f"rotary_dim must be even and within head_dim ({self.head_dim}), got {self.rotary_dim}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be a positive number of positions or None, got {self.sliding_window}")
        if self.sliding_window is not None and self.sliding_window >= self.max_context:
            # A window that covers the whole context changes nothing: keep full attention's fast paths.
            object.__setattr__(self, "sliding_window", None)
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim
