"""Bucket helpers are pure functions: pin them exactly."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from capture.buckets import bucket_for, padded_rows, validate_buckets
from capture.errors import CaptureConfigError


def test_bucket_for_picks_smallest_that_fits():
    buckets = (1, 2, 4, 8)
    assert [bucket_for(n, buckets) for n in range(0, 10)] == [1, 1, 2, 4, 4, 8, 8, 8, 8, None]
    assert [padded_rows(n, buckets) for n in (1, 3, 5, 8, 9)] == [0, 1, 3, 0, 0]


@given(st.lists(st.integers(1, 512), min_size=1, unique=True), st.integers(0, 600))
def test_bucket_is_minimal_and_sufficient(raw, size):
    buckets = tuple(sorted(raw))
    bucket = bucket_for(size, buckets)
    if size > buckets[-1]:
        assert bucket is None
    else:
        assert bucket >= size and all(b < size for b in buckets if b < bucket)


@pytest.mark.parametrize(
    "buckets,message",
    [
        ([], "must be a non-empty list"),
        (None, "must be a non-empty list"),
        ([4, 2], "must be sorted ascending"),
        ([1, 1, 2], "must be sorted ascending without repeats"),
        ([0, 1], "integers >= 1"),
        ([1, "8"], "integers >= 1"),
    ],
)
def test_invalid_bucket_lists_name_the_option(buckets, message):
    with pytest.raises(CaptureConfigError) as err:
        validate_buckets(buckets, "capture.decode.buckets")
    assert "capture.decode.buckets" in str(err.value) and message in str(err.value)
