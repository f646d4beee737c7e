"""Penalties, logit_bias and min_tokens: the batched ops against per-row reference loops and
Hugging Face's logits processors, the sampler's fast path, and the engine on the real model."""

import math
from dataclasses import dataclass, field

import pytest
import torch
from transformers.generation.logits_process import (
    MinNewTokensLengthLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
)

from graphexec.batch.forward_batch import ForwardBatch
from graphexec.batch.forward_mode import ForwardMode
from graphexec.batch.request import Req
from graphexec.batch.schedule_batch import ScheduleBatch
from graphexec.errors import InvalidRequestError
from graphexec.sampling.penalties import LogitsPenalties
from graphexec.sampling.sampler import Sampler, SamplingBatchInfo, make_generator
from graphexec.sampling_params import SamplingParams

VOCAB = 64
EOS = 2


@dataclass
class History:
    prompt_ids: list[int]
    output_ids: list[int]
    eos_token_ids: tuple[int, ...] = (EOS,)


@dataclass
class Row:
    params: SamplingParams
    history: History = field(default_factory=lambda: History([], []))


def reference(logits: torch.Tensor, rows: list[Row]) -> torch.Tensor:
    """The definitions, one row and one token at a time, in vLLM's order."""
    out = logits.clone()
    for r, row in enumerate(rows):
        p, h, x = row.params, row.history, out[r]
        for token_id, bias in p.logit_bias:
            x[token_id] += bias
        if len(h.output_ids) < p.min_tokens:
            banned = set(p.stop_token_ids) | (set() if p.ignore_eos else set(h.eos_token_ids))
            for token_id in banned:
                x[token_id] = -math.inf
        if p.repetition_penalty != 1.0:
            for token_id in set(h.prompt_ids) | set(h.output_ids):
                value = float(x[token_id])
                x[token_id] = value / p.repetition_penalty if value > 0 else value * p.repetition_penalty
        for token_id in set(h.output_ids):
            x[token_id] -= p.frequency_penalty * h.output_ids.count(token_id) + p.presence_penalty
    return out


def processed(logits: torch.Tensor, rows: list[Row]) -> torch.Tensor:
    penalties = LogitsPenalties.build([r.params for r in rows], [r.history for r in rows], VOCAB, "cpu")
    assert penalties is not None
    result = penalties.apply(logits)
    assert result.data_ptr() != logits.data_ptr()
    return result


def fixed_logits(rows: int, seed: int = 0) -> torch.Tensor:
    # Scaled standard normals: about half the logits are negative, which the repetition penalty
    # treats differently.
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


# Repeated tokens (7 three times), tokens only in the prompt (11, 12), one in both (5), EOS.
HISTORY = History(prompt_ids=[11, 12, 5, 11], output_ids=[7, 5, 7, 9, 7, 40])

SINGLE_OPTIONS = {
    "presence": dict(presence_penalty=1.5),
    "negative_presence": dict(presence_penalty=-0.75),
    "frequency": dict(frequency_penalty=0.6),
    "negative_frequency": dict(frequency_penalty=-2.0),
    "repetition": dict(repetition_penalty=1.7),
    "repetition_below_one": dict(repetition_penalty=0.4),
    "logit_bias": dict(logit_bias={3: 100.0, 7: -4.5, 63: 0.25}),
    "min_tokens_unmet": dict(min_tokens=7, stop_token_ids=(8, 9)),
    "min_tokens_unmet_ignore_eos": dict(min_tokens=7, stop_token_ids=(8,), ignore_eos=True),
    "everything": dict(
        presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.3, logit_bias={5: 2.0, 2: 9.0}, min_tokens=10
    ),
}


@pytest.mark.parametrize("options", SINGLE_OPTIONS.values(), ids=SINGLE_OPTIONS.keys())
def test_each_option_matches_the_reference_loop(options):
    rows = [Row(SamplingParams(**options), HISTORY)]
    logits = fixed_logits(1)
    torch.testing.assert_close(processed(logits, rows), reference(logits, rows))
    assert not torch.equal(processed(logits, rows), logits)  # the option did something


def test_mixed_batch_matches_the_reference_and_leaves_plain_rows_untouched():
    plain = SamplingParams(temperature=0.8, top_k=5)
    rows = [
        Row(plain, History([1, 2, 3], [4, 4, 4])),
        Row(SamplingParams(presence_penalty=1.0, frequency_penalty=0.5), History([20, 21], [21, 22, 22, 23])),
        Row(plain, HISTORY),
        Row(SamplingParams(repetition_penalty=2.0), History([30, 31, 31], [])),  # prompt-only tokens
        Row(SamplingParams(logit_bias={0: -100.0, 63: 50.0})),
        Row(SamplingParams(min_tokens=3, stop_token_ids=(4,)), History([1], [6, 6])),
        Row(SamplingParams(min_tokens=2, stop_token_ids=(4,)), History([1], [6, 6])),  # min_tokens met
        Row(SamplingParams(**SINGLE_OPTIONS["everything"]), HISTORY),
    ]
    logits = fixed_logits(len(rows), seed=1)
    out = processed(logits, rows)
    torch.testing.assert_close(out, reference(logits, rows))
    for untouched in (0, 2, 6):
        assert torch.equal(out[untouched], logits[untouched])


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_full_vocabulary_batch_matches_the_reference_on(device):
    vocab = 49152
    generator = torch.Generator().manual_seed(6)
    histories = [
        History(torch.randint(vocab, (300,), generator=generator).tolist(),
                torch.randint(200, (120,), generator=generator).tolist())  # many repeats
        for _ in range(4)
    ]
    everything = SamplingParams(**SINGLE_OPTIONS["everything"])
    params = [everything, SamplingParams(), SamplingParams(repetition_penalty=0.8, logit_bias={vocab - 1: 30.0}), everything]
    logits = torch.randn(4, vocab, generator=generator) * 4
    penalties = LogitsPenalties.build(params, histories, vocab, device)
    out = penalties.apply(logits.to(device)).cpu()
    rows = [Row(p, h) for p, h in zip(params, histories)]
    torch.testing.assert_close(out, reference(logits, rows))
    assert torch.equal(out[1], logits[1])


def test_repetition_penalty_matches_hugging_face():
    penalty = 1.45
    rows = [Row(SamplingParams(repetition_penalty=penalty), HISTORY)]
    logits = fixed_logits(1, seed=2)
    input_ids = torch.tensor([HISTORY.prompt_ids + HISTORY.output_ids])
    expected = RepetitionPenaltyLogitsProcessor(penalty)(input_ids, logits.clone())
    torch.testing.assert_close(processed(logits, rows), expected)


@pytest.mark.parametrize("generated", [0, 2, 3])
def test_min_tokens_matches_hugging_face_min_new_tokens(generated):
    outputs = [9, 10, 11][:generated]
    rows = [Row(SamplingParams(min_tokens=3), History([5, 6], outputs))]
    logits = fixed_logits(1, seed=3)
    hf = MinNewTokensLengthLogitsProcessor(prompt_length_to_skip=2, min_new_tokens=3, eos_token_id=EOS)
    expected = hf(torch.tensor([[5, 6, *outputs]]), logits.clone())
    penalties = LogitsPenalties.build([r.params for r in rows], [r.history for r in rows], VOCAB, "cpu")
    if generated >= 3:
        assert penalties is None  # nothing left to do: the fast path
        assert torch.equal(expected, logits)
    else:
        torch.testing.assert_close(penalties.apply(logits), expected)


def test_no_options_is_the_fast_path_and_builds_nothing():
    params = [SamplingParams(), SamplingParams(temperature=0.7, top_p=0.9, seed=3)]
    info = SamplingBatchInfo.from_params(params, [None, make_generator(3, "cpu")], VOCAB, "cpu", histories=None)
    assert info.penalties is None
    logits = fixed_logits(2)
    assert torch.equal(Sampler()(logits, info).next_token_ids[0], logits[0].argmax())


def test_a_row_that_needs_a_history_without_one_is_refused():
    with pytest.raises(ValueError, match="sampling row 1 uses penalties or min_tokens but has no token history"):
        LogitsPenalties.build([SamplingParams(), SamplingParams(presence_penalty=1.0)], [None, None], VOCAB, "cpu")
    # logit_bias alone needs no history.
    assert LogitsPenalties.build([SamplingParams(logit_bias={1: 1.0})], None, VOCAB, "cpu") is not None


def test_logit_bias_past_the_logits_is_refused():
    with pytest.raises(ValueError, match=r"logit_bias token id 64 is outside the vocabulary \[0, 64\)"):
        LogitsPenalties.build([SamplingParams(logit_bias={64: 1.0})], None, VOCAB, "cpu")


def test_sampler_picks_from_processed_logits_and_reports_raw_logprobs():
    rows = [
        Row(SamplingParams(logit_bias={13: 100.0}, logprobs=2)),
        Row(SamplingParams(repetition_penalty=3.0, presence_penalty=2.0, logprobs=2), History([], [])),
        Row(SamplingParams(temperature=1.0, seed=5, logit_bias={20: 100.0}, logprobs=0)),
    ]
    logits = fixed_logits(3, seed=4)
    top = int(logits[1].argmax())
    rows[1].history.output_ids.extend([top, top])
    params = [r.params for r in rows]
    info = SamplingBatchInfo.from_params(
        params, [make_generator(p.seed, "cpu") for p in params], VOCAB, "cpu", histories=[r.history for r in rows]
    )
    out = Sampler()(logits.clone(), info)
    assert out.next_token_ids.tolist() == [13, int(reference(logits, rows)[1].argmax()), 20]
    assert out.next_token_ids[1] != top  # the penalty moved the greedy choice
    raw = logits.log_softmax(dim=-1)
    torch.testing.assert_close(out.chosen_logprobs, raw.gather(1, out.next_token_ids.unsqueeze(1)).squeeze(1))
    torch.testing.assert_close(out.top_logprobs, raw.topk(2, dim=-1).values)


def test_seeded_request_with_penalties_is_reproducible_in_any_batch():
    """The tracked row's history grows with its own tokens; neighbours differ in every run."""
    tracked = SamplingParams(
        temperature=1.0, seed=1234, presence_penalty=0.8, frequency_penalty=0.4, repetition_penalty=1.2,
        logit_bias={0: -100.0, 1: 3.0}, min_tokens=4, stop_token_ids=(5,),
    )
    neighbours = [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_p=0.8, seed=9, frequency_penalty=1.0),
        SamplingParams(repetition_penalty=1.5, logit_bias={7: 5.0}),
    ]

    def run(batch: list[SamplingParams], row: int, steps: int = 24) -> list[int]:
        source = torch.Generator().manual_seed(42)
        histories = [History([3, 4, 3], []) for _ in batch]
        generators = [make_generator(p.seed, "cpu") for p in batch]
        for _ in range(steps):
            logits = torch.randn(len(batch), VOCAB) * 2
            logits[row] = torch.randn(VOCAB, generator=source) * 2
            info = SamplingBatchInfo.from_params(batch, generators, VOCAB, "cpu", histories=histories)
            for history, token in zip(histories, Sampler()(logits, info).next_token_ids.tolist()):
                history.output_ids.append(token)
        return histories[row].output_ids

    alone = run([tracked], 0)
    assert len(set(alone)) > 5 and 0 not in alone and 5 not in alone[:4]
    torch.manual_seed(1)
    assert run([neighbours[0], tracked, *neighbours[1:]], 1) == alone
    torch.manual_seed(2)
    assert run([*neighbours, *neighbours, tracked], 6) == alone


def _req(rid: str, params: SamplingParams, prompt: list[int], output: list[int]) -> Req:
    return Req(rid, prompt, params, eos_token_ids=(EOS,), max_context=64, output_ids=list(output))


def test_prompt_chunk_rows_are_untouched_and_count_nothing():
    chunk = _req("chunk", SamplingParams(presence_penalty=2.0, logit_bias={1: 50.0}, min_tokens=5), [9] * 8, [])
    sampling = _req("sampling", SamplingParams(frequency_penalty=1.0), [4, 4], [6, 6, 7])
    batch = ScheduleBatch(
        forward_mode=ForwardMode.EXTEND, reqs=(chunk, sampling), input_ids=[9, 9, 9, 9, 6],
        req_pool_indices=[1, 2], prefix_lens=[0, 4], extend_lens=[4, 1], seq_lens=[4, 5],
        out_cache_loc=torch.tensor([1, 2, 3, 4, 5]), samples=(False, True),
    )
    fb = ForwardBatch.init_new(batch, "cpu", VOCAB)
    logits = fixed_logits(2, seed=5)
    out = fb.sampling_info.penalties.apply(logits)
    assert torch.equal(out[0], logits[0])
    torch.testing.assert_close(out[1], reference(logits[1:], [Row(sampling.params, sampling)])[0])
    # With only the chunk asking for penalties, the batch takes the fast path.
    alone = ScheduleBatch(**{**batch.__dict__, "reqs": (chunk, _req("plain", SamplingParams(), [4, 4], [6]))})
    assert ForwardBatch.init_new(alone, "cpu", VOCAB).sampling_info.penalties is None


# --- the engine -----------------------------------------------------------------------------


def test_penalised_requests_keep_their_tokens_batched_chunked_and_retracted():
    """Each request's penalties read its own history only: seeded and greedy requests with
    penalties give the same tokens alone, batched with others, and in a small pool where prompts
    are chunked and running requests are retracted and resumed."""
    from graphexec import Engine
    from tests.conftest import TINY_OVERRIDES
    from tests.invariants import assert_no_leak

    def ids(n: int, seed: int) -> list[int]:
        return torch.randint(3, 320, (n,), generator=torch.Generator().manual_seed(seed)).tolist()

    prompts = [ids(12 + 3 * i, 500 + i) for i in range(8)]
    penalties = dict(presence_penalty=1.0, frequency_penalty=0.5, repetition_penalty=1.3, logit_bias={5: 3.0})
    kinds = [
        SamplingParams(max_new_tokens=40, ignore_eos=True, temperature=0.9, seed=11, **penalties),
        SamplingParams(max_new_tokens=40, ignore_eos=True, repetition_penalty=1.5),
        SamplingParams(max_new_tokens=40, ignore_eos=True, temperature=0.8, top_p=0.9, seed=12),
        SamplingParams(max_new_tokens=40, min_tokens=40, frequency_penalty=1.0, temperature=1.0, seed=13),
    ]
    params = [kinds[i % 4] for i in range(8)]
    engine = Engine(overrides=TINY_OVERRIDES)
    alone = [engine.generate([p], sp)[0].token_ids for p, sp in zip(prompts, params)]
    plain = kinds[0].replace(presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0, logit_bias={})
    assert engine.generate([prompts[0]], plain)[0].token_ids != alone[0]  # the options do something
    assert all(len(tokens) == 40 for tokens in alone)  # min_tokens held EOS off
    assert [o.token_ids for o in Engine(overrides=TINY_OVERRIDES).generate(prompts, params)] == alone
    # 8 requests of up to 52 + 40 tokens in 120 slots: chunked prompts, retractions, resumption.
    small = Engine(overrides=TINY_OVERRIDES + ["cache.num_slots=120", "scheduler.max_running_requests=8",
                                               "scheduler.max_prefill_tokens=16"])
    assert [o.token_ids for o in small.generate(prompts, params)] == alone
    assert small.metrics().retractions_total > 0
    assert_no_leak(small)


# --- the real model -------------------------------------------------------------------------

# SmolLM2-135M-Instruct's greedy answer is one token ("No"), then EOS.
SHORT_ANSWER = "Reply with one word: yes or no. Is the sky blue?"


def test_min_tokens_outlasts_an_early_eos_and_leaves_ignore_eos_alone(smollm2_engine):
    engine = smollm2_engine
    eos = engine.model_config.eos_token_ids
    short, forced, free, free_min = engine.generate(
        [SHORT_ANSWER] * 4,
        [
            SamplingParams(max_new_tokens=12),
            SamplingParams(max_new_tokens=12, min_tokens=6),
            SamplingParams(max_new_tokens=12, ignore_eos=True),
            SamplingParams(max_new_tokens=12, ignore_eos=True, min_tokens=6),
        ],
        chat=True,
    )
    assert short.finish_reason == "stop" and len(short.token_ids) < 6
    assert len(forced.token_ids) >= 6 and forced.token_ids[: len(short.token_ids)] == short.token_ids
    # ignore_eos: EOS is an ordinary token and min_tokens bans nothing, so it still comes out.
    assert free_min.token_ids == free.token_ids and set(free.token_ids) & set(eos)


def test_min_tokens_keeps_stop_strings_from_ending_early(smollm2_engine):
    prompt = "Count from 1 to 10, separated by commas."
    (full,) = smollm2_engine.generate([prompt], SamplingParams(max_new_tokens=24), chat=True)
    (cut,) = smollm2_engine.generate([prompt], SamplingParams(max_new_tokens=24, stop=(",",), min_tokens=7), chat=True)
    assert full.text.startswith("1, 2, 3, 4")
    # The first comma that ends after the 7th token's text ends it; earlier ones do not count.
    boundary = len(smollm2_engine.tokenizer.decode(full.token_ids[:7]))
    assert cut.finish_reason == "stop" and len(cut.token_ids) >= 7
    assert cut.text == full.text[: full.text.index(",", boundary)]


def test_logit_bias_forces_and_bans_tokens_greedily(smollm2_engine):
    engine = smollm2_engine
    (base,) = engine.generate([SHORT_ANSWER], SamplingParams(max_new_tokens=4, logprobs=2), chat=True)
    first, (best, runner_up) = base.token_ids[0], base.logprobs[0]["top"]
    forced_token = 28  # ","
    (forced,) = engine.generate([SHORT_ANSWER], SamplingParams(max_new_tokens=5, logit_bias={forced_token: 100}), chat=True)
    assert forced_token not in base.token_ids and forced.token_ids == [forced_token] * 5
    (banned,) = engine.generate(
        [SHORT_ANSWER], SamplingParams(max_new_tokens=4, logit_bias={first: -100}, logprobs=2), chat=True
    )
    # Banning the greedy choice leaves the runner-up, whose reported logprob is the raw model's.
    assert best[0] == first and banned.token_ids[0] == runner_up[0]
    assert banned.logprobs[0]["logprob"] == pytest.approx(runner_up[1], abs=1e-4)


def test_engine_refuses_logit_bias_outside_the_vocabulary(smollm2_engine):
    vocab = smollm2_engine.model_config.vocab_size
    with pytest.raises(InvalidRequestError, match=f"logit_bias has token id {vocab} outside the vocabulary") as error:
        smollm2_engine.generate(["hi"], SamplingParams(max_new_tokens=2, logit_bias={vocab: 1.0}))
    assert error.value.param == "logit_bias"
    (ok,) = smollm2_engine.generate(["hi"], SamplingParams(max_new_tokens=2, logit_bias={vocab - 1: 1.0}))
    assert ok.completion_tokens >= 1


def test_penalties_benchmark_runs_and_reports_every_side(capsys):
    from bench import penalties as bench

    bench.main(["--batch-sizes", "2", "--prompt", "8", "--output", "4", "--rounds", "1", "--steps", "1"])
    printed = capsys.readouterr().out
    assert "B=2" in printed and all(name in printed for name in bench.SIDES)
