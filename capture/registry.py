"""Capture backends by config name.  Classes are imported on first use, so naming costs nothing."""

from __future__ import annotations

import importlib
from typing import Any, Mapping

from capture.backend import CaptureBackend, CaptureEnv
from capture.option_parser import options_for
from capture.options import PIECEWISE

_BACKENDS: Mapping[str, str] = {
    "eager": "capture.eager:EagerRunner",
    "full_graph": "capture.full_graph:FullGraphBackend",
    "breakable": "capture.breakable:BreakableBackend",
    "tc_piecewise": "capture.tc_piecewise:TcPiecewiseBackend",
}


def available_backends() -> list[str]:
    """Config names: the backends, and `piecewise` (the prefill backend by role, its `variant`
    picking breakable or tc_piecewise: capture/options.py `PiecewiseChoice`)."""
    return sorted([*_BACKENDS, PIECEWISE])


def backend_class(name: str) -> type[CaptureBackend]:
    if name not in _BACKENDS:
        raise KeyError(name)
    module_name, class_name = _BACKENDS[name].split(":")
    return getattr(importlib.import_module(module_name), class_name)


def create_backend(
    name: str, env: CaptureEnv, options: Mapping[str, Any] | None = None, config_path: str = "capture"
) -> CaptureBackend:
    """The backend `name` with `options`, a mode's config entry (checked by options_for; its errors
    name options under `config_path`)."""
    typed = options_for(name, options, config_path, device=env.device)
    return backend_class(typed.backend)(env, typed, config_path)
