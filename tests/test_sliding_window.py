"""Sliding-window attention (Mistral's: every layer, a query at position p sees keys p - W + 1 .. p)
against transformers' own MistralForCausalLM on the same tiny random weights, window 8 and prompts
of 20-40 tokens: eager prefill and decode per attention backend (triton in Triton's interpreter
on the CPU), chunked prefill shorter and longer than the window, the decode graph on the op tape,
speculative verification, and GGUF.  The kernels' window against windowed SDPA / torch_native is
in tests/test_attention_cpu.py and tests/test_triton_attention.py.

Tolerance as tests/test_model_families.py's (fp32 both sides, summation order only)."""

from __future__ import annotations

import pytest
import torch

from graphexec import Engine, SamplingParams
from tests.reference import hf_greedy, hf_last_logits
from tests.test_model_families import ATOL, save_family, write_family_gguf

transformers = pytest.importorskip("transformers")

WINDOW = 8
NEW_TOKENS = 16


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 380, (n,), generator=gen).tolist() for n in (20, 33, 40)]
    # A repeated phrase: n-gram speculation finds drafts in it.
    prompts.append((prompts[0][:6] * 5)[:27])
    return prompts


PROMPTS = _prompts()
GREEDY = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
TAPE = ["capture=graph_first", "capture.decode.graph=tape", "capture.decode.buckets=[1,2,4]",
        "capture.decode.progress=false", "capture.extend.backend=eager"]


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    """A tiny Mistral whose window (8) is shorter than every prompt, and HF's greedy tokens for it."""
    path = tmp_path_factory.mktemp("mistral-swa")
    model = save_family("mistral", path, sliding_window=WINDOW)
    assert model.config.sliding_window == WINDOW
    expected = [hf_greedy(model, prompt, NEW_TOKENS)[0] for prompt in PROMPTS]
    return path, model, expected


def _engine(path, *overrides) -> Engine:
    return Engine(overrides=["model=hf", f"model.path={path}", "capture=eager", "cache.num_slots=1024", *overrides])


def _tokens(engine: Engine, prompts=PROMPTS) -> list[list[int]]:
    return [out.token_ids for out in engine.generate(prompts, GREEDY)]


def test_the_window_is_read_and_changes_the_model(mistral):
    """The checkpoint loads with its window, and the window matters on these prompts (HF with full
    attention picks other tokens): a backend that ignored it could not pass the tests below."""
    path, model, expected = mistral
    engine = _engine(path, "attention_backend=torch_native")
    assert engine.model_config.sliding_window == WINDOW
    assert engine.runner.attn_backend.sliding_window == WINDOW
    full = save_family("mistral", path.parent / "full", sliding_window=None)
    assert [hf_greedy(full, p, NEW_TOKENS)[0] for p in PROMPTS] != expected


@pytest.mark.parametrize("backend", ["cpu", "torch_native", "triton"])
def test_eager_logits_and_greedy_tokens_equal_transformers(mistral, backend):
    from tests.test_fidelity import _runner_logits

    if backend == "triton":
        pytest.importorskip("triton")

    path, model, expected = mistral
    engine = _engine(path, f"attention_backend={backend}")
    decode_tokens = [7, 8, 9, 10]
    prefill, decode = _runner_logits(engine, PROMPTS, decode_tokens)
    for i, (prompt, token) in enumerate(zip(PROMPTS, decode_tokens)):
        torch.testing.assert_close(prefill[i], hf_last_logits(model, prompt), atol=ATOL, rtol=0)
        torch.testing.assert_close(decode[i], hf_last_logits(model, prompt + [token]), atol=ATOL, rtol=0)
    # The prompts are cached now: these extend from a prefix longer than the window.
    outputs = engine.generate(PROMPTS, GREEDY)
    assert [o.cached_tokens for o in outputs] == [len(p) - 1 for p in PROMPTS]
    assert [o.token_ids for o in outputs] == expected


@pytest.mark.parametrize("backend", ["cpu", "torch_native", "triton"])
@pytest.mark.parametrize("chunk", [5, 16])  # prefill chunks shorter and longer than the window
def test_chunked_prefill_equals_transformers(mistral, backend, chunk):
    if backend == "triton":
        pytest.importorskip("triton")
    path, _, expected = mistral
    engine = _engine(path, f"attention_backend={backend}", f"scheduler.max_prefill_tokens={chunk}",
                     "scheduler.mixed_chunk=true")
    assert _tokens(engine) == expected


@pytest.mark.parametrize("backend", ["cpu", "torch_native", "triton"])
def test_decode_graph_on_the_tape_equals_transformers(mistral, backend):
    """The window inside a recorded decode graph, replayed at every step (torch_native: static
    decode metadata from the device's seq_lens; triton: each row's window start from its length
    on the device)."""
    from graphexec.batch.forward_mode import ForwardMode

    if backend == "triton":
        pytest.importorskip("triton")

    path, _, expected = mistral
    engine = Engine(overrides=["model=hf", f"model.path={path}", "cache.num_slots=1024",
                               f"attention_backend={backend}", *TAPE])
    graphs = engine.runner.backends[ForwardMode.DECODE]
    assert _tokens(engine) == expected
    assert graphs.stats.executions >= NEW_TOKENS - 1 and graphs.stats.fallbacks == 0


@pytest.mark.parametrize("backend", ["cpu", "torch_native"])
def test_speculative_verification_under_the_window(mistral, backend):
    """TARGET_VERIFY rows (each at its own seq_len) window like decode rows: n-gram speculation
    gives the tokens speculation off gives, which are HF's."""
    path, _, expected = mistral
    engine = _engine(path, f"attention_backend={backend}", "speculative=ngram", "speculative.policy=always")
    assert _tokens(engine) == expected
    assert engine.scheduler.speculator.stats().verify_steps > 0


def test_gguf_window_loads_and_equals_transformers(mistral, tmp_path):
    from graphexec.loader import load_gguf

    _, model, expected = mistral
    write_family_gguf(tmp_path / "m.gguf", "mistral", model, sliding_window=WINDOW)
    assert load_gguf(tmp_path / "m.gguf", "m").config.sliding_window == WINDOW
    engine = Engine(overrides=["model=hf", "model.source=gguf", f"model.path={tmp_path / 'm.gguf'}",
                               "capture=eager", "cache.num_slots=1024", "attention_backend=cpu"])
    assert _tokens(engine) == expected
