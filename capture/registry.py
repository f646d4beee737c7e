"""Capture backends by config name.  Classes are imported on first use, so naming costs nothing."""

from __future__ import annotations

import importlib
from typing import Any, Mapping

import torch

from capture.backend import CaptureBackend, ModelCallable

_BACKENDS: Mapping[str, str] = {
    "eager": "capture.eager:EagerRunner",
}


def available_backends() -> list[str]:
    return sorted(_BACKENDS)


def backend_class(name: str) -> type[CaptureBackend]:
    if name not in _BACKENDS:
        raise KeyError(name)
    module_name, class_name = _BACKENDS[name].split(":")
    return getattr(importlib.import_module(module_name), class_name)


def create_backend(
    name: str, model: ModelCallable, device: torch.device, options: Mapping[str, Any] | None = None
) -> CaptureBackend:
    return backend_class(name)(model, device, options or {})
