"""Speculative decoding: the TARGET_VERIFY forward equals sequential decode steps, greedy outputs
equal speculation off, sampled outputs keep their distribution, and the KV holds accepted tokens
only."""

import math

import pytest
import torch

from graphexec import Engine, SamplingParams
from graphexec.batch.forward_mode import ForwardMode
from graphexec.batch.request import Req
from graphexec.sampling.sampler import Sampler, SamplingBatchInfo
from graphexec.scheduler.hand_batches import HandBatches
from graphexec.speculative.cost_model import StepCosts
from graphexec.speculative.ngram import NgramDrafter
from graphexec.speculative.policy import choose_lengths
from tests.helpers import recorded_batches
from tests.invariants import assert_no_leak

TINY = ["model=tiny-llama", "cache.num_slots=2048", "capture=eager"]
SPEC = ["speculative=ngram", "speculative.policy=always"]
TAPE = [
    "capture=graph_first",
    "capture.decode.graph=tape",
    "capture.decode.buckets=[1,2,4,8]",
    "capture.decode.progress=false",
    "capture.extend.backend=eager",
]


def _ids(n, seed, vocab=320):
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# ---- drafting and policy ------------------------------------------------------------------------


def test_ngram_drafts_the_continuation_of_the_longest_latest_match():
    drafter = NgramDrafter(ngram_min=1, ngram_max=3)
    owner = object.__new__(Req)
    ids = [1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3]
    # "1 2 3" occurred twice before: the latest occurrence (followed by 7 5) wins.
    assert drafter.propose(owner, ids, 2) == (7, 5)
    assert drafter.propose(owner, ids, 10) == (7, 5, 1, 2, 3)
    # The text grows: the index follows without being rebuilt; the suffix never matches itself.
    ids += [4]
    assert drafter.propose(owner, ids, 3) == ()
    ids += [1, 2]
    assert drafter.propose(owner, ids, 3) == (3, 4, 1)
    assert drafter.propose(owner, [5, 6], 3) == ()
    assert NgramDrafter(2, 3).propose(object.__new__(Req), [1, 2, 5, 2], 3) == ()  # only 1-grams match


def test_policy_drafts_only_where_it_pays():
    costs = StepCosts()
    costs.observe(1, 0.010)
    costs.observe(4, 0.012)  # cheap extra rows (weight-bound)
    assert choose_lengths([0.9], [3], costs, spare_rows=100) == [3]
    assert choose_lengths([0.9], [3], costs, spare_rows=2) == [2]
    assert choose_lengths([0.9], [3], StepCosts(), spare_rows=100) == [0]  # nothing measured yet
    for _ in range(8):  # extra rows now cost as much as whole steps (compute-bound): the cheap samples age out
        costs.observe(4, 0.040)
    assert choose_lengths([0.9], [3], costs, spare_rows=100) == [0]
    costs.observe(4, 0.120)  # one slow step (a neighbour) does not change the price
    assert choose_lengths([0.9], [3], costs, spare_rows=100) == [0]
    costs.observe(4, 0.025)
    assert choose_lengths([0.9], [3], costs, spare_rows=100) == [3]
    # The best requests draft first: at a batch of 2, one good request's rows are worth taking.
    costs = StepCosts()
    for rows, seconds in [(2, 0.010), (3, 0.0105), (4, 0.011), (5, 0.020)]:
        costs.observe(rows, seconds)
    assert choose_lengths([0.95, 0.05], [2, 2], costs, spare_rows=100) == [2, 0]


# ---- the forward --------------------------------------------------------------------------------


def _start(engine, prompt):
    """A hand-run request with its prompt prefilled and its first token appended."""
    hand, runner = HandBatches(engine.kv_cache), engine.runner
    req = Req(f"r{len(prompt)}", prompt, SamplingParams(max_new_tokens=32, ignore_eos=True), (), engine.max_context)
    batch = hand.extend([req])
    logits, _ = runner.forward_logits(runner.init_forward_batch(batch))
    hand.ran(batch, [int(logits[0].argmax())])
    return req


def _sequential(engine, req, tokens):
    """Logits of decoding `tokens` (the first is the request's last) one step at a time; the
    request is then rewound (its KV unmapped, its ids restored)."""
    hand, runner = HandBatches(engine.kv_cache), engine.runner
    start, outputs = req.num_computed_tokens, list(req.output_ids)
    rows = []
    for next_token in [*tokens[1:], None]:
        batch = hand.decode([req])
        logits, _ = runner.forward_logits(runner.init_forward_batch(batch))
        hand.ran(batch, None if next_token is None else [next_token])
        rows.append(logits[0])
    req.output_ids[:] = outputs
    hand.rewind(req, start)
    return torch.stack(rows)


@pytest.mark.parametrize(
    "attention,plan",
    [("cpu", "eager"), ("torch_native", "eager"), ("cpu", "tape"), ("torch_native", "tape"), ("triton", "eager")],
)
def test_verify_forward_equals_sequential_decode(attention, plan):
    """Three requests verifying 3, 0 and 1 drafts (7 rows: bucket 8, padded) give, row for row, the
    logits of decoding the same tokens one step at a time; rejected rows' KV is unmapped after."""
    if attention == "triton":
        pytest.importorskip("triton")
    engine = Engine(overrides=TINY + [f"attention_backend={attention}"] + (TAPE if plan == "tape" else []))
    reqs = [_start(engine, _ids(n, seed)) for seed, n in enumerate((9, 17, 5))]
    drafts = [_ids(3, 10), [], _ids(1, 11)]
    expected = [_sequential(engine, r, [r.output_ids[-1], *d]) for r, d in zip(reqs, drafts)]

    hand = HandBatches(engine.kv_cache)
    fb = engine.runner.init_forward_batch(hand.verify(reqs, drafts))
    assert fb.forward_mode is ForwardMode.TARGET_VERIFY and fb.batch_size == 7
    assert fb.positions.tolist() == [9, 10, 11, 12, 17, 5, 6]
    backend = engine.runner.backends[ForwardMode.TARGET_VERIFY]
    executions = backend.stats.executions
    logits, _ = engine.runner.forward_logits(fb)
    if plan == "tape":  # the decode graphs ran it, padded to the 8-row bucket
        assert backend is engine.runner.backends[ForwardMode.DECODE]
        assert backend.stats.executions == executions + 1
    # fp32 throughout; the kernels reduce in another order for a row that sees more keys at once.
    torch.testing.assert_close(logits, torch.cat(expected), atol=2e-4, rtol=1e-4)
    for req in reqs:
        hand.rewind(req, req.num_computed_tokens)
        hand.release(req)
    assert_no_leak(engine)


# ---- acceptance: greedy identity, distribution, KV ---------------------------------------------


def _copy_workload():
    """Prompts that repeat themselves (drafts find matches) and plain random ones; stop strings,
    stop tokens and max_tokens that end requests inside a draft."""
    prompts, params = [], []
    for seed in range(10):
        base = _ids(6 + seed, seed)
        prompt = base * 3 if seed % 2 == 0 else _ids(20, 100 + seed)
        prompts.append(prompt)
        params.append(SamplingParams(max_new_tokens=64 - 3 * seed, ignore_eos=True))
    return prompts, params


@pytest.fixture(scope="module")
def plain_outputs():
    prompts, params = _copy_workload()
    return Engine(overrides=TINY).generate(prompts, params)


PLANS = {
    "eager": [],
    "tape": TAPE,
    # The CPU's graphs: one compiled bucket that every decode and verify batch pads into.
    "compile": [*TAPE, "capture.decode.graph=compile", "capture.decode.buckets=[8]", "capture.decode.compile.aot=false"],
}


@pytest.mark.parametrize("plan", PLANS)
def test_greedy_outputs_equal_speculation_off(plan, plain_outputs):
    engine = Engine(overrides=TINY + SPEC + PLANS[plan])
    prompts, params = _copy_workload()
    decode = engine.runner.backends[ForwardMode.DECODE]
    before = decode.stats.executions, decode.stats.fallbacks
    with recorded_batches(engine) as batches:
        outputs = engine.generate(prompts, params)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in plain_outputs]
    assert [o.finish_reason for o in outputs] == [o.finish_reason for o in plain_outputs]
    stats = engine.scheduler.speculator.stats()
    verified = [fb for fb in batches if fb.forward_mode.is_target_verify()]
    assert verified and stats.verify_steps == len(verified)
    assert 0 < stats.accepted_tokens < stats.drafted_tokens
    if plan != "eager":  # decode and verify batches that fit the largest bucket ran on the graphs
        rows = [fb.batch_size for fb in batches if not fb.forward_mode.is_extend()]
        assert decode.stats.executions - before[0] == sum(r <= 8 for r in rows)
        assert decode.stats.fallbacks - before[1] == sum(r > 8 for r in rows)
        assert any(fb.batch_size <= 8 for fb in verified)
    assert_no_leak(engine)


def test_stops_inside_a_draft_end_where_they_would_without_speculation(plain_outputs):
    """A stop token, a stop string and max_tokens that fall inside a verified draft."""
    prompts, _ = _copy_workload()
    engine = Engine(overrides=TINY + SPEC)
    plain = Engine(overrides=TINY)
    tokens = plain_outputs[0].token_ids
    text = engine.tokenizer.decode(tokens)
    cases = [
        SamplingParams(max_new_tokens=64, stop_token_ids=[tokens[20]]),
        SamplingParams(max_new_tokens=64, ignore_eos=True, stop=[text[30:33]]),
        SamplingParams(max_new_tokens=23, ignore_eos=True),
        SamplingParams(max_new_tokens=64, ignore_eos=True, logprobs=2),
    ]
    for params in cases:
        with recorded_batches(engine) as batches:
            (spec,) = engine.generate([prompts[0]], params)
        (ref,) = plain.generate([prompts[0]], params)
        assert any(fb.forward_mode.is_target_verify() for fb in batches)
        assert (spec.token_ids, spec.text, spec.finish_reason) == (ref.token_ids, ref.text, ref.finish_reason)
        assert spec.stop_token_id == ref.stop_token_id
        if params.logprobs:
            assert [e["token_id"] for e in spec.logprobs] == [e["token_id"] for e in ref.logprobs]
            assert [e["logprob"] for e in spec.logprobs] == pytest.approx([e["logprob"] for e in ref.logprobs], abs=1e-4)
        assert_no_leak(engine)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_new_tokens=40, ignore_eos=True, frequency_penalty=0.4, presence_penalty=0.3),
        SamplingParams(max_new_tokens=40, min_tokens=30, stop_token_ids=[60, 61, 62, 63, 64, 65]),
    ],
    ids=["frequency-presence", "min_tokens"],
)
def test_penalties_and_min_tokens_see_each_rows_drafts(params):
    """Each verified row is penalised over its request's outputs plus the drafts before it, and
    min_tokens counts them too: the same tokens as without speculation."""
    prompts, _ = _copy_workload()
    engine = Engine(overrides=TINY + SPEC + ["speculative.ngram_min=1"])  # penalised text repeats less
    with recorded_batches(engine) as batches:
        (spec,) = engine.generate([prompts[0]], params)
    (ref,) = Engine(overrides=TINY).generate([prompts[0]], params)
    assert (spec.token_ids, spec.finish_reason) == (ref.token_ids, ref.finish_reason)
    assert any(fb.forward_mode.is_target_verify() for fb in batches)
    assert_no_leak(engine)


def test_seeded_sampling_is_reproducible_and_aborts_leak_nothing():
    prompts, _ = _copy_workload()
    engine = Engine(overrides=TINY + SPEC)
    params = SamplingParams(max_new_tokens=48, ignore_eos=True, temperature=0.8, top_k=40, seed=7)
    first = engine.generate(prompts[:4], params)
    second = engine.generate(prompts[:4], params)
    assert [o.token_ids for o in first] == [o.token_ids for o in second]
    assert engine.scheduler.speculator.stats().verify_steps > 0
    # An abort between steps of speculating requests leaves nothing behind.
    stream = engine.stream(prompts[0], SamplingParams(max_new_tokens=200, ignore_eos=True))
    deltas = iter(stream)
    next(deltas)
    assert engine.abort(stream.request_id)
    assert list(deltas)[-1].finish_reason == "abort"
    assert_no_leak(engine)


def test_rejection_sampling_preserves_the_distribution():
    """Rows with a deterministic draft (likely, unlikely, filtered out by top-k) yield tokens
    distributed as the sampler's own distribution; chi-square over 40,000 draws each."""
    torch.manual_seed(0)
    vocab, n = 8, 40_000
    logits_row = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])
    sampler = Sampler()
    for draft, top_k, temperature in [(0, -1, 1.0), (6, -1, 0.7), (7, 4, 1.3), (2, 3, 1.0)]:
        params = SamplingParams(temperature=temperature, top_k=top_k)
        expected = logits_row / temperature
        if top_k > 0:
            expected = expected.masked_fill(expected < expected.topk(top_k).values[-1], -math.inf)
        expected = expected.softmax(-1)
        info = SamplingBatchInfo.from_params([params] * n, [None] * n, vocab, "cpu", draft_tokens=[draft] * n)
        tokens = sampler(logits_row.expand(n, vocab).clone(), info).next_token_ids
        counts = torch.bincount(tokens, minlength=vocab).double()
        live = expected > 0
        assert counts[~live].sum() == 0
        chi2 = float(((counts[live] - n * expected[live]) ** 2 / (n * expected[live])).sum())
        # 99.9th percentile of chi-square with up to 7 degrees of freedom.
        assert chi2 < 24.3, (draft, top_k, temperature, chi2)


@pytest.mark.parametrize("chunk", [2, 3, 5])
def test_a_stop_string_inside_a_multi_token_step_ends_at_its_token(chunk):
    """Tokens that arrive several per step (a verified draft) end at the token that completes the
    stop string, with the same text, ids and logprobs as when they arrive one per step."""
    from graphexec.engine.request_tracker import RequestTracker
    from graphexec.text.tokenizer import ByteTokenizer

    tokenizer = ByteTokenizer()
    ids = tokenizer.encode("hello world, stop here")

    def run(step):
        params = SamplingParams(max_new_tokens=64, stop=["wor"], logprobs=0)
        req = Req("r", [1, 2], params, (), 512)
        tracker, deltas = RequestTracker(req, lambda d: True, tokenizer, 0.0), []
        for start in range(0, len(ids), step):
            for token in ids[start : start + step]:
                req.append_token(token)
                req.output_logprobs.append({"token_id": token, "logprob": -1.0})
            deltas.append(tracker.collect(1.0))
            if tracker.finished:
                break
        return deltas[-1].output, [t for d in deltas for t in d.token_ids]

    one_by_one, many = run(1), run(chunk)
    assert one_by_one[0].token_ids == ids[: ids.index(ord("r")) + 1]
    assert many[1] == one_by_one[1] == one_by_one[0].token_ids
    out, ref = many[0], one_by_one[0]
    assert (out.token_ids, out.text, out.finish_reason, out.logprobs) == (ref.token_ids, ref.text, "stop", ref.logprobs)


def test_the_server_reports_speculation(plain_outputs):
    """graphexec-serve with speculation: the same completion as without, and /metrics and
    /metrics/json report verify steps, drafted and accepted tokens and the accepted lengths."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    from graphexec.server.app import create_app
    from tests.helpers import ServerThread, server_config

    prompts, params = _copy_workload()
    with Engine(overrides=TINY + SPEC) as engine, ServerThread(create_app(engine, server_config())) as server:
        body = {"model": "tiny-llama", "prompt": prompts[0], "max_tokens": params[0].max_new_tokens, "ignore_eos": True}
        with httpx.Client(timeout=60) as http:
            for _ in range(3):
                answer = http.post(f"{server.url}/v1/completions", json=body).json()
                assert answer["usage"]["completion_tokens"] == len(plain_outputs[0].token_ids)
            spec = http.get(f"{server.url}/metrics/json").json()["speculation"]
            scraped = {
                (s.name, tuple(s.labels.items())): s.value
                for family in text_string_to_metric_families(http.get(f"{server.url}/metrics").text)
                for s in family.samples
            }
    assert spec["verify_steps"] > 0 and 0 < spec["accepted_tokens"] <= spec["drafted_tokens"]
    assert scraped[("graphexec_spec_verify_steps_total", ())] == spec["verify_steps"]
    assert scraped[("graphexec_spec_accepted_tokens_total", ())] == spec["accepted_tokens"]
    verified = sum(v for (name, _), v in scraped.items() if name == "graphexec_spec_accepted_length_total")
    assert verified == sum(spec["accepted_lengths"].values()) > 0


_PASSAGE = (
    "Graph capture records a forward once and replays it many times, so the host does not pay for "
    "launching every kernel again. A decode step is weight bound on a small machine, so checking "
    "several tokens at once costs little more than checking one."
)
_CODE = "def area(width, height):\n    result = width * height\n    return result\n"
SMOL_PROMPTS = [
    f"Repeat the following text exactly, word for word:\n\n{_PASSAGE}",
    f"Copy this code exactly:\n\n{_CODE}",
    f"Repeat this sentence three times: {_PASSAGE.split('. ')[0]}.",
    f"Correct the spelling in this paragraph and return the whole paragraph:\n\n{_PASSAGE.replace('once', 'onse')}",
    "Write a short story about a robot who learns to paint.",
    "What are three good habits for studying?",
    "Explain why the sky is blue.",
    "List the days of the week.",
]


def test_smollm2_greedy_outputs_equal_speculation_off(smollm2_engine):
    """SmolLM2 (Q4/Q8 native weights, C++ kernels), 8 chat prompts x 64 tokens in one batch,
    copy-heavy and open-ended, with stop strings and a max_tokens inside drafts."""
    engine = Engine(overrides=["model=smollm2-135m", "capture=eager", "cache.num_slots=8192", *SPEC])
    params = [SamplingParams(max_new_tokens=64) for _ in SMOL_PROMPTS]
    params[0] = SamplingParams(max_new_tokens=64, stop=["tokens at once"])
    params[2] = SamplingParams(max_new_tokens=37, logprobs=1)
    ref = smollm2_engine.generate(SMOL_PROMPTS, params, chat=True)
    spec = engine.generate(SMOL_PROMPTS, params, chat=True)
    for r, s in zip(ref, spec):
        assert (s.token_ids, s.text, s.finish_reason) == (r.token_ids, r.text, r.finish_reason)
    assert spec[0].finish_reason == "stop" and spec[0].text.endswith("checking several "), spec[0].text
    stats = engine.metrics().speculation
    assert stats["acceptance_rate"] > 0.5, stats  # the copy prompts copy
    assert_no_leak(engine)


def test_smollm2_structured_output_drafts_only_what_the_grammar_allows(smollm2_engine):
    """JSON-schema requests draft (their repeated keys match earlier text); a draft is cut where
    the grammar would refuse it and each verified row is masked by the grammar after the drafts
    before it: the same JSON as without speculation, greedy and seeded-sampled."""
    import json

    from graphexec.structured.spec import StructuredSpec

    schema = {
        "type": "object",
        "properties": {
            "people": {
                "type": "array",
                "minItems": 3,
                "maxItems": 3,
                "items": {
                    "type": "object",
                    "properties": {"name": {"type": "string"}, "city": {"type": "string"}},
                    "required": ["name", "city"],
                },
            }
        },
        "required": ["people"],
    }
    prompt = "Give a JSON list of three people with their name and city."
    greedy = SamplingParams(max_new_tokens=96, structured=StructuredSpec.json_schema(json.dumps(schema)))
    seeded = greedy.replace(temperature=0.7, seed=3)
    engine = Engine(overrides=["model=smollm2-135m", "capture=eager", "cache.num_slots=4096", *SPEC])
    spec = engine.generate([prompt, prompt], [greedy, seeded], chat=True)
    ref = smollm2_engine.generate([prompt], [greedy], chat=True)
    assert spec[0].token_ids == ref[0].token_ids
    for out in spec:
        assert out.finish_reason == "stop" and len(json.loads(out.text)["people"]) == 3, out.text
    assert engine.metrics().speculation["accepted_tokens"] > 0
    assert_no_leak(engine)


def test_each_verify_row_is_penalised_over_the_drafts_before_it():
    """Row i of a verified request gets exactly the penalties, bans and bias a decode step would
    give it with the first i draft tokens already in its output."""
    engine = Engine(overrides=TINY)
    params = SamplingParams(
        max_new_tokens=32, repetition_penalty=1.2, frequency_penalty=0.7, presence_penalty=0.4,
        min_tokens=3, logit_bias=((9, 2.0),), stop_token_ids=[5],
    )
    req = _start(engine, _ids(7, 1))
    req.params = params
    draft = [req.output_ids[-1], 11, 11]  # repeats: frequency counts each occurrence
    hand = HandBatches(engine.kv_cache)
    fb = engine.runner.init_forward_batch(hand.verify([req], [draft]))
    vocab = engine.model_config.vocab_size
    logits = torch.randn(len(draft) + 1, vocab, generator=torch.Generator().manual_seed(0))
    processed = fb.sampling_info.penalties.apply(logits)
    for i in range(len(draft) + 1):
        alone = Req("ref", req.prompt_ids, params, req.eos_token_ids, req.max_context, output_ids=req.output_ids + draft[:i])
        info = SamplingBatchInfo.from_params([params], [None], vocab, "cpu", histories=[alone])
        torch.testing.assert_close(processed[i], info.penalties.apply(logits[i : i + 1])[0])
    assert processed[0, 5] == -math.inf and processed[2, 5] > -math.inf  # min_tokens met at row 2
    hand.rewind(req, req.num_computed_tokens)
    hand.release(req)
    assert_no_leak(engine)
