"""Checks of single option values, shared by every option that needs one (capture/options.py
names each field's).  A check takes the value as the config spells it and the option's full path,
and returns the typed value or raises a CaptureConfigError naming that path.  Checks that span
options, or need the engine's device, are capture/option_parser.py's.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from capture.buckets import validate_buckets
from capture.errors import CaptureConfigError

Check = Callable[[Any, str], Any]


def flag(value: Any, option: str) -> bool:
    if not isinstance(value, bool):
        raise CaptureConfigError(f"{option} must be true or false, got {value!r}")
    return value


def choice(choices: Sequence[str]) -> Check:
    def check(value: Any, option: str) -> str:
        if value not in choices:
            raise CaptureConfigError(f"{option}={value!r} is unknown; choose one of {list(choices)}")
        return value

    return check


def buckets(value: Any, option: str) -> tuple[int, ...]:
    return validate_buckets(value, option)


def bucket_subset(value: Any, option: str) -> tuple[int, ...]:
    """Sizes meant to be among a backend's buckets (those that are not are ignored), maybe none."""
    return validate_buckets(value, option) if value else ()


def fraction(value: Any, option: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        raise CaptureConfigError(f"{option} must be a fraction in [0, 1], got {value!r}")
    return float(value)


def speedup(value: Any, option: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise CaptureConfigError(f"{option} must be a positive number (eager ms / graph ms to keep a graph), got {value!r}")
    return float(value)


def directory(value: Any, option: str) -> str | None:
    if value is not None and not isinstance(value, str):
        raise CaptureConfigError(f"{option} must be a directory path or null, got {value!r}")
    return value


def break_names(value: Any, option: str) -> tuple[str, ...]:
    if isinstance(value, str) or not value or not all(isinstance(name, str) for name in value):
        raise CaptureConfigError(f"{option} must be a non-empty list of break-point names, got {value}")
    return tuple(value)


def op_names(value: Any, option: str) -> tuple[str, ...] | None:
    """Qualified names ('namespace::name') of registered ops; None: the caller's."""
    if value is None:
        return None
    if isinstance(value, str) or not value or not all(isinstance(op, str) for op in value):
        raise CaptureConfigError(f"{option} must be a non-empty list of op names like [namespace::attention], got {value!r}")
    for op in value:
        namespace, _, name = op.partition("::")
        if not (namespace and name and _is_registered(namespace, name)):
            raise CaptureConfigError(f"{option}: {op!r} is not a registered op ('namespace::name')")
    return tuple(value)


def _is_registered(namespace: str, name: str) -> bool:
    try:
        getattr(getattr(torch.ops, namespace), name)
    except (AttributeError, RuntimeError):
        return False
    return True
