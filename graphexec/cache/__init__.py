"""KV memory: `manager.py` (KVCacheManager, the one owner) over its parts: `kv_pool.py` (K/V
buffers and the slot allocator), `req_to_token_pool.py` (the request → slot table) and
`prefix_cache.py` (the radix tree of cached prefixes).  Knows requests only by their ids and
computed lengths; nothing here schedules or runs a model.
"""

from graphexec.lazy_exports import lazy_getattr

_PUBLIC = {
    "KVCacheManager": "graphexec.cache.manager",
}
__all__ = sorted(_PUBLIC)

__getattr__ = lazy_getattr(__name__, _PUBLIC)
