"""Prompt logprobs (SamplingParams.prompt_logprobs): the model's log-probability of every prompt
token equals transformers' log-softmax on the same weights, whole, chunked and behind a cached
prefix."""

import pytest
import torch

from graphexec import Engine, SamplingParams
from graphexec.errors import InvalidRequestError
from tests.invariants import assert_no_leak

TEXT = "The quick brown fox jumps over the lazy dog. Graphs make decoding fast, and"
# graphexec's logits are within 2e-3 of transformers' (tests/test_fidelity.py: native Q4_1/Q8_0
# kernels against HF on the dequantized fp32 weights); a log-softmax subtracts a logsumexp that
# moves by at most the largest logit error, so an entry is within twice that.
ATOL = 4e-3


def _hf_prompt_logprobs(model, ids: list[int]) -> torch.Tensor:
    """[len(ids) - 1]: log p(ids[i] | ids[:i]) for i >= 1, by transformers."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    return logits[:-1].log_softmax(-1).gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)


def _check(output, ids: list[int], expected: torch.Tensor, top_k: int) -> None:
    entries = output.prompt_logprobs
    assert len(entries) == len(ids) and entries[0] is None
    assert [e["token_id"] for e in entries[1:]] == ids[1:]
    got = torch.tensor([e["logprob"] for e in entries[1:]])
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
    for e in entries[1:]:
        top = e.get("top", [])
        assert len(top) == top_k and all(a[1] >= b[1] for a, b in zip(top, top[1:]))
        if top and top[0][0] == e["token_id"]:
            assert e["logprob"] == top[0][1]  # the same float: clients test greed by equality


def test_prompt_logprobs_equal_transformers(smollm2_engine, hf_smollm2):
    engine = smollm2_engine
    engine.flush_cache()
    ids = engine.tokenizer.encode(TEXT)
    expected = _hf_prompt_logprobs(hf_smollm2, ids)
    out = engine.generate([ids], SamplingParams(max_new_tokens=2, prompt_logprobs=3))[0]
    _check(out, ids, expected, top_k=3)
    assert len(out.token_ids) == 2

    # Behind a cached prefix: the prompt was just cached, yet every entry is computed again.
    again = engine.generate([ids], SamplingParams(max_new_tokens=1, prompt_logprobs=0))[0]
    _check(again, ids, expected, top_k=0)
    assert again.cached_tokens == 0
    # Without prompt_logprobs the same prompt does reuse the cache (the test is not vacuous).
    assert engine.generate([ids], SamplingParams(max_new_tokens=1))[0].cached_tokens > 0
    assert_no_leak(engine)


def test_prefill_only_request_returns_prompt_logprobs(smollm2_engine, hf_smollm2):
    """max_new_tokens=0 with prompt_logprobs: prefilled, no token generated, entries complete;
    batched with a request that does generate."""
    engine = smollm2_engine
    ids = engine.tokenizer.encode(TEXT)
    other = engine.tokenizer.encode("Hello there")
    outs = engine.generate([ids, other], [SamplingParams(max_new_tokens=0, prompt_logprobs=1), SamplingParams(max_new_tokens=3)])
    assert outs[0].token_ids == [] and outs[0].finish_reason == "length"
    _check(outs[0], ids, _hf_prompt_logprobs(hf_smollm2, ids), top_k=1)
    assert outs[1].prompt_logprobs is None and len(outs[1].token_ids) == 3
    # No prompt logprobs and no tokens asked: nothing to run, finishes at once.
    assert engine.generate([ids], SamplingParams(max_new_tokens=0))[0].prompt_logprobs is None
    assert_no_leak(engine)


@pytest.mark.slow
def test_chunked_prefill_gives_every_entry(hf_smollm2):
    """A prompt prefilled 7 tokens at a time, beside a request that decodes."""
    engine = Engine(overrides=["model=smollm2-135m", "capture=eager", "scheduler.max_prefill_tokens=7"])
    ids = engine.tokenizer.encode(TEXT * 2)
    params = [SamplingParams(max_new_tokens=2, prompt_logprobs=2), SamplingParams(max_new_tokens=8)]
    outs = engine.generate([ids, engine.tokenizer.encode("Hi")], params)
    _check(outs[0], ids, _hf_prompt_logprobs(hf_smollm2, ids), top_k=2)
    assert_no_leak(engine)
    engine.shutdown()


@pytest.mark.parametrize("value", [-1, 21, 1.5, True, "2"])
def test_bad_prompt_logprobs_are_refused(value):
    with pytest.raises(InvalidRequestError, match="prompt_logprobs must be None"):
        SamplingParams(prompt_logprobs=value)
