import dataclasses
import math

import pytest

from graphexec.errors import InvalidRequestError
from graphexec.sampling_params import MAX_LOGPROBS, SamplingParams

BAD_VALUES = [
    # (field, bad value, expected substring of the message)
    ("max_new_tokens", -1, "max_new_tokens must be >= 0, got -1"),
    ("max_new_tokens", 1.5, "max_new_tokens must be an int >= 0, got 1.5 (float)"),
    ("max_new_tokens", True, "max_new_tokens must be an int >= 0, got True (bool)"),
    ("max_new_tokens", "8", "max_new_tokens must be an int >= 0, got '8' (str)"),
    ("max_new_tokens", None, "max_new_tokens must be an int >= 0, got None"),
    ("temperature", -0.5, "temperature must be >= 0 (0 means greedy), got -0.5"),
    ("temperature", -1, "temperature must be >= 0 (0 means greedy), got -1"),
    ("temperature", math.nan, "temperature must be >= 0 (0 means greedy), got nan"),
    ("temperature", math.inf, "temperature must be >= 0 (0 means greedy), got inf"),
    ("temperature", "hot", "temperature must be a number >= 0 (0 means greedy), got 'hot' (str)"),
    ("temperature", False, "temperature must be a number >= 0 (0 means greedy), got False (bool)"),
    ("temperature", None, "temperature must be a number >= 0 (0 means greedy), got None"),
    ("top_p", 0, "top_p must be in (0, 1], got 0"),
    ("top_p", 0.0, "top_p must be in (0, 1], got 0.0"),
    ("top_p", -0.1, "top_p must be in (0, 1], got -0.1"),
    ("top_p", 1.01, "top_p must be in (0, 1], got 1.01"),
    ("top_p", math.nan, "top_p must be in (0, 1], got nan"),
    ("top_p", True, "top_p must be a number in (0, 1], got True (bool)"),
    ("top_k", 0, "top_k must be -1 (disabled) or >= 1, got 0"),
    ("top_k", -2, "top_k must be -1 (disabled) or >= 1, got -2"),
    ("top_k", 5.0, "top_k must be an int, -1 (disabled) or >= 1, got 5.0 (float)"),
    ("top_k", True, "top_k must be an int, -1 (disabled) or >= 1, got True (bool)"),
    ("top_k", None, "top_k must be an int, -1 (disabled) or >= 1, got None"),
    ("min_p", 1.5, "min_p must be in [0, 1], got 1.5"),
    ("min_p", -0.01, "min_p must be in [0, 1], got -0.01"),
    ("min_p", math.inf, "min_p must be in [0, 1], got inf"),
    ("min_p", "0.1", "min_p must be a number in [0, 1], got '0.1' (str)"),
    ("seed", -1, "seed must be None or an int in [0, 2**64), got -1 (int)"),
    ("seed", 2**64, "seed must be None or an int in [0, 2**64), got 18446744073709551616 (int)"),
    ("seed", 1.0, "seed must be None or an int in [0, 2**64), got 1.0 (float)"),
    ("seed", True, "seed must be None or an int in [0, 2**64), got True (bool)"),
    ("stop_token_ids", 5, "stop_token_ids must be a tuple or list of ints >= 0, got 5 (int)"),
    ("stop_token_ids", "12", "stop_token_ids must be a tuple or list of ints >= 0, got '12' (str)"),
    ("stop_token_ids", {1, 2}, "stop_token_ids must be a tuple or list of ints >= 0"),
    ("stop_token_ids", None, "stop_token_ids must be a tuple or list of ints >= 0, got None"),
    ("stop_token_ids", [1, -3], "stop_token_ids[1] must be an int >= 0, got -3 (int)"),
    ("stop_token_ids", [1, 2.0], "stop_token_ids[1] must be an int >= 0, got 2.0 (float)"),
    ("stop_token_ids", (True,), "stop_token_ids[0] must be an int >= 0, got True (bool)"),
    ("stop", "###", "stop must be a tuple or list of strings (wrap a single one: ('###',)), got '###' (str)"),
    ("stop", None, "stop must be a tuple or list of strings, got None"),
    ("stop", ["a"] * 9, "stop must have at most 8 strings, got 9"),
    ("stop", ["a", ""], "stop[1] must be a non-empty string, got '' (str)"),
    ("stop", ("a", 5), "stop[1] must be a non-empty string, got 5 (int)"),
    ("ignore_eos", 1, "ignore_eos must be a bool, got 1 (int)"),
    ("ignore_eos", None, "ignore_eos must be a bool, got None"),
    ("logprobs", -1, f"logprobs must be None (off) or an int in [0, {MAX_LOGPROBS}], got -1 (int)"),
    ("logprobs", MAX_LOGPROBS + 1, f"logprobs must be None (off) or an int in [0, {MAX_LOGPROBS}], got 21"),
    ("logprobs", 2.0, "logprobs must be None (off) or an int in [0, 20], got 2.0 (float)"),
    ("logprobs", True, "logprobs must be None (off) or an int in [0, 20], got True (bool)"),
    ("presence_penalty", 2.01, "presence_penalty must be in [-2, 2], got 2.01"),
    ("presence_penalty", -3, "presence_penalty must be in [-2, 2], got -3"),
    ("presence_penalty", math.nan, "presence_penalty must be in [-2, 2], got nan"),
    ("presence_penalty", None, "presence_penalty must be a number in [-2, 2], got None"),
    ("frequency_penalty", -2.5, "frequency_penalty must be in [-2, 2], got -2.5"),
    ("frequency_penalty", "1", "frequency_penalty must be a number in [-2, 2], got '1' (str)"),
    ("repetition_penalty", 0, "repetition_penalty must be > 0 (1 means off), got 0"),
    ("repetition_penalty", -1.2, "repetition_penalty must be > 0 (1 means off), got -1.2"),
    ("repetition_penalty", math.inf, "repetition_penalty must be > 0 (1 means off), got inf"),
    ("repetition_penalty", True, "repetition_penalty must be a number > 0 (1 means off), got True (bool)"),
    ("logit_bias", {5: 100.5}, "logit_bias[5] must be a number in [-100, 100], got 100.5 (float)"),
    ("logit_bias", {5: -101}, "logit_bias[5] must be a number in [-100, 100], got -101 (int)"),
    ("logit_bias", {5: math.nan}, "logit_bias[5] must be a number in [-100, 100], got nan (float)"),
    ("logit_bias", {5: "1"}, "logit_bias[5] must be a number in [-100, 100], got '1' (str)"),
    ("logit_bias", {-1: 1.0}, "logit_bias token ids must be ints >= 0, got -1 (int)"),
    ("logit_bias", {"50256": 1.0}, "logit_bias token ids must be ints >= 0, got '50256' (str)"),
    ("logit_bias", {True: 1.0}, "logit_bias token ids must be ints >= 0, got True (bool)"),
    ("logit_bias", [(1, 2.0), (1, 3.0)], "logit_bias names token id 1 more than once"),
    ("logit_bias", [(1, 2.0, 3)], "logit_bias entries must be (token id, bias) pairs, got (1, 2.0, 3) (tuple)"),
    ("logit_bias", "x", "logit_bias must be a mapping of token id -> bias, got 'x' (str)"),
    ("min_tokens", -1, "min_tokens must be an int >= 0, got -1 (int)"),
    ("min_tokens", 2.0, "min_tokens must be an int >= 0, got 2.0 (float)"),
    ("min_tokens", 129, "min_tokens must be <= max_new_tokens (max_tokens over HTTP), got 129 > 128"),
]


@pytest.mark.parametrize(("field", "value", "message"), BAD_VALUES)
def test_bad_value_is_rejected_with_a_message_naming_field_and_range(field, value, message):
    with pytest.raises(InvalidRequestError) as excinfo:
        SamplingParams(**{field: value})
    assert message in str(excinfo.value)


def test_invalid_request_error_is_a_value_error():
    with pytest.raises(ValueError):
        SamplingParams(top_p=0)


GOOD_VALUES = [
    ("max_new_tokens", 0),
    ("max_new_tokens", 1_000_000),
    ("temperature", 0),
    ("temperature", 0.0),
    ("temperature", 1e-9),
    ("temperature", 100),
    ("top_p", 1),
    ("top_p", 1e-9),
    ("top_p", 0.5),
    ("top_k", -1),
    ("top_k", 1),
    ("top_k", 10**9),
    ("min_p", 0),
    ("min_p", 1),
    ("min_p", 0.05),
    ("seed", None),
    ("seed", 0),
    ("seed", 2**64 - 1),
    ("stop_token_ids", ()),
    ("stop_token_ids", (0, 7)),
    ("stop", ()),
    ("stop", ("\n\n", "User:", "停")),
    ("stop", ("x",) * 8),
    ("ignore_eos", True),
    ("logprobs", None),
    ("logprobs", 0),
    ("logprobs", MAX_LOGPROBS),
    ("presence_penalty", -2.0),
    ("presence_penalty", 2.0),
    ("frequency_penalty", 0.5),
    ("repetition_penalty", 1.0),
    ("repetition_penalty", 0.5),
    ("repetition_penalty", 10.0),
    ("logit_bias", ()),
    ("logit_bias", ((0, -100.0), (49151, 100.0))),
    ("min_tokens", 0),
    ("min_tokens", 128),
]


@pytest.mark.parametrize(("field", "value"), GOOD_VALUES)
def test_good_value_is_accepted_and_kept(field, value):
    params = SamplingParams(**{field: value})
    assert getattr(params, field) == value


def test_defaults():
    params = SamplingParams()
    assert [(f.name, getattr(params, f.name)) for f in dataclasses.fields(params)] == [
        ("max_new_tokens", 128),
        ("temperature", 0.0),
        ("top_p", 1.0),
        ("top_k", -1),
        ("min_p", 0.0),
        ("seed", None),
        ("stop_token_ids", ()),
        ("stop", ()),
        ("ignore_eos", False),
        ("logprobs", None),
        ("prompt_logprobs", None),
        ("presence_penalty", 0.0),
        ("frequency_penalty", 0.0),
        ("repetition_penalty", 1.0),
        ("logit_bias", ()),
        ("min_tokens", 0),
        ("structured", None),
    ]
    assert not params.processes_logits


def test_logit_bias_mapping_is_stored_as_sorted_float_pairs_and_equal_whatever_the_order():
    a = SamplingParams(logit_bias={9: 1, 2: -100})
    b = SamplingParams(logit_bias=[(2, -100.0), (9, 1.0)])
    assert a.logit_bias == ((2, -100.0), (9, 1.0)) and all(type(bias) is float for _, bias in a.logit_bias)
    assert a == b and hash(a) == hash(b)
    assert SamplingParams(logit_bias=None).logit_bias == ()


@pytest.mark.parametrize(
    "kwargs",
    [
        {"presence_penalty": 0.1},
        {"frequency_penalty": -0.1},
        {"repetition_penalty": 1.1},
        {"logit_bias": {3: 0.0}},
        {"min_tokens": 1},
    ],
)
def test_each_new_option_marks_the_params_as_processing_logits(kwargs):
    assert SamplingParams(**kwargs).processes_logits


def test_int_float_fields_are_stored_as_floats():
    params = SamplingParams(temperature=1, top_p=1, min_p=0)
    assert type(params.temperature) is float
    assert type(params.top_p) is float
    assert type(params.min_p) is float


def test_stop_token_ids_list_becomes_a_tuple_detached_from_the_caller():
    ids = [3, 1, 4]
    params = SamplingParams(stop_token_ids=ids)
    ids.append(9)
    assert params.stop_token_ids == (3, 1, 4)
    hash(params)


def test_stop_list_becomes_a_tuple():
    assert SamplingParams(stop=["END", "\n"]).stop == ("END", "\n")


def test_params_are_frozen():
    params = SamplingParams()
    with pytest.raises(dataclasses.FrozenInstanceError):
        params.temperature = 1.0


@pytest.mark.parametrize(
    ("kwargs", "greedy"),
    [
        ({}, True),
        ({"temperature": 0.7}, False),
        ({"temperature": 0.7, "top_k": 1}, True),
        ({"temperature": 0.7, "top_k": 2}, False),
        ({"top_k": 5}, True),
    ],
)
def test_is_greedy(kwargs, greedy):
    assert SamplingParams(**kwargs).is_greedy is greedy


def test_replace_changes_fields_and_revalidates():
    params = SamplingParams(temperature=0.5, seed=3)
    changed = params.replace(top_k=10, stop_token_ids=[2])
    assert (changed.temperature, changed.seed, changed.top_k, changed.stop_token_ids) == (0.5, 3, 10, (2,))
    assert params.top_k == -1
    with pytest.raises(InvalidRequestError, match="top_k must be -1"):
        params.replace(top_k=0)
