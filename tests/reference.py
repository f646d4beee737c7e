"""Hugging Face transformers as the reference implementation, on the same weights as graphexec."""

from __future__ import annotations

import inspect

import torch

from bench.hf_baseline import hf_model_from  # noqa: F401  (the tests import it from here)


def hf_smollm2():
    import transformers

    from graphexec.loader import default_smollm2_gguf

    path = default_smollm2_gguf()
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()


def hf_smollm2_tokenizer():
    import transformers

    from graphexec.loader import default_smollm2_gguf

    path = default_smollm2_gguf()
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


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
