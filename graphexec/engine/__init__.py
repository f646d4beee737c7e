"""The Python serving API: `engine.py` (Engine: load, generate, stream, abort), the background
loop that owns the scheduler (`engine_loop.py`), per-request streams and trackers, outputs,
metrics and serving statistics.  Builds the KV cache manager, the runner and the scheduler and
calls down into them; the HTTP server (graphexec/server/) sits on top of it.
"""

import importlib

# Resolved on first access, so importing one module of the package does not load the others
# (and lower layers can import a module here without a cycle through this file).
_PUBLIC = {
    "Engine": "graphexec.engine.engine",
    "RequestOutput": "graphexec.engine.request_output",
    "RequestDelta": "graphexec.engine.request_output",
}
__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
