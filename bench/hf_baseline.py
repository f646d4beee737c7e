"""Hugging Face transformers `generate` on graphexec's weights: the e2e suite's baseline, run the
two ways its users usually run it (left-padded groups; one request at a time)."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Callable, Sequence

import torch

from graphexec.loader.resolve import load_checkpoint
from graphexec.models.config import ModelConfig


def hf_model_from(config: ModelConfig, state_dict: dict[str, torch.Tensor]):
    """A transformers model of this architecture and these sizes and (HF-named) weights, fp32, eval mode."""
    import transformers

    if config.architecture not in ("llama", "qwen2") or config.rope_scaling or config.qk_norm or config.sliding_window:
        # Other families' reference models are their own checkpoints (tests/test_model_families.py).
        raise ValueError(f"no transformers config is derived for {config.architecture!r} with its features")
    common = dict(vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
                  num_hidden_layers=config.num_layers, num_attention_heads=config.num_heads,
                  num_key_value_heads=config.num_kv_heads, head_dim=config.head_dim, rms_norm_eps=config.rms_norm_eps,
                  rope_theta=config.rope_theta, max_position_embeddings=config.max_context,
                  tie_word_embeddings=config.tie_word_embeddings)
    hf_config = (transformers.Qwen2Config(**common) if config.architecture == "qwen2"
                 else transformers.LlamaConfig(attention_bias=config.attention_bias, **common))
    model = transformers.AutoModelForCausalLM.from_config(hf_config)
    missing, unexpected = model.load_state_dict({k: v.float() for k, v in state_dict.items()}, strict=False)
    # Tied heads are not stored separately; anything else missing means the names do not match.
    if unexpected or not set(missing) <= {"lm_head.weight"}:
        raise ValueError(f"weights do not fit {type(model).__name__}: missing {missing}, unexpected {unexpected}")
    if config.tie_word_embeddings:
        model.tie_weights()
    return model.float().eval()


def hf_model_for_engine(engine) -> tuple:
    """The reference model for a running engine (its checkpoint again, fp32) and its pad id, warmed up."""
    # HF runs the dequantized fp32 weights: what the engine's native blocks compute, as HF reads a GGUF.
    ckpt = load_checkpoint(dataclasses.replace(engine.config.model, weights="dequantize"), torch.float32)
    model, pad_id = hf_model_from(ckpt.config, ckpt.state_dict), engine.model_config.eos_token_ids[0]
    generate_grouped(model, [[pad_id + 1] * 8], [4], pad_id, 1)
    return model, pad_id


@dataclass(frozen=True)
class HFRequestResult:
    token_ids: list[int]  # the request's own output length (a group generates to its longest)
    ttft: float  # seconds from the workload's start to this request's first token
    tpot: float | None  # mean seconds per token after the first, up to the request's own length
    latency: float  # seconds from the workload's start to the request's last useful token


def generate_grouped(model, prompts: Sequence[list[int]], output_lens: Sequence[int], pad_id: int, group_size: int,
                     on_group: Callable[[int], None] = lambda n: None) -> tuple[list[HFRequestResult], float]:
    """Requests in arrival order, `group_size` at a time, each group one left-padded greedy batch
    generating its longest request's length, EOS ignored; per-request results and wall seconds."""
    t_start, results = time.perf_counter(), []
    for i in range(0, len(prompts), group_size):
        group, lens, times = prompts[i:i + group_size], output_lens[i:i + group_size], []
        width, steps = max(map(len, group)), max(lens)
        ids = torch.tensor([[pad_id] * (width - len(p)) + list(p) for p in group])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group])
        # A streamer that only timestamps: its first put() is the prompt, then one per step.
        clock = SimpleNamespace(put=lambda _: times.append(time.perf_counter()), end=lambda: None)
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=steps, min_new_tokens=steps,
                                 do_sample=False, pad_token_id=pad_id, streamer=clock)
        results += [HFRequestResult(token_ids=out[row, width:width + n].tolist(), ttft=times[1] - t_start,
                                    tpot=(times[n] - times[1]) / (n - 1) if n > 1 else None, latency=times[n] - t_start)
                    for row, n in enumerate(lens)]
        on_group(len(group))
    return results, time.perf_counter() - t_start
