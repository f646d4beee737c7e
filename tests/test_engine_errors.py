"""Bad input gets a ValueError naming the problem; the engine keeps serving and leaks nothing."""

import pytest

from graphexec import CheckpointError, ConfigError, Engine, InvalidRequestError, SamplingParams
from tests.conftest import TINY_OVERRIDES
from tests.invariants import assert_no_leak


@pytest.fixture(scope="module")
def engine():
    return Engine(overrides=TINY_OVERRIDES + ["cache.max_context=64"])


BAD_REQUESTS = [
    ([[]], None, "prompt 0 is empty"),
    ([""], None, "prompt 0 is empty"),
    ([[1, 2], list(range(3, 3 + 64))], None, "prompt 1 has 64 tokens; the context limit is 64"),
    ([[1, 2, 9999]], None, "token id 9999 outside the vocabulary [0, 320)"),
    ([[1, -1]], None, "token id -1 outside the vocabulary"),
    ([[1.5, 2]], None, "prompt 0 must be a string or a list of token ids"),
    ("just a string", None, "prompts must be a list"),
    ([[1], [2]], [SamplingParams()], "one SamplingParams or a list of 2"),
]


@pytest.mark.parametrize("prompts,params,message", BAD_REQUESTS)
def test_bad_request_rejected_then_engine_serves(engine, prompts, params, message):
    with pytest.raises(InvalidRequestError) as err:
        engine.generate(prompts, params)
    assert message in str(err.value)
    assert_no_leak(engine)
    (out,) = engine.generate([[5, 6, 7]], SamplingParams(max_new_tokens=4, ignore_eos=True))
    assert len(out.token_ids) == 4
    assert_no_leak(engine)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(max_new_tokens=-1), "max_new_tokens must be >= 0"),
        (dict(temperature=-0.5), "temperature must be >= 0"),
        (dict(top_p=0.0), "top_p must be in (0, 1]"),
        (dict(top_p=1.5), "top_p must be in (0, 1]"),
    ],
)
def test_bad_sampling_params(kwargs, message):
    with pytest.raises(ValueError) as err:
        SamplingParams(**kwargs)
    assert isinstance(err.value, InvalidRequestError) and message in str(err.value)


def test_request_larger_than_kv_pool_is_rejected():
    engine = Engine(overrides=["model=tiny-llama", "capture=eager", "cache.num_slots=16"])
    with pytest.raises(InvalidRequestError, match="needs up to 20 KV slots .* raise cache.num_slots"):
        engine.generate([[1] * 10], SamplingParams(max_new_tokens=10))
    (out,) = engine.generate([[1] * 10], SamplingParams(max_new_tokens=6, ignore_eos=True))
    assert len(out.token_ids) == 6
    assert_no_leak(engine)


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["model=no-such-model"], "model='no-such-model' is unknown; available: ["),
        (["capture=no-such-plan"], "capture='no-such-plan' is unknown"),
        (["capture.decode.backend=warp_drive"], "capture.decode.backend='warp_drive' is unknown"),
        (["model.dtype=float8"], "model.dtype must be one of"),
        (["model.weights=int3"], "model.weights must be one of"),
        (["cache.dtype=int8"], "cache.dtype must be null or one of"),
        (["device=tpu"], "device must be 'cpu' or 'cuda"),
        (["scheduler.max_running_requests=0"], "scheduler.max_running_requests must be an integer >= 1"),
        (["cache.num_slots=-5"], "cache.num_slots must be an integer >= 1"),
        (["+scheduler.turbo=true"], "scheduler.turbo is not an option"),
        (["sampling.top_p=2"], "top_p must be in (0, 1]"),
        (["attention_backend=flashy"], "attention_backend='flashy' is unknown"),
    ],
)
def test_bad_config_names_the_option(overrides, message):
    with pytest.raises(ConfigError if "top_p" not in message else ValueError) as err:
        Engine(overrides=["model=tiny-llama"] + overrides)
    assert message in str(err.value)


def test_missing_checkpoint_paths_are_named(tmp_path):
    missing = tmp_path / "nope.gguf"
    with pytest.raises(CheckpointError, match="nope.gguf"):
        Engine(overrides=[f"model.path={missing}"])
    with pytest.raises(CheckpointError, match="not-a-dir"):
        Engine(overrides=["model=hf", f"model.path={tmp_path / 'not-a-dir'}"])
    with pytest.raises(ConfigError, match="model.path is required"):
        Engine(overrides=["model=hf"])
