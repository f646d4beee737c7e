"""ModelRunner: owns the weights, the KV pools, the attention backend and one capture backend per
ForwardMode, and turns a ForwardBatch into sampled tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from capture import CaptureBackend, create_backend
from capture.eager import EagerRunner
from graphexec.attention.backend import create_attention_backend
from graphexec.config import EngineConfig
from graphexec.errors import ConfigError
from graphexec.forward_batch import ForwardBatch
from graphexec.forward_context import ForwardContext, forward_context
from graphexec.forward_mode import ForwardMode
from graphexec.kv_pool import TokenToKVPool
from graphexec.loader import LoadedCheckpoint
from graphexec.logits_processor import LogitsProcessor
from graphexec.models.config import ModelConfig
from graphexec.models.llama import LlamaForCausalLM
from graphexec.req_to_token_pool import ReqToTokenPool
from graphexec.sampler import Sampler, SamplerOutput


@dataclass(frozen=True)
class StepOutput:
    sampler: SamplerOutput
    logits: torch.Tensor  # [batch_size, vocab] fp32, the rows that sampled


class ModelRunner:
    def __init__(self, config: EngineConfig, checkpoint: LoadedCheckpoint):
        self.config = config
        self.model_config: ModelConfig = checkpoint.config
        self.device = torch.device(config.device)
        self.dtype = config.torch_dtype
        self.max_context = min(config.cache.max_context or self.model_config.max_context, self.model_config.max_context)

        model = LlamaForCausalLM(self.model_config)
        model.load_weights(checkpoint.state_dict)
        self.model = model.to(device=self.device, dtype=self.dtype).eval()
        # RoPE tables stay fp32 like the reference; the model casts per use.
        self.model.rotary.to(dtype=torch.float32)

        mc = self.model_config
        self.req_to_token_pool = ReqToTokenPool(config.scheduler.max_running_requests, self.max_context, self.device)
        self.kv_pool = TokenToKVPool(
            config.cache.num_slots, mc.num_layers, mc.num_kv_heads, mc.head_dim, self.dtype, self.device
        )
        self.attn_backend = create_attention_backend(config.attention_backend, mc.num_heads, mc.num_kv_heads, mc.head_dim)
        self.logits_processor = LogitsProcessor(self.model.compute_logits)
        self.sampler = Sampler()

        self.eager = EagerRunner(self.model, self.device, {})
        self.backends: dict[ForwardMode, CaptureBackend] = {}
        for mode in ForwardMode:
            spec = config.capture.for_mode(mode)
            if spec.backend == "eager":
                self.backends[mode] = self.eager
            else:
                try:
                    self.backends[mode] = create_backend(spec.backend, self.model, self.device, spec.options)
                except ValueError as err:
                    raise ConfigError(f"capture.{mode.config_key}: {err}") from err

    def capture(self) -> None:
        """Build every backend's graphs once, before serving."""
        for backend in {id(b): b for b in self.backends.values()}.values():
            backend.capture()

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        """Hidden rows of fb's real tokens, from the mode's backend or, if it cannot run fb, eager."""
        ctx = ForwardContext(fb, self.attn_backend, self.kv_pool, self.req_to_token_pool)
        with forward_context(ctx):
            # Metadata is prepared once per forward, outside any graph.
            self.attn_backend.init_forward_metadata(fb, self.req_to_token_pool.req_to_token)
            backend = self.backends[fb.forward_mode]
            if backend is not self.eager and not backend.can_run(fb):
                backend.stats.fallbacks += 1
                backend = self.eager
            hidden = backend.execute(fb)
        return hidden[: fb.num_token_non_padded]

    @torch.inference_mode()
    def forward_and_sample(self, fb: ForwardBatch) -> StepOutput:
        logits = self.logits_processor(self.forward(fb), fb)
        return StepOutput(sampler=self.sampler(logits, fb.sampling_info), logits=logits)

    def init_forward_batch(self, schedule_batch) -> ForwardBatch:
        return ForwardBatch.init_new(schedule_batch, self.device, self.model_config.vocab_size)
