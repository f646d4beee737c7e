"""Masks a batch's logits to what each row's grammar allows, in one call per step.

One int32 buffer [rows, ceil(V / 32)] is allocated per engine and reused: each constrained row's
matcher fills its row (llguidance's layout: token t is bit t % 32 of word t // 32, bit set =
allowed), then every disallowed logit of those rows is set to -inf.  Rows without a grammar are
not touched, and a batch without any grammar never gets here.

On CPU each row is unpacked by numpy (np.unpackbits in little bit order reads that layout from
the words' little-endian bytes) and its disallowed logits set through a numpy view of the row;
elsewhere the packed rows go to the device (32x fewer bytes than a bool mask) and are unpacked
there with shifts and one masked_fill.  On CPU the numpy way costs a fraction of the torch one,
within about 2x whatever the row allows, so every row takes it (no per-row choice);
llguidance.torch's kernel is no cheaper once compiled and is torch.compile'd, seconds on the first
constrained step.  `graphexec-bench structured_cost` replays real outputs through `apply`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch

# Logit dtypes numpy can write in place (not bfloat16); the sampler's are float32.
_NUMPY_DTYPES = (torch.float32, torch.float64, torch.float16)


class RowGrammar(Protocol):
    def fill_row(self, bitmask: torch.Tensor, row: int) -> None: ...


class TokenBitmask:
    def __init__(self, vocab_size: int, max_rows: int, unpack: str = "auto"):
        """`unpack`: "auto" (numpy on the CPU where the logits' dtype allows, else torch) or
        "torch" (shifts and masked_fill everywhere: the device way, measurable on the CPU)."""
        if unpack not in ("auto", "torch"):
            raise ValueError(f"unpack must be 'auto' or 'torch', got {unpack!r}")
        self.vocab_size = vocab_size
        self._numpy_ok = unpack == "auto"
        self._words = math.ceil(vocab_size / 32)
        self._buffer = torch.zeros((max(max_rows, 1), self._words), dtype=torch.int32)
        self._shifts = torch.arange(32, dtype=torch.int32)

    @property
    def max_rows(self) -> int:
        return self._buffer.shape[0]

    def apply(self, logits: torch.Tensor, grammars: Sequence[RowGrammar | None]) -> torch.Tensor:
        """Logits [B, V] with every token a row's grammar disallows at -inf (in place); `grammars`
        has one entry per row, None for rows left as they are."""
        rows = [row for row, grammar in enumerate(grammars) if grammar is not None]
        if not rows:
            return logits
        if len(grammars) > self.max_rows:
            # A bigger batch than the engine planned for: grow once, keep the new size.
            self._buffer = torch.zeros((len(grammars), self._words), dtype=torch.int32)
        for row in rows:
            grammars[row].fill_row(self._buffer, row)
        if self._numpy_ok and logits.device.type == "cpu" and logits.dtype in _NUMPY_DTYPES:
            self._apply_numpy(logits, rows)
        else:
            self._apply_unpacked(logits, rows)
        return logits

    def _apply_numpy(self, logits: torch.Tensor, rows: list[int]) -> None:
        packed = self._buffer.numpy().view(np.uint8)
        for row in rows:
            allowed = np.unpackbits(packed[row], bitorder="little", count=self.vocab_size).view(bool)
            np.copyto(logits[row, : self.vocab_size].numpy(), -np.inf, where=~allowed)

    def _apply_unpacked(self, logits: torch.Tensor, rows: list[int]) -> None:
        index = torch.tensor(rows, dtype=torch.int64)
        packed = self._buffer.index_select(0, index).to(logits.device, non_blocking=True)
        bits = (packed.unsqueeze(-1) >> self._shifts.to(logits.device)) & 1
        allowed = bits.reshape(len(rows), -1)[:, : self.vocab_size].bool()
        row_index = index.to(logits.device)
        masked = logits[row_index, : self.vocab_size].masked_fill(~allowed, -math.inf)
        logits[row_index, : self.vocab_size] = masked
