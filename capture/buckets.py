"""Bucket lists: the fixed shapes a graph backend captures, and which one a live batch pads up to."""

from __future__ import annotations

import bisect
from typing import Sequence

from capture.errors import CaptureConfigError


def validate_buckets(buckets: Sequence[int], option: str) -> tuple[int, ...]:
    """A non-empty, strictly increasing list of positive ints, or a CaptureConfigError naming `option`."""
    values = list(buckets) if buckets is not None else []
    if not values:
        raise CaptureConfigError(f"{option} must be a non-empty list of sizes, got {values}")
    if any(not isinstance(b, int) or isinstance(b, bool) or b < 1 for b in values):
        raise CaptureConfigError(f"{option} must hold integers >= 1, got {values}")
    if any(a >= b for a, b in zip(values, values[1:])):
        raise CaptureConfigError(f"{option} must be sorted ascending without repeats, got {values}")
    return tuple(values)


def bucket_for(size: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket that holds `size` rows, or None when it exceeds the largest."""
    i = bisect.bisect_left(buckets, size)
    return buckets[i] if i < len(buckets) else None


def padded_rows(size: int, buckets: Sequence[int]) -> int:
    bucket = bucket_for(size, buckets)
    return 0 if bucket is None else bucket - size
