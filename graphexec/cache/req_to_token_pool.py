"""The request → token table: `req_to_token[req_pool_idx, logical_pos] = kv_slot`."""

from __future__ import annotations

import torch

# Row 0 is the dummy request that padded batch rows point at; it is never handed out.
DUMMY_REQ_ROW = 0


class ReqToTokenPool:
    def __init__(self, max_requests: int, max_context: int, device: torch.device | str = "cpu"):
        if max_requests < 1:
            raise ValueError(f"max_requests must be >= 1, got {max_requests}")
        # Slot 0 everywhere: an unwritten position points at the dummy KV slot, never at live KV.
        self.req_to_token = torch.zeros(max_requests + 1, max_context, dtype=torch.int64, device=device)
        self.max_requests = max_requests
        self.max_context = max_context
        self._free_rows = list(range(max_requests, DUMMY_REQ_ROW, -1))

    @property
    def num_free(self) -> int:
        return len(self._free_rows)

    def alloc(self) -> int:
        if not self._free_rows:
            raise RuntimeError("ReqToTokenPool exhausted: the scheduler admitted more requests than max_requests")
        return self._free_rows.pop()

    def free(self, row: int) -> None:
        if row == DUMMY_REQ_ROW or not 0 < row <= self.max_requests or row in self._free_rows:
            raise RuntimeError(f"ReqToTokenPool.free got invalid or already free row {row}")
        self.req_to_token[row].zero_()
        self._free_rows.append(row)

    def write(self, row: int, start: int, slots: torch.Tensor) -> None:
        """Map logical positions [start, start + len(slots)) of a request to KV slots."""
        self.req_to_token[row, start : start + slots.numel()] = slots
