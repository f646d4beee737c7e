"""The KV slot allocator: freed slots are reused first, and misuse is refused.

Reuse order matters beyond correctness: the pool's pages are taken from the OS on first touch
(graphexec/cache/kv_pool.py), so an allocator that walked on to never-touched slots would grow
resident memory and stall prefills on page faults while a smaller working set would do."""

import pytest
import torch

from graphexec.cache.kv_pool import SlotAllocator


def test_freed_slots_are_reused_before_untouched_ones():
    alloc = SlotAllocator(100)
    first = alloc.alloc(10)
    assert first.tolist() == list(range(1, 11))
    alloc.free(first)
    again = alloc.alloc(10)
    assert again.tolist() == first.tolist()  # not 11..20: those pages were never touched
    alloc.free(again[:4])
    assert alloc.alloc(6).tolist() == [1, 2, 3, 4, 11, 12]
    assert alloc.num_free == 100 - 12


def test_misuse_is_refused_by_name():
    alloc = SlotAllocator(8)
    slots = alloc.alloc(8)
    with pytest.raises(RuntimeError, match="KV pool exhausted: need 1 slots, 0 free"):
        alloc.alloc(1)
    with pytest.raises(RuntimeError, match="dummy KV slot"):
        alloc.free(torch.tensor([0]))
    alloc.free(slots)
    with pytest.raises(RuntimeError, match="freed twice"):
        alloc.free(slots[:1])
