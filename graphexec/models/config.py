"""The architecture of a Llama-family checkpoint, independent of where its weights come from."""

from __future__ import annotations

from dataclasses import dataclass

FAMILIES = ("llama", "qwen2", "qwen3", "phi3", "mistral", "gemma", "gemma2", "gemma3", "mixtral", "qwen2_moe",
            "qwen3_moe")
ACTIVATIONS = ("silu", "gelu_tanh")  # the MLP gate's: SwiGLU, GeGLU (Gemma's tanh-approximated GELU)
ROPE_SCALINGS = ("llama3", "linear", "dynamic", "yarn", "longrope", "factors")


@dataclass(frozen=True)
class RopeScaling:
    """A checkpoint's RoPE scaling (graphexec/models/rope.py computes the frequencies from it).

    `short_factor` holds LongRoPE's short factors, or for kind "factors" llama.cpp's per-pair
    frequency divisors; `long_factor` LongRoPE's long ones, which rotate every position when
    `long` is set (model.rope_long_factors: the declared context, llama.cpp's choice past the
    original context) instead of the short ones within the original context.
    `declared_max_positions` is the checkpoint's own max_position_embeddings, which YaRN and
    LongRoPE derive their factor from when the config gives none.
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
    long_factor: tuple[float, ...] | None = None
    long: bool = False

    def __post_init__(self) -> None:
        if self.kind not in ROPE_SCALINGS:
            raise ValueError(f"RoPE scaling must be one of {ROPE_SCALINGS}, got {self.kind!r}")
        if self.long and (self.kind != "longrope" or self.long_factor is None):
            raise ValueError("long RoPE factors need a longrope scaling that has them (long_factor)")


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and constants of a decoder graphexec runs (models/llama.py).

    `architecture` names the family (FAMILIES) for messages and the reference model; the decoder
    itself reads only the switches: attention_bias (Qwen2), qk_norm (Qwen3, Gemma 3: per-head
    RMSNorm of q and k before RoPE), rotary_dim (Phi-4-mini: partial rotary; None is the whole
    head), rope_scaling, and sliding_window (Mistral-style: a query attends to the last
    `sliding_window` positions, its own included; None is full attention) on the layers
    `sliding_layers` marks (None: every layer).  Gemma's switches: norm_unit_offset (RMSNorm
    scales by 1 + weight), sandwich_norms (each sublayer's output is normalised too),
    hidden_act, embed_scale (the embedding rows are multiplied by it), query_pre_attn_scalar
    (the softmax scale is its inverse square root instead of head_dim's), attn_logit_softcap /
    final_logit_softcap (scores and logits become cap * tanh(x / cap)) and local_rope_theta
    (Gemma 3: the sliding layers' own unscaled RoPE base).  Mixture of experts (num_experts > 0):
    the MLP of the layers `sparse_layers` marks (None: every layer) is num_experts experts of
    moe_intermediate_size, num_experts_per_tok of them per token, their softmax weights
    renormalised to sum to one if norm_topk_prob, plus a sigmoid-gated shared expert of
    shared_expert_intermediate_size (Qwen2-MoE) when that is > 0.  Weights use Hugging Face
    tensor names (q/k/v and gate/up unfused, experts stacked), so one model class serves GGUF,
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
    sliding_layers: tuple[bool, ...] | None = None
    norm_unit_offset: bool = False
    sandwich_norms: bool = False
    hidden_act: str = "silu"
    embed_scale: float = 1.0
    query_pre_attn_scalar: float | None = None
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    local_rope_theta: float | None = None
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    shared_expert_intermediate_size: int = 0
    sparse_layers: tuple[bool, ...] | None = None

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
        if self.sliding_layers is not None:
            if len(self.sliding_layers) != self.num_layers:
                raise ValueError(f"sliding_layers names {len(self.sliding_layers)} layers, the model has {self.num_layers}")
            object.__setattr__(self, "sliding_layers", tuple(bool(s) for s in self.sliding_layers))
        if self.num_experts:
            if not 0 < self.num_experts_per_tok <= self.num_experts or self.moe_intermediate_size < 1:
                raise ValueError(
                    f"a mixture of experts needs 0 < num_experts_per_tok <= num_experts ({self.num_experts}) and "
                    f"moe_intermediate_size >= 1, got {self.num_experts_per_tok} and {self.moe_intermediate_size}"
                )
            if self.sparse_layers is not None:
                if len(self.sparse_layers) != self.num_layers:
                    raise ValueError(f"sparse_layers names {len(self.sparse_layers)} layers, the model has {self.num_layers}")
                object.__setattr__(self, "sparse_layers", tuple(bool(s) for s in self.sparse_layers))
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"hidden_act must be one of {ACTIVATIONS}, got {self.hidden_act!r}")
        for name in ("attn_logit_softcap", "final_logit_softcap", "query_pre_attn_scalar"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be positive or None, got {value}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")

    def is_sliding_layer(self, layer: int) -> bool:
        """Whether `layer` is of the sliding kind: it attends through the window, if there is one
        shorter than the context, and under Gemma 3 rotates with local_rope_theta either way."""
        return self.sliding_layers is None or self.sliding_layers[layer]

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """Each layer's window (None: full attention), as the attention backends take them."""
        return tuple(self.sliding_window if self.is_sliding_layer(i) else None for i in range(self.num_layers))

    def is_sparse_layer(self, layer: int) -> bool:
        """Whether `layer`'s MLP is the mixture of experts (False: the dense MLP)."""
        return self.num_experts > 0 and (self.sparse_layers is None or self.sparse_layers[layer])

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim
