"""The request → token table: `req_to_token[req_pool_idx, logical_pos] = kv_slot`.

Under tensor parallelism every rank keeps its own copy of the table (its attention reads it
locally) while only rank 0 decides what goes in it.  A table built with `journal=True` records
each change it makes; rank 0 ships the records with the next step (graphexec/parallel/step_sync.py)
and the other ranks `replay` them, so their tables stay equal to rank 0's without ever sending
the whole table.
"""

from __future__ import annotations

import torch

from graphexec.batch.padding import DUMMY_REQ_ROW
from graphexec.batch.table_change import TableChange


class ReqToTokenPool:
    def __init__(self, max_requests: int, max_context: int, device: torch.device | str = "cpu", journal: bool = False):
        if max_requests < 1:
            raise ValueError(f"max_requests must be >= 1, got {max_requests}")
        # Slot 0 everywhere: an unwritten position points at the dummy KV slot, never at live KV.
        self.req_to_token = torch.zeros(max_requests + 1, max_context, dtype=torch.int64, device=device)
        self.max_requests = max_requests
        self.max_context = max_context
        self._free_rows = list(range(max_requests, DUMMY_REQ_ROW, -1))
        self._journal: list[TableChange] | None = [] if journal else None

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
        self._record(("clear", row))

    def write(self, row: int, start: int, slots: torch.Tensor) -> None:
        """Map logical positions [start, start + len(slots)) of a request to KV slots."""
        self.req_to_token[row, start : start + slots.numel()] = slots
        self._record(("span", row, start, slots))

    def write_points(self, rows: list[int], cols: list[int], slots: torch.Tensor) -> None:
        """Map position cols[i] of row rows[i] to slots[i], for every i, in one indexed write."""
        device = self.req_to_token.device
        self.req_to_token[torch.tensor(rows, device=device), torch.tensor(cols, device=device)] = slots.to(device)
        self._record(("points", rows, cols, slots))

    def take_journal(self) -> list[TableChange]:
        """The changes since the last call (CPU tensors), oldest first; [] without a journal."""
        if self._journal is None:
            return []
        changes, self._journal = self._journal, []
        return changes

    def replay(self, changes: list[TableChange]) -> None:
        """Apply another table's journal to this one (row allocation stays the other table's)."""
        device = self.req_to_token.device
        for change in changes:
            kind = change[0]
            if kind == "span":
                _, row, start, slots = change
                self.req_to_token[row, start : start + slots.numel()] = slots.to(device)
            elif kind == "points":
                _, rows, cols, slots = change
                self.req_to_token[torch.tensor(rows, device=device), torch.tensor(cols, device=device)] = slots.to(device)
            elif kind == "clear":
                self.req_to_token[change[1]].zero_()
            else:
                raise ValueError(f"unknown req_to_token change {kind!r}")

    def _record(self, change: TableChange) -> None:
        if self._journal is not None:
            self._journal.append(tuple(t.cpu() if isinstance(t, torch.Tensor) else t for t in change))
