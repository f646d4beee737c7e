"""Capture backends by config name.  Classes are imported on first use, so naming costs nothing."""

from __future__ import annotations

import importlib
from typing import Any, Mapping

from capture.backend import CaptureBackend, CaptureEnv
from capture.errors import CaptureConfigError

_BACKENDS: Mapping[str, str] = {
    "eager": "capture.eager:EagerRunner",
    "full_graph": "capture.full_graph:FullGraphBackend",
    "breakable": "capture.breakable:BreakableBackend",
    "tc_piecewise": "capture.tc_piecewise:TcPiecewiseBackend",
}


# `piecewise` names the prefill backend by role; `variant` picks the implementation.  `auto`
# takes tc_piecewise on CPU, what measured best there (bench/prefill.py), and breakable on CUDA,
# where Breakable CUDA Graph needs no compiler and the seeds measure it capturing 3.8-5.2x
# faster (TODO(gpu): never measured here: no device has been lent).
PIECEWISE = "piecewise"
_PIECEWISE_VARIANTS = ("auto", "breakable", "tc_piecewise")


def available_backends() -> list[str]:
    return sorted([*_BACKENDS, PIECEWISE])


def backend_class(name: str) -> type[CaptureBackend]:
    if name not in _BACKENDS:
        raise KeyError(name)
    module_name, class_name = _BACKENDS[name].split(":")
    return getattr(importlib.import_module(module_name), class_name)


def create_backend(
    name: str, env: CaptureEnv, options: Mapping[str, Any] | None = None, config_path: str = "capture"
) -> CaptureBackend:
    options = dict(options or {})
    if name == PIECEWISE:
        name, options = _resolve_piecewise(env, options, config_path)
    return backend_class(name)(env, options, config_path)


def _resolve_piecewise(env: CaptureEnv, options: dict[str, Any], config_path: str) -> tuple[str, dict[str, Any]]:
    variant = options.pop("variant", "auto")
    if variant not in _PIECEWISE_VARIANTS:
        raise CaptureConfigError(f"{config_path}.variant={variant!r} is unknown; choose one of {list(_PIECEWISE_VARIANTS)}")
    if variant != "auto":
        return variant, options
    return ("breakable" if env.device.type == "cuda" else "tc_piecewise"), options
