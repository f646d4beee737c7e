"""Hugging Face transformers as the reference implementation, on the same weights as graphexec."""

from __future__ import annotations

import inspect
from pathlib import Path

import torch

from bench.hf_baseline import hf_model_from  # noqa: F401  (the tests import it from here)


def hf_smollm2(saved: Path | None = None):
    """transformers' SmolLM2 from the default GGUF, dequantized to fp32 (~30 s: transformers
    dequantizes in Python).  With `saved`, a file the test processes of one run share: the first
    to get there pickles its model there, the others load that copy (a second or two).  Pickled,
    because transformers refuses to save a model it loaded from a GGUF."""
    import transformers

    from graphexec.loader import default_smollm2_gguf

    path = default_smollm2_gguf()
    if saved is None:
        return transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    from filelock import FileLock

    with FileLock(f"{saved}.lock"):
        if not saved.exists():
            model = hf_smollm2()
            torch.save(model, saved)
            return model
    return torch.load(saved, weights_only=False).eval()


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
