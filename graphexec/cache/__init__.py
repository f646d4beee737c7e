"""KV memory: `manager.py` (KVCacheManager, the one owner) over its parts: `kv_pool.py` (K/V
buffers and the slot allocator), `req_to_token_pool.py` (the request → slot table) and
`prefix_cache.py` (the radix tree of cached prefixes).  Knows requests only by their ids and
computed lengths; nothing here schedules or runs a model.
"""

import importlib

# Resolved on first access, so importing one module of the package does not load the others
# (and lower layers can import a module here without a cycle through this file).
_PUBLIC = {
    "KVCacheManager": "graphexec.cache.manager",
}
__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
