"""graphexec: a graph-first LLM executor built on torch.compile.

Public names are resolved on first access, so importing one submodule does not load them all.
"""

from __future__ import annotations

from graphexec.lazy_exports import lazy_getattr

_PUBLIC = {
    "Engine": "graphexec.engine.engine",
    "RequestOutput": "graphexec.engine.request_output",
    "RequestDelta": "graphexec.engine.request_output",
    "SamplingParams": "graphexec.sampling_params",
    "StructuredSpec": "graphexec.structured.spec",
    "GraphexecError": "graphexec.errors",
    "InvalidRequestError": "graphexec.errors",
    "ConfigError": "graphexec.errors",
    "CheckpointError": "graphexec.errors",
    "RequestFailedError": "graphexec.errors",
    "EngineClosedError": "graphexec.errors",
}

__all__ = sorted(_PUBLIC)

__getattr__ = lazy_getattr(__name__, _PUBLIC)
