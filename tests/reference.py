"""Hugging Face transformers as the reference implementation, on the same weights as graphexec."""

from __future__ import annotations

import inspect

import torch

from graphexec.models.config import ModelConfig


def hf_model_from(config: ModelConfig, state_dict: dict[str, torch.Tensor]):
    """A transformers model with exactly these (HF-named) weights, fp32, eval mode."""
    import transformers

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
        hf_config = transformers.Qwen2Config(**common)
        model = transformers.Qwen2ForCausalLM(hf_config)
    else:
        hf_config = transformers.LlamaConfig(attention_bias=config.attention_bias, **common)
        model = transformers.LlamaForCausalLM(hf_config)
    missing, unexpected = model.load_state_dict({k: v.float() for k, v in state_dict.items()}, strict=False)
    # Tied heads are not stored separately; anything else missing is a test bug.
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    if config.tie_word_embeddings:
        model.tie_weights()
    return model.float().eval()


def hf_smollm2():
    import transformers

    from graphexec.loader import default_smollm2_gguf

    path = default_smollm2_gguf()
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()


@torch.no_grad()
def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens with HF's own KV cache (no EOS stop), and the logits of the prompt's last position."""
    from transformers import DynamicCache

    cache = DynamicCache()
    # transformers 5.x renamed the cache argument; accept both.
    cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    out = model(torch.tensor([prompt_ids]), use_cache=True, **{cache_arg: cache})
    first_logits = out.logits[0, -1].float()
    tokens = []
    logits = first_logits
    for _ in range(max_new_tokens):
        token = int(logits.argmax())
        tokens.append(token)
        out = model(torch.tensor([[token]]), use_cache=True, **{cache_arg: cache})
        logits = out.logits[0, -1].float()
    return tokens, first_logits


@torch.no_grad()
def hf_last_logits(model, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([ids])).logits[0, -1].float()
