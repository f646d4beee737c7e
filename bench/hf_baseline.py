"""Hugging Face transformers `generate` on graphexec's weights: the e2e suite's baseline, run the
two ways its users usually run it (left-padded groups; one request at a time)."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from graphexec.models.config import ModelConfig


def hf_config_from(config: ModelConfig):
    """The transformers config of the same architecture and sizes."""
    import transformers

    if config.architecture not in ("llama", "qwen2") or config.rope_scaling or config.qk_norm or config.sliding_window:
        # Other families' reference models are their own checkpoints (tests/test_model_families.py).
        raise ValueError(f"no transformers config is derived for {config.architecture!r} with its features")
    common = dict(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        rms_norm_eps=config.rms_norm_eps,
        rope_theta=config.rope_theta,
        max_position_embeddings=config.max_context,
        tie_word_embeddings=config.tie_word_embeddings,
    )
    if config.architecture == "qwen2":
        return transformers.Qwen2Config(**common)
    return transformers.LlamaConfig(attention_bias=config.attention_bias, **common)


def hf_model_from(config: ModelConfig, state_dict: dict[str, torch.Tensor]):
    """A transformers model with exactly these (HF-named) weights, fp32, eval mode."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_config(hf_config_from(config))
    missing, unexpected = model.load_state_dict({k: v.float() for k, v in state_dict.items()}, strict=False)
    # Tied heads are not stored separately; anything else missing means the names do not match.
    if unexpected or not set(missing) <= {"lm_head.weight"}:
        raise ValueError(f"weights do not fit {type(model).__name__}: missing {missing}, unexpected {unexpected}")
    if config.tie_word_embeddings:
        model.tie_weights()
    return model.float().eval()


def hf_model_for_engine(engine):
    """The reference model for a running engine: the same checkpoint, loaded again in fp32."""
    from graphexec.loader.resolve import load_checkpoint

    # HF runs the dequantized fp32 weights: what the engine's native blocks compute, as HF reads a GGUF.
    source = dataclasses.replace(engine.config.model, weights="dequantize")
    ckpt = load_checkpoint(source, torch.float32)
    return hf_model_from(ckpt.config, ckpt.state_dict)


@dataclass(frozen=True)
class HFRequestResult:
    token_ids: list[int]  # the request's own output length (a group generates to its longest)
    ttft: float  # seconds from the workload's start to this request's first token
    tpot: float | None  # mean seconds per token after the first, up to the request's own length
    latency: float  # seconds from the workload's start to the request's last useful token


class _StepClock:
    """A generate() streamer that only timestamps: its first put() is the prompt, then one per step."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def generate_group(model, prompts: Sequence[list[int]], output_lens: Sequence[int], pad_id: int, t_start: float) -> list[HFRequestResult]:
    """One left-padded greedy batch generating its longest request's length, EOS ignored."""
    width = max(map(len, prompts))
    ids = torch.tensor([[pad_id] * (width - len(p)) + list(p) for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    steps = max(output_lens)
    clock = _StepClock()
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=steps, min_new_tokens=steps,
            do_sample=False, pad_token_id=pad_id, streamer=clock,
        )
    token_times = clock.times[1:]  # times[0] is the prompt being "streamed" before prefill
    results = []
    for row, n in enumerate(output_lens):
        first, last = token_times[0], token_times[n - 1]
        results.append(
            HFRequestResult(
                token_ids=out[row, width : width + n].tolist(),
                ttft=first - t_start,
                tpot=(last - first) / (n - 1) if n > 1 else None,
                latency=last - t_start,
            )
        )
    return results


def generate_grouped(
    model, prompts: Sequence[list[int]], output_lens: Sequence[int], pad_id: int, group_size: int,
    on_group: Callable[[int], None] = lambda n: None,
) -> tuple[list[HFRequestResult], float]:
    """Requests in arrival order, `group_size` at a time; returns per-request results and wall seconds."""
    t_start = time.perf_counter()
    results: list[HFRequestResult] = []
    for i in range(0, len(prompts), group_size):
        results += generate_group(model, prompts[i : i + group_size], output_lens[i : i + group_size], pad_id, t_start)
        on_group(len(prompts[i : i + group_size]))
    return results, time.perf_counter() - t_start
