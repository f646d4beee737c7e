"""What rank 0 tells the other tensor-parallel ranks each step, and how it is laid out on the
wire: the message types and the fixed, versioned schema step_codec.py encodes and checks.

Boundary: data only (types, codes, the layout tables); no encoding, no I/O.

Layout, all in native byte order (little-endian wherever torch runs; a peer of the other order
fails the magic check), every offset a multiple of 8:

  header   int64 words: SCALARS (magic, version, kind, presence flags, the ForwardBatch's scalars
           and counts, the total length), then for each of SLOTS its dtype code (0: absent) and
           its number of rows (a 2-D slot's width is fixed by the schema)
  tensors  each present slot's raw bytes, in SLOTS order, zero-padded to a multiple of 8

Every enum travels as its index in one of the tuples below (KINDS, MODES, CHANGE_KINDS, DTYPES),
never as a name.  A change to any table here changes the wire format: bump VERSION.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from graphexec.batch.forward_batch import ForwardBatch
from graphexec.batch.forward_mode import ForwardMode
from graphexec.batch.table_change import TableChange

MAGIC = 0x3150_4554_5358_4547  # b"GEXSTEP1" read as a little-endian int64
VERSION = 2  # 2: ForwardMode.TARGET_VERIFY


class StepMessageError(ValueError):
    """Bytes that are not a well-formed step message, or a message the schema cannot carry."""


class StepKind(enum.Enum):
    FORWARD = "forward"
    KEEP_ALIVE = "keep_alive"
    STOP = "stop"


@dataclass(frozen=True)
class StepMessage:
    kind: StepKind
    batch: ForwardBatch | None = None  # FORWARD only: sampling state stripped, tensors on the CPU
    # Rank 0's req_to_token journal since the previous message (graphexec/cache/req_to_token_pool.py).
    table_changes: tuple[TableChange, ...] = ()


# Wire codes are indices into these tuples (dtype code 0: slot absent).
KINDS = (StepKind.FORWARD, StepKind.KEEP_ALIVE, StepKind.STOP)
MODES = (ForwardMode.EXTEND, ForwardMode.DECODE, ForwardMode.MIXED, ForwardMode.IDLE, ForwardMode.TARGET_VERIFY)
CHANGE_KINDS = ("span", "points", "clear")
DTYPES = (None, torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)
NUMPY_DTYPES = (None, np.int64, np.int32, np.int16, np.int8, np.uint8)  # the same, as numpy sees them

# The header words only a FORWARD message's batch sets (0 in any other message).
BATCH_SCALARS = (
    "forward_mode", "batch_size", "num_tokens", "seq_lens_sum", "num_token_non_padded", "extend_num_tokens", "max_top_k",
)  # fmt: skip
SCALARS = ("magic", "version", "kind", "flags", *BATCH_SCALARS, "num_changes", "total_bytes")

# Presence flags: which optional groups of slots the message holds.
HAS_BATCH, HAS_EXTEND, HAS_NON_PADDED, HAS_LOGPROBS = 1, 2, 4, 8
ALWAYS = 0  # the table-change slots: every kind of message carries the journal
ALL_FLAGS = HAS_BATCH | HAS_EXTEND | HAS_NON_PADDED | HAS_LOGPROBS


class Slot(NamedTuple):
    name: str
    group: int  # the flag that says it is present (ALWAYS: always)
    width: int  # 0: 1-D; else a 2-D [rows, width] table
    rows: str  # the header count its rows must equal ("": checked against other slots)


SLOTS = (
    Slot("input_ids", HAS_BATCH, 0, "num_tokens"),
    Slot("positions", HAS_BATCH, 0, "num_tokens"),
    Slot("req_pool_indices", HAS_BATCH, 0, "batch_size"),
    Slot("seq_lens", HAS_BATCH, 0, "batch_size"),
    Slot("seq_lens_cpu", HAS_BATCH, 0, "batch_size"),
    Slot("out_cache_loc", HAS_BATCH, 0, "num_tokens"),
    Slot("extend_prefix_lens", HAS_EXTEND, 0, "batch_size"),
    Slot("extend_seq_lens", HAS_EXTEND, 0, "batch_size"),
    Slot("extend_start_loc", HAS_EXTEND, 0, "batch_size"),
    Slot("extend_prefix_lens_cpu", HAS_EXTEND, 0, "batch_size"),
    Slot("extend_seq_lens_cpu", HAS_EXTEND, 0, "batch_size"),
    Slot("num_token_non_padded_device", HAS_NON_PADDED, 0, "one"),
    Slot("logprob_spans", HAS_LOGPROBS, 5, ""),
    Slot("logprob_rows", HAS_LOGPROBS, 0, ""),
    Slot("logprob_targets", HAS_LOGPROBS, 0, ""),
    Slot("change_heads", ALWAYS, 4, "num_changes"),  # (kind, row, start, count) per change
    Slot("change_slots", ALWAYS, 0, ""),  # every span's and points change's slots, in order
    Slot("change_rows", ALWAYS, 0, ""),  # every points change's rows, in order
    Slot("change_cols", ALWAYS, 0, ""),
)
HEADER_WORDS = len(SCALARS) + 2 * len(SLOTS)
HEADER_BYTES = 8 * HEADER_WORDS

# Every ForwardBatch field, each carried by a scalar or slot above (sampling_info: always None).
BATCH_FIELDS = frozenset(
    {
        "forward_mode", "batch_size", "input_ids", "positions", "req_pool_indices", "seq_lens",
        "seq_lens_cpu", "seq_lens_sum", "out_cache_loc", "extend_prefix_lens", "extend_seq_lens",
        "extend_start_loc", "extend_prefix_lens_cpu", "extend_seq_lens_cpu", "extend_num_tokens",
        "num_token_non_padded", "sampling_info", "num_token_non_padded_device", "prompt_logprobs",
    }
)  # fmt: skip
TENSOR_FIELDS = ("input_ids", "positions", "req_pool_indices", "seq_lens", "out_cache_loc")
EXTEND_TENSORS = ("extend_prefix_lens", "extend_seq_lens", "extend_start_loc")
PLAN_FIELDS = frozenset({"spans", "rows", "targets", "max_top_k"})
SPAN_FIELDS = ("batch_index", "first_row", "num_rows", "first_position", "top_k")  # a spans row, in order
