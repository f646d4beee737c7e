"""Draft-model speculation: a model drafting for itself has every draft accepted, another model's
drafts change no greedy token, and the draft model's own KV is freed whenever a request stops
running (finished, aborted, retracted)."""

import time

import pytest
import torch

from graphexec import Engine, SamplingParams
from graphexec.batch.request import Req
from graphexec.config import EngineConfig, draft_model_source
from graphexec.errors import ConfigError
from graphexec.speculative.draft_model import DraftModelDrafter
from tests.invariants import assert_no_leak

TINY = ["model=tiny-llama", "cache.num_slots=2048", "capture=eager"]
DRAFT = ["speculative=draft_model", "speculative.policy=always"]


def _ids(n, seed, vocab=320):
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _prompts():
    return [_ids(6 + 5 * i, 40 + i) for i in range(4)]


def _greedy(n=40):
    return SamplingParams(max_new_tokens=n, ignore_eos=True)


def _assert_draft_clean(engine) -> None:
    kv = engine.draft.kv_cache
    kv.audit()
    assert not kv.holders()
    assert kv.num_free_rows == kv.req_to_token_pool.max_requests
    assert kv.num_free + kv.num_cached == kv.num_slots


@pytest.fixture(scope="module")
def expected():
    return [o.token_ids for o in Engine(overrides=TINY).generate(_prompts(), _greedy())]


def test_a_shadow_synced_to_any_history_drafts_like_one_built_from_scratch():
    """Whatever verification kept of last step's drafts (all and a bonus token, some, none), the
    synced shadow's draft equals a fresh drafter's over the same ids: its KV was cut back right."""
    engine = Engine(overrides=TINY + DRAFT + ["speculative.draft_model=tiny-qwen2"])
    drafter = engine.scheduler.speculator.drafter
    fresh = DraftModelDrafter(engine.draft.runner, engine.draft.kv_cache)
    req = Req("r", _ids(9, 5), _greedy(), (), engine.max_context, output_ids=[7])

    def check(room):
        got = drafter.propose_batch([req], [room])[0]
        alone = Req("alone", list(req.prompt_ids), req.params, (), engine.max_context, output_ids=list(req.output_ids))
        assert got == fresh.propose_batch([alone], [room])[0]
        fresh.forget(alone)
        assert len(got) == room
        return got

    draft = check(4)
    req.output_ids += [draft[0], draft[1]]  # one accepted, and a bonus token that was drafted too
    draft = check(4)
    req.output_ids += [*draft, 3]  # every draft accepted, and a bonus token
    draft = check(2)
    req.output_ids += [(draft[0] + 1) % 320]  # the first draft rejected
    draft = check(3)
    assert engine.draft.kv_cache.holders() != []
    drafter.forget(req)
    _assert_draft_clean(engine)


def test_the_cost_policy_changes_no_greedy_token(expected):
    engine = Engine(overrides=TINY + ["speculative=draft_model", "speculative.draft_model=tiny-llama"])
    assert [o.token_ids for o in engine.generate(_prompts(), _greedy())] == expected
    assert_no_leak(engine)
    _assert_draft_clean(engine)


def test_a_model_drafting_for_itself_has_every_draft_accepted(expected):
    engine = Engine(overrides=TINY + DRAFT + ["speculative.draft_model=tiny-llama"])
    assert [o.token_ids for o in engine.generate(_prompts(), _greedy())] == expected
    stats = engine.scheduler.speculator.stats()
    assert stats.verify_steps > 0 and stats.drafted_tokens > 0
    assert stats.accepted_tokens == stats.drafted_tokens
    # Four drafts and the bonus token per step: far fewer steps than tokens.
    assert stats.verify_steps < 40 / 3
    assert_no_leak(engine)
    _assert_draft_clean(engine)


def test_another_draft_model_changes_no_greedy_token(expected):
    # tiny-qwen2: the same vocabulary, other weights, a shorter context (256).
    engine = Engine(overrides=TINY + DRAFT + ["speculative.draft_model=tiny-qwen2", "speculative.num_draft_tokens=3"])
    assert [o.token_ids for o in engine.generate(_prompts(), _greedy())] == expected
    stats = engine.scheduler.speculator.stats()
    assert stats.verify_steps > 0
    assert stats.accepted_tokens < stats.drafted_tokens
    assert_no_leak(engine)
    _assert_draft_clean(engine)


def test_sampled_requests_draft_and_free_their_draft_kv():
    engine = Engine(overrides=TINY + DRAFT + ["speculative.draft_model=tiny-qwen2"])
    params = SamplingParams(max_new_tokens=30, ignore_eos=True, temperature=0.8, seed=3)
    outputs = engine.generate(_prompts(), params)
    assert all(len(o.token_ids) == 30 for o in outputs)
    assert engine.scheduler.speculator.stats().verify_steps > 0
    assert_no_leak(engine)
    _assert_draft_clean(engine)


def test_an_abort_mid_generation_frees_the_draft_kv():
    # Driven by hand (the engine serves nothing), so the abort surely lands mid-generation.
    engine = Engine(overrides=TINY + DRAFT + ["speculative.draft_model=tiny-llama"])
    scheduler = engine.scheduler
    reqs = [Req(f"a{i}", p, _greedy(120), (), engine.max_context) for i, p in enumerate(_prompts()[:2])]
    for req in reqs:
        scheduler.add_request(req)
    while scheduler.speculator.stats().verify_steps < 3:
        scheduler.step()
    assert len(engine.draft.kv_cache.holders()) == 2
    assert scheduler.abort("a0")
    assert len(engine.draft.kv_cache.holders()) == 1
    while scheduler.has_unfinished():
        scheduler.step()
    assert reqs[0].finish_reason.value == "abort" and len(reqs[1].output_ids) == 120
    assert_no_leak(engine)
    _assert_draft_clean(engine)


def test_retraction_frees_the_draft_kv_and_keeps_every_token():
    prompts = [_ids(12 + 3 * i, 90 + i) for i in range(6)]
    params = _greedy(40)
    expected = [o.token_ids for o in Engine(overrides=TINY).generate(prompts, params)]
    engine = Engine(
        overrides=TINY + DRAFT + ["speculative.draft_model=tiny-llama", "cache.num_slots=120", "scheduler.max_running_requests=8"]
    )
    assert [o.token_ids for o in engine.generate(prompts, params)] == expected
    assert engine.metrics().retractions_total > 0
    assert engine.scheduler.speculator.stats().verify_steps > 0
    assert_no_leak(engine)
    _assert_draft_clean(engine)


def test_a_small_draft_pool_drafts_less_and_changes_nothing(expected):
    """A draft pool too small for every request: the ones that do not fit draft nothing that step."""
    engine = Engine(overrides=TINY + DRAFT + ["speculative.draft_model=tiny-llama", "speculative.draft_num_slots=60"])
    assert engine.draft.kv_cache.num_slots == 60
    assert [o.token_ids for o in engine.generate(_prompts(), _greedy())] == expected
    stats = engine.scheduler.speculator.stats()
    assert stats.verify_steps > 0 and stats.accepted_tokens == stats.drafted_tokens
    assert_no_leak(engine)
    _assert_draft_clean(engine)


@pytest.mark.parametrize("background", [False, True])
def test_the_draft_model_runs_on_its_own_captured_graphs(expected, background):
    """The draft runner gets the engine's capture plan: captured before serving, or while idle
    after the target's buckets; greedy tokens are the same either way."""
    overrides = [
        "model=tiny-llama", "cache.num_slots=2048", "capture=auto", "capture.cache_dir=null",
        "capture.decode.graph=tape", "capture.decode.buckets=[1,2,4]", "capture.decode.keep=all",
        "capture.decode.progress=false", f"capture.background={str(background).lower()}", "capture.idle_delay_s=0",
        *DRAFT, "speculative.draft_model=tiny-llama",
    ]
    with Engine(overrides=overrides) as engine:
        deadline = time.monotonic() + 60
        while (engine.runner.capture_pending() or engine.draft.runner.capture_pending()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [o.token_ids for o in engine.generate(_prompts(), _greedy())] == expected
        stats = engine.draft.runner.backend_stats()["decode"]
        assert {s["state"] for s in stats["buckets"].values()} == {"ready"}
        assert stats["executions"] > 0
        assert engine.scheduler.speculator.stats().verify_steps > 0
        assert_no_leak(engine)
        _assert_draft_clean(engine)


def test_the_draft_options_compose_and_travel_as_plain_data():
    config = EngineConfig.from_overrides(TINY + ["speculative=draft_model", "speculative.draft_model=tiny-qwen2"])
    assert config.speculative.method == "draft_model" and config.speculative.draft_num_slots is None
    assert EngineConfig.from_mapping(config.to_plain()) == config
    assert draft_model_source(config.speculative).name == "tiny-qwen2"


def test_draft_model_config_errors_name_the_option():
    with pytest.raises(ConfigError, match=r"speculative\.draft_model"):
        Engine(overrides=TINY + ["speculative=draft_model"])
    with pytest.raises(ConfigError, match=r"speculative\.draft_model='nope' is unknown"):
        Engine(overrides=TINY + ["speculative=draft_model", "speculative.draft_model=nope"])
    with pytest.raises(ConfigError, match=r"speculative\.draft_num_slots"):
        Engine(overrides=TINY + ["speculative=draft_model", "speculative.draft_model=tiny-llama", "speculative.draft_num_slots=0"])


def test_a_draft_model_of_another_vocabulary_is_refused():
    with pytest.raises(ConfigError, match=r"speculative\.draft_model='smollm2-135m-random'.*49152.*320"):
        Engine(overrides=TINY + ["speculative=draft_model", "speculative.draft_model=smollm2-135m-random"])
