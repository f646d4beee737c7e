"""The prefix cache: a radix tree over token ids whose nodes own the KV slots of those tokens.

Page size 1, so a node's edge is any run of tokens and its slots one per token.  A request that
starts with a cached prefix maps those slots into its table row instead of computing them; the
nodes it uses are locked (lock counts up to the root) until it ends, and only unlocked leaves are
evicted, least recently used first, when the KV pool runs short.  The scheduler inserts a
request's prompt once it is prefilled and the rest when it ends; the tree takes over the slots.

Every KV slot is, at any time, free, owned by exactly one running request, or owned by exactly
one node of this tree.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Callable

import torch


class _Node:
    __slots__ = ("parent", "key", "slots", "children", "lock_ref", "last_access")

    def __init__(self, parent: "_Node | None", key: tuple[int, ...], slots: torch.Tensor, tick: int):
        self.parent, self.key, self.slots = parent, key, slots
        self.children: dict[int, _Node] = {}
        self.lock_ref = 0
        self.last_access = tick


class PrefixMatch:
    """What `match` found: the cached slots of the longest cached prefix, and its last node
    (hold it to `lock`/`unlock` the path)."""

    __slots__ = ("slots", "node")

    def __init__(self, slots: torch.Tensor, node: _Node):
        self.slots, self.node = slots, node

    def __len__(self) -> int:
        return int(self.slots.numel())


class RadixCache:
    def __init__(self, free_slots: Callable[[torch.Tensor], None]):
        self._free_slots = free_slots
        self._clock = itertools.count(1)
        self.root = _Node(None, (), torch.empty(0, dtype=torch.int64), 0)
        self.root.lock_ref = 1  # never evicted
        self.cached_tokens = 0  # slots the tree owns
        self.locked_tokens = 0  # of those, slots on a path some running request holds

    @property
    def evictable_tokens(self) -> int:
        return self.cached_tokens - self.locked_tokens

    def match(self, key: list[int]) -> PrefixMatch:
        """The longest cached prefix of `key`.  Splits an edge matched only in part, so the match
        always ends exactly at a node."""
        node, pieces, i = self.root, [], 0
        tick = next(self._clock)
        while i < len(key) and key[i] in node.children:
            child = node.children[key[i]]
            n = _common_length(child.key, key, i)
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = tick
            pieces.append(child.slots)
            node, i = child, i + n
        slots = torch.cat(pieces) if pieces else self.root.slots
        return PrefixMatch(slots, node)

    def insert(self, key: list[int], slots: torch.Tensor) -> int:
        """Cache `slots` as the KV of `key`; returns how many leading tokens were cached already
        (their slots in `slots` are the caller's to free; the rest now belong to the tree)."""
        node, i = self.root, 0
        tick = next(self._clock)
        while i < len(key):
            child = node.children.get(key[i])
            if child is None:
                leaf = _Node(node, tuple(key[i:]), slots[i:].clone(), tick)
                node.children[key[i]] = leaf
                self.cached_tokens += len(leaf.key)
                return i
            n = _common_length(child.key, key, i)
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = tick
            node, i = child, i + n
        return i

    def lock(self, node: _Node) -> None:
        while node is not self.root:
            if node.lock_ref == 0:
                self.locked_tokens += len(node.key)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: _Node) -> None:
        while node is not self.root:
            if node.lock_ref <= 0:
                raise RuntimeError("prefix cache: unlock of a node that is not locked")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.locked_tokens -= len(node.key)
            node = node.parent

    def evict(self, num_tokens: int) -> int:
        """Free at least `num_tokens` slots (fewer if not that many are evictable), least recently
        used leaves first; returns how many were freed."""
        leaves = [(n.last_access, id(n), n) for n in self.nodes() if not n.children and n.lock_ref == 0]
        heapq.heapify(leaves)
        freed = 0
        while freed < num_tokens and leaves:
            _, _, leaf = heapq.heappop(leaves)
            self._free_slots(leaf.slots)
            freed += len(leaf.key)
            self.cached_tokens -= len(leaf.key)
            parent = leaf.parent
            del parent.children[leaf.key[0]]
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(leaves, (parent.last_access, id(parent), parent))
        return freed

    def reset(self) -> None:
        """Evict everything; refused while a running request holds part of the tree."""
        if self.locked_tokens:
            raise RuntimeError(f"prefix cache: {self.locked_tokens} cached tokens are in use by running requests")
        self.evict(self.cached_tokens)

    def _split(self, child: _Node, n: int) -> _Node:
        """Cut child's edge after n tokens: a new node for the first n, child keeps the rest."""
        head = _Node(child.parent, child.key[:n], child.slots[:n], child.last_access)
        head.lock_ref = child.lock_ref  # the same requests hold both halves
        child.parent.children[child.key[0]] = head
        child.parent, child.key, child.slots = head, child.key[n:], child.slots[n:]
        head.children[child.key[0]] = child
        return head

    def nodes(self):
        """Every node but the root."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())


def _common_length(edge: tuple[int, ...], key: list[int], start: int) -> int:
    n = min(len(edge), len(key) - start)
    for j in range(n):
        if edge[j] != key[start + j]:
            return j
    return n
