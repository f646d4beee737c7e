import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from graphexec.sampling.sampler import (
    GREEDY_TEMPERATURE,
    Sampler,
    SamplerOutput,
    SamplingBatchInfo,
    make_generator,
)
from graphexec.sampling_params import SamplingParams

# Probabilities chosen so that every filter threshold below is far from a boundary.
FOUR_PROBS = [0.5, 0.3, 0.15, 0.05]


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None] | None = None,
) -> SamplerOutput:
    if generators is None:
        generators = [make_generator(p.seed, "cpu") for p in params]
    info = SamplingBatchInfo.from_params(params, generators, logits.shape[-1], "cpu")
    return Sampler()(logits, info)


def four_token_logits(rows: int) -> torch.Tensor:
    return torch.tensor(FOUR_PROBS).log().expand(rows, -1).contiguous()


def counts(ids: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.bincount(ids, minlength=vocab)


# --- make_generator / SamplingBatchInfo -------------------------------------------------------


def test_make_generator():
    assert make_generator(None, "cpu") is None
    a, b = make_generator(7, "cpu"), make_generator(7, "cpu")
    assert torch.equal(torch.rand(5, generator=a), torch.rand(5, generator=b))


def test_batch_info_normalises_params():
    params = [
        SamplingParams(),  # greedy, filters ignored
        SamplingParams(temperature=0.5, top_k=-1, top_p=0.9, logprobs=3),
        SamplingParams(temperature=2, top_k=500, min_p=0.1, logprobs=0),
        SamplingParams(temperature=1, top_k=4, seed=1),
        SamplingParams(temperature=GREEDY_TEMPERATURE / 2, top_p=0.5, seed=2),  # near-zero: greedy
    ]
    generators = [make_generator(p.seed, "cpu") for p in params]
    info = SamplingBatchInfo.from_params(params, generators, 100, "cpu")
    assert info.temperatures.tolist() == [1.0, 0.5, 2.0, 1.0, 1.0]
    assert info.temperatures.dtype == torch.float32
    assert info.top_ks.tolist() == [100, 100, 100, 4, 100]
    assert info.top_ks.dtype == torch.int64
    assert info.top_ps.tolist() == pytest.approx([1.0, 0.9, 1.0, 1.0, 1.0])
    assert info.min_ps.tolist() == pytest.approx([0.0, 0.0, 0.1, 0.0, 0.0])
    assert info.greedy_rows.tolist() == [True, False, False, False, True]
    assert info.generators == (None, None, None, generators[3], None)
    assert not info.all_greedy
    assert (info.need_top_p, info.need_top_k, info.need_min_p) == (True, True, True)
    assert info.max_top_k == 4
    assert info.max_logprobs == 3


def test_batch_info_flags_off_when_nobody_filters():
    params = [SamplingParams(top_p=0.5, top_k=3, min_p=0.5), SamplingParams(temperature=1.0)]
    info = SamplingBatchInfo.from_params(params, [None, None], 10, "cpu")
    assert (info.all_greedy, info.need_top_p, info.need_top_k, info.need_min_p) == (False, False, False, False)
    assert info.max_top_k == 0
    assert info.max_logprobs is None


def test_batch_info_rejects_mismatched_generators():
    with pytest.raises(ValueError, match="2 sampling params but 1 generators"):
        SamplingBatchInfo.from_params([SamplingParams(), SamplingParams()], [None], 10, "cpu")


# --- greedy ---------------------------------------------------------------------------------


def test_all_greedy_is_argmax_and_leaves_logits_untouched():
    logits = torch.randn(16, 300, generator=torch.Generator().manual_seed(0))
    before = logits.clone()
    out = sample(logits, [SamplingParams()] * 16)
    assert torch.equal(out.next_token_ids, logits.argmax(-1))
    assert out.next_token_ids.dtype == torch.int64
    assert out.chosen_logprobs is None and out.top_logprobs is None and out.top_ids is None
    assert torch.equal(logits, before)


def test_bfloat16_logits_are_accepted():
    logits = torch.randn(4, 50).bfloat16()
    out = sample(logits, [SamplingParams(), SamplingParams(temperature=1.0, top_p=0.9)] * 2)
    assert out.next_token_ids.shape == (4,)


def test_top_k_one_equals_greedy_on_many_rows():
    logits = torch.randn(256, 1000, generator=torch.Generator().manual_seed(1)) * 4
    params = [SamplingParams(temperature=t, top_k=1, seed=i) for i, t in enumerate([0.7, 1.0, 3.0, 50.0] * 64)]
    assert torch.equal(sample(logits, params).next_token_ids, logits.argmax(-1))


def test_greedy_rows_in_a_mixed_batch_take_argmax_and_consume_no_randomness():
    logits = torch.randn(6, 200, generator=torch.Generator().manual_seed(2))
    params = [SamplingParams(seed=5), SamplingParams(temperature=1.0, top_p=0.8)] * 3
    generators = [make_generator(p.seed, "cpu") for p in params]
    state = generators[0].get_state()
    out = sample(logits, params, generators)
    assert torch.equal(out.next_token_ids[0::2], logits[0::2].argmax(-1))
    assert torch.equal(generators[0].get_state(), state)


def test_temperature_below_threshold_is_exactly_greedy():
    logits = torch.randn(64, 500, generator=torch.Generator().manual_seed(3))
    params = [SamplingParams(temperature=GREEDY_TEMPERATURE / 10)] * 64
    assert torch.equal(sample(logits, params).next_token_ids, logits.argmax(-1))


def test_small_temperature_approaches_greedy():
    logits = torch.randn(400, 50, generator=torch.Generator().manual_seed(4))
    # Give every argmax a clear margin so that "approaches" ends in exact agreement.
    logits.scatter_add_(1, logits.argmax(-1, keepdim=True), torch.full((400, 1), 0.5))
    torch.manual_seed(0)
    agreement = []
    for temperature in [4.0, 1.0, 0.3, 0.01]:
        ids = sample(logits, [SamplingParams(temperature=temperature)] * 400).next_token_ids
        agreement.append((ids == logits.argmax(-1)).float().mean().item())
    assert agreement == sorted(agreement)
    assert agreement[0] < 0.5
    assert agreement[-1] == 1.0


# --- seeds ----------------------------------------------------------------------------------

VOCAB = 1000
REQUEST_PARAMS = [
    SamplingParams(temperature=1.0, seed=1234),
    SamplingParams(temperature=0.8, top_p=0.9, seed=1234),
    SamplingParams(temperature=1.3, top_k=50, seed=1234),
    SamplingParams(temperature=1.0, min_p=0.05, seed=1234, logprobs=2),
]
BATCH_MATES = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.5, top_p=0.5, seed=99),
    SamplingParams(),
    SamplingParams(temperature=2.0, top_k=3, min_p=0.2),
    SamplingParams(temperature=0.9, top_k=20, top_p=0.7, seed=7, logprobs=5),
]


def run_steps(params: list[SamplingParams], row_of_interest: int, steps: int = 20) -> list[int]:
    """Sample `steps` tokens, the tracked row seeing the same logits however the batch looks."""
    logits_source = torch.Generator().manual_seed(42)
    generators = [make_generator(p.seed, "cpu") for p in params]
    tokens = []
    for _ in range(steps):
        logits = torch.randn(len(params), VOCAB) * 2
        logits[row_of_interest] = torch.randn(VOCAB, generator=logits_source) * 2
        tokens.append(int(sample(logits, params, generators).next_token_ids[row_of_interest]))
    return tokens


@pytest.mark.parametrize("request_params", REQUEST_PARAMS, ids=["plain", "top_p", "top_k", "min_p"])
def test_seeded_request_is_reproducible_alone_and_in_any_batch(request_params):
    alone = run_steps([request_params], 0)
    assert run_steps([request_params], 0) == alone
    assert len(set(alone)) > 5  # actually sampling, not stuck on one token
    torch.manual_seed(123)  # unseeded batch-mates must not matter either
    assert run_steps([*BATCH_MATES[:2], request_params, *BATCH_MATES[2:]], 2) == alone
    torch.manual_seed(456)
    assert run_steps([request_params, *BATCH_MATES, *BATCH_MATES], 0) == alone
    # The same seed twice in one batch: separate generators, identical streams.
    assert run_steps([request_params, BATCH_MATES[0], request_params], 2) == alone


def test_different_seeds_give_different_tokens_on_flat_logits():
    seeds = range(16)
    params = [SamplingParams(temperature=1.0, seed=s) for s in seeds]
    generators = [make_generator(s, "cpu") for s in seeds]
    flat = torch.zeros(len(params), VOCAB)
    steps = torch.stack([sample(flat, params, generators).next_token_ids for _ in range(20)], dim=1)
    sequences = {tuple(row) for row in steps.tolist()}
    assert len(sequences) == len(params)
    # Two independent uniform draws over 1000 tokens agree with probability 1/1000.
    same = (steps.unsqueeze(0) == steps.unsqueeze(1)).float().sum() - steps.numel()
    assert same / (len(params) * (len(params) - 1) * 20) < 0.01


def test_unseeded_rows_follow_the_global_generator():
    logits = torch.zeros(32, VOCAB)
    params = [SamplingParams(temperature=1.0)] * 32
    torch.manual_seed(5)
    first = sample(logits, params).next_token_ids
    torch.manual_seed(5)
    assert torch.equal(sample(logits, params).next_token_ids, first)
    assert len(set(first.tolist())) > 20


# --- filters --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "allowed"),
    [
        ({}, {0, 1, 2, 3}),
        ({"top_p": 0.9}, {0, 1, 2}),
        ({"top_p": 0.7}, {0, 1}),
        ({"top_p": 0.45}, {0}),
        ({"min_p": 0.2}, {0, 1, 2}),  # threshold 0.1
        ({"min_p": 0.35}, {0, 1}),  # threshold 0.175
        ({"min_p": 0.9}, {0}),
        ({"top_k": 3}, {0, 1, 2}),
        ({"top_k": 2}, {0, 1}),
        ({"top_k": 3, "top_p": 0.7}, {0, 1}),
        ({"top_k": 3, "min_p": 0.5}, {0, 1}),
        ({"top_p": 0.9, "min_p": 0.5}, {0, 1}),
        # top-p applies to what top-k leaves: 0.5 / 0.8 = 0.625 < 0.7, so token 1 is needed.
        ({"top_k": 2, "top_p": 0.7}, {0, 1}),
        ({"top_k": 2, "top_p": 0.6}, {0}),
    ],
)
@pytest.mark.parametrize("seeded", [False, True])
def test_filters_on_hand_made_probabilities(kwargs, allowed, seeded):
    rows = 2000
    params = [SamplingParams(temperature=1.0, seed=i if seeded else None, **kwargs) for i in range(rows)]
    torch.manual_seed(0)
    ids = sample(four_token_logits(rows), params).next_token_ids
    assert set(ids.tolist()) == allowed


@pytest.mark.parametrize("with_top_p", [False, True], ids=["topk-path", "sort-path"])
def test_filters_do_not_leak_into_batch_mates(with_top_p):
    groups = [
        ({}, {0, 1, 2, 3}),
        ({"top_k": 2}, {0, 1}),
        ({"min_p": 0.9}, {0}),
        ({"top_k": 3}, {0, 1, 2}),
    ]
    if with_top_p:
        groups.append(({"top_p": 0.7}, {0, 1}))
    rows = 1000 * len(groups)
    params = [SamplingParams(temperature=1.0, **groups[i % len(groups)][0]) for i in range(rows)]
    torch.manual_seed(4)
    ids = sample(four_token_logits(rows), params).next_token_ids
    for offset, (_, allowed) in enumerate(groups):
        assert set(ids[offset :: len(groups)].tolist()) == allowed


def test_filters_apply_after_temperature():
    # At temperature 3 the probabilities flatten to about [0.33, 0.28, 0.22, 0.16]:
    # min_p 0.6 now keeps three tokens where at temperature 1 it keeps one.
    rows = 2000
    torch.manual_seed(1)
    ids = sample(four_token_logits(rows), [SamplingParams(temperature=3.0, min_p=0.6)] * rows).next_token_ids
    assert set(ids.tolist()) == {0, 1, 2}


def test_ties_at_the_top_k_boundary_are_all_kept():
    rows = 1000
    logits = torch.tensor([3.0, 1.0, 1.0, 1.0, 0.0]).expand(rows, -1)
    torch.manual_seed(2)
    ids = sample(logits, [SamplingParams(temperature=1.0, top_k=2)] * rows).next_token_ids
    assert set(ids.tolist()) == {0, 1, 2, 3}


def test_negative_infinity_logits_are_never_sampled():
    rows = 1000
    logits = torch.tensor([0.0, -math.inf, 0.0, -math.inf]).expand(rows, -1)
    torch.manual_seed(3)
    for kwargs in [{}, {"top_p": 0.99}, {"top_k": 3}, {"min_p": 0.01}]:
        ids = sample(logits, [SamplingParams(temperature=1.0, **kwargs)] * rows).next_token_ids
        assert set(ids.tolist()) == {0, 2}


# --- distribution ---------------------------------------------------------------------------


def assert_matches(ids: torch.Tensor, probs: torch.Tensor) -> None:
    """Per-bin check: each frequency within 5 standard errors of its probability."""
    draws = ids.numel()
    observed = counts(ids, probs.numel()).double() / draws
    expected = probs.double()
    tolerance = 5 * (expected * (1 - expected) / draws).sqrt() + 1e-12
    assert ((observed - expected).abs() <= tolerance).all(), (observed, expected)
    # Pearson chi-square over the bins with mass; 99.99th percentile for df <= 9 is < 34.
    mask = expected > 0
    chi2 = (((observed - expected)[mask] ** 2) / expected[mask]).sum() * draws
    assert chi2 < 34, chi2


@pytest.mark.parametrize("temperature", [0.7, 1.0, 1.5])
def test_sampled_distribution_matches_softmax(temperature):
    draws = 20000
    logits = torch.randn(8, generator=torch.Generator().manual_seed(5)) * 1.5
    torch.manual_seed(6)
    ids = sample(logits.expand(draws, -1), [SamplingParams(temperature=temperature)] * draws).next_token_ids
    assert_matches(ids, (logits / temperature).softmax(-1))


def test_seeded_rows_sample_the_right_distribution():
    draws = 5000
    logits = torch.randn(6, generator=torch.Generator().manual_seed(7))
    params = [SamplingParams(temperature=1.0, seed=s) for s in range(draws)]
    ids = sample(logits.expand(draws, -1), params).next_token_ids
    assert_matches(ids, logits.softmax(-1))


def test_filtered_distribution_is_renormalised():
    draws = 20000
    torch.manual_seed(8)
    ids = sample(four_token_logits(draws), [SamplingParams(temperature=1.0, top_p=0.7)] * draws).next_token_ids
    assert_matches(ids, torch.tensor([0.625, 0.375, 0.0, 0.0]))


# --- logprobs -------------------------------------------------------------------------------


def test_logprobs_are_raw_log_softmax_at_the_chosen_and_top_ids():
    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(9)) * 3
    params = [
        SamplingParams(temperature=0.5, logprobs=4),
        SamplingParams(logprobs=0),
        SamplingParams(temperature=2.0, top_p=0.9),
        SamplingParams(temperature=1.0, top_k=5, logprobs=2),
        SamplingParams(),
        SamplingParams(temperature=1.0, seed=3, logprobs=1),
    ]
    out = sample(logits, params)
    expected = logits.log_softmax(-1)  # before temperature: independent of each row's params
    assert out.chosen_logprobs.dtype == torch.float32
    torch.testing.assert_close(out.chosen_logprobs, expected.gather(1, out.next_token_ids[:, None])[:, 0])
    assert out.top_ids.shape == out.top_logprobs.shape == (6, 4)
    torch.testing.assert_close(out.top_logprobs, expected.gather(1, out.top_ids))
    assert (out.top_logprobs[:, :-1] >= out.top_logprobs[:, 1:]).all()
    assert torch.equal(out.top_ids[:, 0], logits.argmax(-1))


def test_logprobs_zero_gives_empty_alternatives():
    out = sample(torch.randn(3, 20), [SamplingParams(logprobs=0)] * 3)
    assert out.chosen_logprobs.shape == (3,)
    assert out.top_ids.shape == out.top_logprobs.shape == (3, 0)


def test_logprobs_wider_than_vocab_are_capped():
    out = sample(torch.randn(2, 5), [SamplingParams(logprobs=20)] * 2)
    assert out.top_ids.shape == (2, 5)


def test_full_size_mixed_batch():
    vocab, rows = 49152, 64
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(10)) * 3
    kinds = [
        SamplingParams(),
        SamplingParams(temperature=0.8, top_p=0.95, seed=1, logprobs=5),
        SamplingParams(temperature=1.0, top_k=40, min_p=0.05),
        SamplingParams(temperature=0.7, top_k=50, top_p=0.9),
    ]
    params = [kinds[i % len(kinds)] for i in range(rows)]
    out = sample(logits, params)
    assert out.next_token_ids.shape == (rows,)
    assert ((out.next_token_ids >= 0) & (out.next_token_ids < vocab)).all()
    assert torch.equal(out.next_token_ids[0::4], logits[0::4].argmax(-1))
    top_40 = logits[2::4].topk(40, dim=-1).indices
    assert (top_40 == out.next_token_ids[2::4, None]).any(-1).all()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_full_vocab_seeded_sampling_is_batch_invariant_on(device):
    vocab = 49152
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(0)).to(device) * 3
    request = SamplingParams(temperature=0.9, top_p=0.95, top_k=100, seed=77)
    mates = [SamplingParams(temperature=1.0, min_p=0.1), SamplingParams()]

    def tokens(params: list[SamplingParams], row: int) -> list[int]:
        generators = [make_generator(p.seed, device) for p in params]
        info = SamplingBatchInfo.from_params(params, generators, vocab, device)
        batch = logits.expand(len(params), -1).contiguous()
        return [int(Sampler()(batch, info).next_token_ids[row]) for _ in range(20)]

    alone = tokens([request], 0)
    assert len(set(alone)) > 1
    assert tokens([*mates, request], 2) == alone


# --- property: the sampled id always survives every filter ----------------------------------


def allowed_ids(logits: torch.Tensor, params: SamplingParams) -> set[int]:
    """Reference filter in float64, erring towards keeping tokens within rounding distance."""
    if params.is_greedy or params.temperature < GREEDY_TEMPERATURE:
        return {int(logits.argmax())}
    # Scale in float32 exactly as the sampler does, so ties and order match.
    scaled = (logits / torch.tensor(params.temperature, dtype=torch.float32)).double()
    keep = torch.ones_like(scaled, dtype=torch.bool)
    if params.top_k != -1 and params.top_k < scaled.numel():
        keep &= scaled >= scaled.sort(descending=True).values[params.top_k - 1]
    probs = scaled.masked_fill(~keep, -math.inf).softmax(-1)
    # A token may stay if the mass strictly more likely than it falls short of top_p.
    mass_above = torch.stack([probs[scaled > value].sum() for value in scaled])
    keep &= mass_above < params.top_p + 1e-5
    if params.min_p > 0:
        keep &= scaled - scaled.max() >= math.log(params.min_p) - 1e-5
    return set(keep.nonzero().flatten().tolist())


row_strategy = st.integers(min_value=1, max_value=24).flatmap(
    lambda vocab: st.tuples(
        st.lists(
            st.floats(min_value=-30, max_value=30, width=32) | st.sampled_from([0.0, 1.0, -1.0]),
            min_size=vocab,
            max_size=vocab,
        ),
        st.builds(
            SamplingParams,
            temperature=st.sampled_from([0.0, 1e-6]) | st.floats(min_value=0.05, max_value=5.0),
            top_k=st.sampled_from([-1]) | st.integers(min_value=1, max_value=vocab + 2),
            top_p=st.sampled_from([1.0]) | st.floats(min_value=1e-3, max_value=1.0),
            min_p=st.sampled_from([0.0]) | st.floats(min_value=0.0, max_value=1.0),
            seed=st.none() | st.integers(min_value=0, max_value=2**32),
        ),
    )
)


@settings(max_examples=150, deadline=None)
@given(rows=st.lists(row_strategy, min_size=1, max_size=6), torch_seed=st.integers(0, 2**16))
def test_sampled_id_is_always_in_the_allowed_set(rows, torch_seed):
    vocab = max(len(logits) for logits, _ in rows)
    # Pad shorter rows with -inf: unreachable tokens, as a model's padded vocabulary would be.
    batch = torch.full((len(rows), vocab), -math.inf)
    for i, (logits, _) in enumerate(rows):
        batch[i, : len(logits)] = torch.tensor(logits)
    params = [p for _, p in rows]
    allowed = [allowed_ids(batch[i], p) for i, p in enumerate(params)]
    torch.manual_seed(torch_seed)
    for _ in range(4):
        ids = sample(batch, params).next_token_ids.tolist()
        for row, token in enumerate(ids):
            assert token in allowed[row], (row, token, allowed[row], params[row])


def test_top_k_bounded_top_p_matches_the_full_sort_path():
    """When every sampled row has top-k on, top-p runs on the top-k candidates only; a seeded
    row must draw the same token as when a batch-mate without top-k forces the full sort."""
    vocab = 49152
    logits = torch.randn(2, vocab, generator=torch.Generator().manual_seed(1)) * 3
    bounded = SamplingParams(temperature=0.8, top_k=50, top_p=0.9, seed=123)
    unbounded = SamplingParams(temperature=0.8, top_p=0.9)
    for step in range(20):
        fast_info = SamplingBatchInfo.from_params([bounded, bounded], [make_generator(step, "cpu")] * 2, vocab, "cpu")
        slow_info = SamplingBatchInfo.from_params([bounded, unbounded], [make_generator(step, "cpu"), None], vocab, "cpu")
        assert fast_info.top_k_bounds_all and not slow_info.top_k_bounds_all
        fast = Sampler()(logits, fast_info).next_token_ids[0]
        slow = Sampler()(logits, slow_info).next_token_ids[0]
        assert int(fast) == int(slow)
