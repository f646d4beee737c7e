"""The one owner of KV memory: the token slot pool, the request → token table and the prefix cache.

The scheduler decides what runs; every allocation, lock, insertion, eviction and free that its
decisions need happens here, and nowhere else.  Per request the manager keeps a holding: its
table row, how many leading positions have a slot mapped, and how many of those belong to the
prefix cache (locked through one node while the request holds them).  The request itself only
says how many tokens have their KV computed (`Req.num_computed_tokens`).

Every KV slot is, at any time, exactly one of: free; owned by one node of the prefix cache
(evictable unless a holding locks it); or owned by one request (mapped past its prefix).
`audit()` checks exactly that.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Protocol, Sequence

import torch

from graphexec.batch.table_change import TableChange
from graphexec.cache.kv_pool import TokenToKVPool
from graphexec.cache.prefix_cache import RadixCache
from graphexec.cache.req_to_token_pool import ReqToTokenPool

if TYPE_CHECKING:
    from graphexec.batch.request import Req
    from graphexec.config import EngineConfig


class PoolShape(Protocol):
    """What the KV pool needs to know of the model (one rank's graphexec/models ModelConfig has it)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int


class KVCacheFullError(RuntimeError):
    """A forward needs more KV slots than are free or evictable."""


@dataclass
class _Holding:
    row: int  # the request's row of req_to_token
    allocated: int = 0  # leading positions with a slot mapped (computed, or being computed)
    prefix_len: int = 0  # leading positions whose slots the prefix cache owns
    prefix_node: Any = None  # the cache node that ends them, locked while held


class KVCacheManager:
    def __init__(self, token_pool: TokenToKVPool, req_pool: ReqToTokenPool, prefix_cache: bool = True):
        self.token_pool = token_pool
        self.req_to_token_pool = req_pool
        self.prefix_cache = RadixCache(token_pool.free) if prefix_cache else None
        self._held: dict[Req, _Holding] = {}

    @classmethod
    def from_config(cls, config: EngineConfig, model: PoolShape, max_context: int, journal: bool = False) -> KVCacheManager:
        """A rank's cache.  With `journal`, the request → token table records its changes for
        `take_table_changes` (rank 0's, whose table other tensor-parallel ranks mirror)."""
        device = torch.device(config.device)
        rows = ReqToTokenPool(config.scheduler.max_running_requests, max_context, device, journal=journal)
        slots = TokenToKVPool(
            config.cache.num_slots, model.num_layers, model.num_kv_heads, model.head_dim,
            config.cache.torch_dtype or config.torch_dtype, device,
        )
        return cls(slots, rows, config.cache.prefix_cache)

    # ---- sizes (slots) ----

    @property
    def num_slots(self) -> int:
        return self.token_pool.num_slots

    @property
    def num_free(self) -> int:
        return self.token_pool.num_free

    @property
    def num_cached(self) -> int:
        """Slots the prefix cache owns (some in use by holders, the rest evictable)."""
        return self.prefix_cache.cached_tokens if self.prefix_cache else 0

    @property
    def num_locked(self) -> int:
        """Cached slots on a prefix some holder has locked: not evictable."""
        return self.prefix_cache.locked_tokens if self.prefix_cache else 0

    @property
    def num_available(self) -> int:
        """Slots an allocation can get now: free, plus cached ones no holder locks."""
        return self.num_free + self.num_cached - self.num_locked

    @property
    def num_free_rows(self) -> int:
        return self.req_to_token_pool.num_free

    @property
    def max_context(self) -> int:
        """Positions per request row: the longest request the table can map."""
        return self.req_to_token_pool.max_context

    # ---- the table's changes, for other tensor-parallel ranks ----

    def take_table_changes(self) -> list[TableChange]:
        """The request → token table's changes since the last call; [] without a journal."""
        return self.req_to_token_pool.take_journal()

    def replay_table_changes(self, changes: list[TableChange]) -> None:
        """Apply another rank's table changes to this rank's table (a worker's mirror)."""
        self.req_to_token_pool.replay(changes)

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_available

    # ---- per request ----

    def holds(self, req: Req) -> bool:
        return req in self._held

    def holders(self) -> list[Req]:
        return list(self._held)

    def row(self, req: Req) -> int:
        return self._held[req].row

    def rows(self, reqs: Iterable[Req]) -> list[int]:
        return [self._held[r].row for r in reqs]

    def num_allocated(self, req: Req) -> int:
        """Leading positions of the request with a KV slot mapped (0 when it holds nothing)."""
        held = self._held.get(req)
        return held.allocated if held else 0

    def prefix_len(self, req: Req) -> int:
        """Leading positions whose slots the prefix cache owns (0 when it holds nothing)."""
        held = self._held.get(req)
        return held.prefix_len if held else 0

    def admit(self, req: Req, reuse_prefix: bool = True) -> int:
        """Give a request a table row and, with `reuse_prefix`, map and lock the longest cached
        prefix of its tokens but the last (which must be computed to sample from).  Returns how
        many tokens the cache supplied: their KV counts as computed."""
        if req in self._held:
            raise RuntimeError(f"request {req.rid} already holds KV")
        held = _Holding(self.req_to_token_pool.alloc())
        self._held[req] = held
        if reuse_prefix and self.prefix_cache is not None:
            ids = req.all_ids
            match = self.prefix_cache.match(ids[: len(ids) - 1])
            self.prefix_cache.lock(match.node)
            held.prefix_node = match.node
            held.prefix_len = held.allocated = len(match)
            if len(match):
                self._map(held, 0, match.slots)
        return held.prefix_len

    def allocate(self, reqs: Sequence[Req], lens: Sequence[int]) -> torch.Tensor:
        """Slots for each request's next `lens[i]` positions, concatenated in order, mapped in
        their table rows.  Unlocked cached KV is evicted, least recently used first, when the
        free list is short; KVCacheFullError when even that cannot supply them (nothing
        changes then).  A request's new positions start where its computed KV ends."""
        total = sum(lens)
        if total > self.num_available:
            raise KVCacheFullError(
                f"KV cache full: a forward needs {total} slots, {self.num_free} free and "
                f"{self.num_cached - self.num_locked} evictable of {self.num_slots} (cache.num_slots)"
            )
        short = total - self.num_free
        if short > 0:
            self.prefix_cache.evict(short)
        holdings = [self._held[r] for r in reqs]
        for req, held in zip(reqs, holdings):
            if held.allocated != req.num_computed_tokens:
                raise RuntimeError(
                    f"request {req.rid}: {held.allocated} positions mapped but {req.num_computed_tokens} computed"
                )
        slots = self.token_pool.alloc(total)
        # Every (row, position) pair in one indexed write, decode tokens and prompt chunks alike.
        rows: list[int] = []
        cols: list[int] = []
        for held, n in zip(holdings, lens):
            rows += [held.row] * n
            cols += range(held.allocated, held.allocated + n)
            held.allocated += n
        self.req_to_token_pool.write_points(rows, cols, slots)
        return slots

    def cache_computed(self, req: Req) -> None:
        """Hand the KV the request has computed so far to the prefix cache, so requests admitted
        from now on reuse it.  The request keeps those slots as its locked prefix; where another
        request cached the same tokens first, it switches to those slots and frees its own."""
        cache, held = self.prefix_cache, self._held[req]
        computed, old_prefix = req.num_computed_tokens, held.prefix_len
        if cache is None or computed <= old_prefix:
            return
        ids = req.all_ids[:computed]
        slots = self._mapped(held, 0, computed)
        already = cache.insert(ids, slots)
        match = cache.match(ids)
        if already > old_prefix:
            self.token_pool.free(slots[old_prefix:already])
            self._map(held, old_prefix, match.slots[old_prefix:already])
        cache.lock(match.node)
        if held.prefix_node is not None:
            cache.unlock(held.prefix_node)
        held.prefix_node, held.prefix_len = match.node, computed

    def release(self, req: Req, cache: bool = True) -> None:
        """Return everything the request holds (no-op if nothing): with `cache`, its computed KV
        goes to the prefix cache (unlocked, so evictable); the rest of its slots, its row and its
        lock are freed.  Without `cache` (KV half written by a failed forward) only the prefix
        it matched stays cached."""
        held = self._held.get(req)
        if held is None:
            return
        if cache and self.prefix_cache is not None:
            self.cache_computed(req)
        self.token_pool.free(self._mapped(held, held.prefix_len, held.allocated))
        if held.prefix_node is not None:
            self.prefix_cache.unlock(held.prefix_node)
        self.req_to_token_pool.free(held.row)
        del self._held[req]

    def truncate(self, req: Req, length: int) -> None:
        """Unmap and free the request's own slots past `length`: rejected drafts, a hand run rewound."""
        held = self._held[req]
        if not held.prefix_len <= length <= held.allocated:
            raise ValueError(f"truncate to {length}: request {req.rid} maps {held.allocated}, its prefix {held.prefix_len}")
        self.token_pool.free(self._mapped(held, length, held.allocated))
        held.allocated = length

    def flush(self) -> int:
        """Evict the whole prefix cache; refused while any request holds KV.  Returns slots freed."""
        if self._held:
            raise RuntimeError("flush_cache: requests are in flight; flush when the engine is idle")
        freed = self.num_cached
        if self.prefix_cache is not None:
            self.prefix_cache.reset()
        return freed

    def audit(self) -> None:
        """Check that every slot is free, cached or owned by one holder, exactly once, and that
        the lock counts match the holdings (slow: for tests)."""
        owners = [self.token_pool.free_slots()]
        if self.prefix_cache is not None:
            owners += [n.slots for n in self.prefix_cache.nodes()]
        owners += [self._mapped(h, h.prefix_len, h.allocated) for h in self._held.values()]
        every = torch.cat(owners).sort().values
        expected = torch.arange(1, self.num_slots + 1)
        if every.numel() != expected.numel() or not torch.equal(every, expected):
            raise AssertionError(f"KV slots lost or double-owned: {every.numel()} owned of {self.num_slots}")
        if self.num_free_rows + len(self._held) != self.req_to_token_pool.max_requests:
            raise AssertionError("request rows lost")
        if self.prefix_cache is not None:
            self._audit_locks()

    def _audit_locks(self) -> None:
        expected: dict[int, int] = {}
        for held in self._held.values():
            node = held.prefix_node
            while node is not None and node is not self.prefix_cache.root:
                expected[id(node)] = expected.get(id(node), 0) + 1
                node = node.parent
        for node in self.prefix_cache.nodes():
            if node.lock_ref != expected.get(id(node), 0):
                raise AssertionError(f"prefix-cache node locked {node.lock_ref} times, held by {expected.get(id(node), 0)}")
        locked = sum(len(n.key) for n in self.prefix_cache.nodes() if n.lock_ref)
        if locked != self.num_locked:
            raise AssertionError(f"locked_tokens {self.num_locked} != {locked} on locked nodes")

    def _map(self, held: _Holding, start: int, slots: torch.Tensor) -> None:
        table = self.req_to_token_pool
        table.write(held.row, start, slots.to(table.req_to_token.device))

    def _mapped(self, held: _Holding, start: int, end: int) -> torch.Tensor:
        return self.req_to_token_pool.req_to_token[held.row, start:end].clone().cpu()
