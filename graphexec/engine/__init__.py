"""The Python serving API: `engine.py` (Engine: load, generate, stream, abort), the background
loop that owns the scheduler (`engine_loop.py`), per-request streams and trackers, outputs,
metrics and serving statistics.  Builds the KV cache manager, the runner and the scheduler and
calls down into them; the HTTP server (graphexec/server/) sits on top of it.
"""

from graphexec.lazy_exports import lazy_getattr

_PUBLIC = {
    "Engine": "graphexec.engine.engine",
    "RequestOutput": "graphexec.engine.request_output",
    "RequestDelta": "graphexec.engine.request_output",
}
__all__ = sorted(_PUBLIC)

__getattr__ = lazy_getattr(__name__, _PUBLIC)
