"""Capture backends by config name.  Classes are imported on first use, so naming costs nothing."""

from __future__ import annotations

import importlib
from typing import Any, Mapping

from capture.backend import CaptureBackend, CaptureEnv

_BACKENDS: Mapping[str, str] = {
    "eager": "capture.eager:EagerRunner",
    "full_graph": "capture.full_graph:FullGraphBackend",
    "breakable": "capture.breakable:BreakableBackend",
    "tc_piecewise": "capture.tc_piecewise:TcPiecewiseBackend",
}


def available_backends() -> list[str]:
    return sorted(_BACKENDS)


def backend_class(name: str) -> type[CaptureBackend]:
    if name not in _BACKENDS:
        raise KeyError(name)
    module_name, class_name = _BACKENDS[name].split(":")
    return getattr(importlib.import_module(module_name), class_name)


def create_backend(
    name: str, env: CaptureEnv, options: Mapping[str, Any] | None = None, config_path: str = "capture"
) -> CaptureBackend:
    return backend_class(name)(env, options or {}, config_path)
