"""Capture backends: how a ModelRunner executes one forward (eager, and the graph backends).

This package knows ForwardBatch and the model's callable; it knows nothing of the scheduler or of
requests.
"""

from capture.backend import BackendStats, CaptureBackend, CaptureEnv, ModelCallable
from capture.padding import PaddingPolicy
from capture.registry import available_backends, create_backend

__all__ = [
    "BackendStats",
    "CaptureBackend",
    "CaptureEnv",
    "ModelCallable",
    "PaddingPolicy",
    "available_backends",
    "create_backend",
]
