"""Capture backends: how a caller executes one forward (eager, and the graph backends).

A library: it imports nothing from graphexec (tests/test_layering.py enforces it).  It knows a
batch through the small protocol in batch.py and the model as a callable; the caller declares
the padding fill values, an empty batch per phase and its break-point ops (CaptureEnv).  Every
backend option is declared, documented and checked in one place (options.py, option_parser.py;
docs/CAPTURE_OPTIONS.md is rendered from it).
"""

from capture.backend import BackendStats, CaptureBackend, CaptureEnv, ModelCallable, PreparedForward
from capture.batch import BucketableBatch, Phase
from capture.errors import CaptureConfigError
from capture.option_parser import options_for
from capture.options import CaptureOptions
from capture.padding import PaddingPolicy
from capture.registry import available_backends, create_backend

__all__ = [
    "BackendStats",
    "BucketableBatch",
    "CaptureConfigError",
    "CaptureOptions",
    "Phase",
    "CaptureBackend",
    "CaptureEnv",
    "ModelCallable",
    "PaddingPolicy",
    "PreparedForward",
    "available_backends",
    "create_backend",
    "options_for",
]
