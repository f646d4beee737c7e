"""The paged KV pool (page size 1): per-layer K and V buffers indexed by slot, and their allocator."""

from __future__ import annotations

import math
import mmap

import torch

from graphexec.batch.padding import DUMMY_SLOT


class SlotAllocator:
    """Free list of KV slots 1..num_slots (slot 0 is reserved)."""

    def __init__(self, num_slots: int):
        if num_slots < 1:
            raise ValueError(f"cache.num_slots must be >= 1, got {num_slots}")
        self.num_slots = num_slots
        # A tensor free list keeps alloc/free O(n) in C rather than per-slot Python work.
        self._free = torch.arange(1, num_slots + 1, dtype=torch.int64)

    @property
    def num_free(self) -> int:
        return int(self._free.numel())

    def free_slots(self) -> torch.Tensor:
        """A copy of the free list (for audits)."""
        return self._free.clone()

    def alloc(self, n: int) -> torch.Tensor:
        if n > self.num_free:
            raise RuntimeError(f"KV pool exhausted: need {n} slots, {self.num_free} free")
        slots, self._free = self._free[:n], self._free[n:]
        return slots

    def free(self, slots: torch.Tensor) -> None:
        if slots.numel() == 0:
            return
        if bool((slots == DUMMY_SLOT).any()):
            raise RuntimeError("attempt to free the dummy KV slot")
        # Freed slots go to the front, so the next allocations reuse them (a stack, not a queue):
        # the pool's memory is taken from the OS on first touch (_zeros), and a queue walked every
        # request on to untouched pages until the whole pool was resident (with huge pages, a
        # ~0.2 s stall each 2 MiB on a 2-core Xeon).  Reusing freed slots keeps page faults and
        # resident memory to the peak the pool has held, and recently written KV warm in cache.
        self._free = torch.cat([slots.to(torch.int64).cpu(), self._free])
        if self._free.numel() > self.num_slots:
            raise RuntimeError("KV slots freed twice")


class TokenToKVPool:
    """K and V pools `[num_layers, num_slots + 1, kv_heads, head_dim]`, plus the slot allocator.

    One tensor per side, so a kernel reaches any layer from a single argument (the C++ attention
    kernels take `k_pool`/`v_pool` and a layer id); `k_buffers[i]`/`v_buffers[i]` are views of
    layer i, writable in place.
    """

    def __init__(
        self,
        num_slots: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ):
        self.allocator = SlotAllocator(num_slots)
        shape = (num_layers, num_slots + 1, num_kv_heads, head_dim)
        self.k_pool = _zeros(shape, dtype, torch.device(device))
        self.v_pool = _zeros(shape, dtype, torch.device(device))
        self.k_buffers = list(self.k_pool.unbind(0))
        self.v_buffers = list(self.v_pool.unbind(0))

    @property
    def num_slots(self) -> int:
        return self.allocator.num_slots

    @property
    def num_free(self) -> int:
        return self.allocator.num_free

    def alloc(self, n: int) -> torch.Tensor:
        return self.allocator.alloc(n)

    def free_slots(self) -> torch.Tensor:
        return self.allocator.free_slots()

    def free(self, slots: torch.Tensor) -> None:
        self.allocator.free(slots)

    def write(self, layer_id: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        k_buffer, v_buffer = self.k_buffers[layer_id], self.v_buffers[layer_id]
        k_buffer.index_copy_(0, slots, k.to(k_buffer.dtype))  # cache.dtype may differ from the model's
        v_buffer.index_copy_(0, slots, v.to(v_buffer.dtype))

    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in (self.k_pool, self.v_pool))


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero pool whose CPU memory is taken only as slots are first written.

    torch.zeros writes every byte up front (the default pool is 720 MiB of fp32 for SmolLM2).  An
    anonymous mapping is the OS's zero pages until written, so a pool costs resident memory in
    proportion to the KV actually used, in 4 KiB pages: with transparent huge pages (which
    numpy's calloc asks for) a request's first write to a 2 MiB region of every layer's K and V
    faulted in and zeroed 2 MiB each, 120 MiB and ~0.2 s for SmolLM2's first prompt.
    """
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    area = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):  # Linux
        area.madvise(mmap.MADV_NOHUGEPAGE)
    return torch.frombuffer(area, dtype=torch.uint8).view(dtype).view(shape)
