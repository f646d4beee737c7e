"""Step messages to bytes and back: int64 words and raw integer-tensor bytes in step_schema.py's
fixed, versioned layout, so that a rank turns the bytes it receives into ints and tensors and never
into Python objects (unpickling network bytes runs whatever they name: remote code execution for
anyone who reaches the control group's port, the class of vLLM's CVE-2025-30165).

Boundary: StepMessage <-> bytes, validation included.  The layout and its codes are
step_schema.py's; moving the bytes between ranks is step_sync.py's; what a message means (replay
the table, run the forward) is the worker's.  Nothing here imports, calls or constructs anything
a message names: every type is fixed by the schema, every enum travels as an index.

`decode` checks the whole message before it builds anything: magic and version, kind / forward
mode / dtype / change kind codes in range, no unknown flag, each slot present exactly when the
flags say, lengths non-negative and equal to what the header's counts imply, every declared byte
present and none after them, the batch's layout self-consistent (host copies equal to their
tensors, seq_lens = prefix + extend, prompt-logprob spans inside the batch) and every table change
well-formed.  Anything else raises StepMessageError naming what is wrong.  Ranges that depend on
the receiving rank (a table row, a KV slot, a token id) cannot be checked here: on the CPU torch's
indexing and the paged-attention kernel (graphexec/kernels/csrc/attention.cpp) refuse them.

A ForwardBatch (or prompt-logprob plan) field the schema does not know fails `encode`, so a new
field can never be dropped on the way to the other ranks: add it to step_schema.py and bump VERSION.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from graphexec.batch.forward_batch import ForwardBatch
from graphexec.batch.prompt_logprobs import PromptLogprobPlan, PromptLogprobSpan
from graphexec.parallel.step_schema import (
    ALL_FLAGS, ALWAYS, BATCH_FIELDS, BATCH_SCALARS, CHANGE_KINDS, DTYPES, EXTEND_TENSORS, HAS_BATCH, HAS_EXTEND,
    HAS_LOGPROBS, HAS_NON_PADDED, HEADER_BYTES, KINDS, MAGIC, MODES, NUMPY_DTYPES, PLAN_FIELDS, SCALARS,
    SLOTS, SPAN_FIELDS, TENSOR_FIELDS, VERSION, Slot, StepKind, StepMessage, StepMessageError, TableChange,
)  # fmt: skip
from graphexec.sampling_params import MAX_LOGPROBS


# -- encoding ---------------------------------------------------------------------------------


def encode(message: StepMessage) -> bytes:
    """The message's bytes; StepMessageError if the schema cannot carry it."""
    if message.kind not in KINDS:
        raise StepMessageError(f"kind must be a StepKind, got {message.kind!r}")
    if (message.kind is StepKind.FORWARD) != (message.batch is not None):
        raise StepMessageError(f"a {message.kind.value} message {'needs' if message.batch is None else 'takes no'} batch")
    scalars = dict.fromkeys(SCALARS, 0)
    scalars.update(magic=MAGIC, version=VERSION, kind=KINDS.index(message.kind))
    slots: dict[str, np.ndarray] = {}
    if message.batch is not None:
        _put_batch(message.batch, scalars, slots)
    _put_changes(message.table_changes, scalars, slots)
    return _pack(scalars, slots)


def _put_batch(fb: ForwardBatch, scalars: dict, slots: dict) -> None:
    names = {f.name for f in dataclasses.fields(fb)}
    if names != BATCH_FIELDS:
        raise StepMessageError(
            f"ForwardBatch fields {sorted(names ^ BATCH_FIELDS)} are not the step wire format's "
            "(graphexec/parallel/step_schema.py): teach it the field and bump VERSION"
        )
    if fb.sampling_info is not None:
        raise StepMessageError("ForwardBatch.sampling_info must be stripped (only rank 0 samples)")
    if fb.forward_mode not in MODES:
        raise StepMessageError(f"forward_mode {fb.forward_mode!r} has no wire code (step_schema.MODES)")
    flags = HAS_BATCH
    scalars.update(
        forward_mode=MODES.index(fb.forward_mode),
        batch_size=fb.batch_size,
        num_tokens=fb.num_tokens,
        seq_lens_sum=fb.seq_lens_sum,
        num_token_non_padded=fb.num_token_non_padded,
    )
    for name in TENSOR_FIELDS:
        slots[name] = _tensor_array(getattr(fb, name), name)
    slots["seq_lens_cpu"] = _int_array(fb.seq_lens_cpu, "seq_lens_cpu")
    if fb.extend_seq_lens is not None:
        flags |= HAS_EXTEND
        scalars["extend_num_tokens"] = fb.extend_num_tokens
        for name in EXTEND_TENSORS:
            slots[name] = _tensor_array(getattr(fb, name), name)
        for name in ("extend_prefix_lens_cpu", "extend_seq_lens_cpu"):
            slots[name] = _int_array(getattr(fb, name), name)
    if fb.num_token_non_padded_device is not None:
        flags |= HAS_NON_PADDED
        slots["num_token_non_padded_device"] = _tensor_array(fb.num_token_non_padded_device, "num_token_non_padded_device")
    if fb.prompt_logprobs is not None:
        flags |= HAS_LOGPROBS
        _put_plan(fb.prompt_logprobs, scalars, slots)
    scalars["flags"] = flags


def _put_plan(plan: PromptLogprobPlan, scalars: dict, slots: dict) -> None:
    names = {f.name for f in dataclasses.fields(plan)}
    span_names = {f.name for f in dataclasses.fields(PromptLogprobSpan)}
    if names != PLAN_FIELDS or span_names != set(SPAN_FIELDS):
        raise StepMessageError(
            f"PromptLogprobPlan fields {sorted(names ^ PLAN_FIELDS)} / PromptLogprobSpan fields "
            f"{sorted(span_names ^ set(SPAN_FIELDS))} are not the step wire format's "
            "(graphexec/parallel/step_schema.py): teach it the field and bump VERSION"
        )
    spans = [[getattr(span, name) for name in SPAN_FIELDS] for span in plan.spans]
    slots["logprob_spans"] = _int_array(spans, "prompt_logprobs.spans").reshape(-1, len(SPAN_FIELDS))
    slots["logprob_rows"] = _tensor_array(plan.rows, "prompt_logprobs.rows")
    slots["logprob_targets"] = _tensor_array(plan.targets, "prompt_logprobs.targets")
    scalars["max_top_k"] = plan.max_top_k


def _put_changes(changes, scalars: dict, slots: dict) -> None:
    heads, slot_parts, rows, cols = [], [], [], []
    for i, change in enumerate(changes):
        kind = change[0] if isinstance(change, tuple) and change else None
        if kind == "span" and len(change) == 4:
            _, row, start, values = change
            heads.append((CHANGE_KINDS.index(kind), row, start, values.numel()))
            slot_parts.append(_tensor_array(values, f"table_changes[{i}] slots").astype(np.int64, copy=False))
        elif kind == "points" and len(change) == 4:
            _, change_rows, change_cols, values = change
            if not len(change_rows) == len(change_cols) == values.numel():
                raise StepMessageError(f"table_changes[{i}]: points rows, cols and slots differ in length")
            heads.append((CHANGE_KINDS.index(kind), 0, 0, len(change_rows)))
            rows += change_rows
            cols += change_cols
            slot_parts.append(_tensor_array(values, f"table_changes[{i}] slots").astype(np.int64, copy=False))
        elif kind == "clear" and len(change) == 2:
            heads.append((CHANGE_KINDS.index(kind), change[1], 0, 0))
        else:
            raise StepMessageError(f"table_changes[{i}] is not a req_to_token journal record: {change!r}")
    scalars["num_changes"] = len(heads)
    slots["change_heads"] = _int_array(heads, "table_changes").reshape(-1, 4)
    slots["change_slots"] = np.concatenate(slot_parts) if slot_parts else np.zeros(0, np.int64)
    slots["change_rows"] = _int_array(rows, "table_changes rows")
    slots["change_cols"] = _int_array(cols, "table_changes cols")


def _tensor_array(tensor: torch.Tensor, name: str) -> np.ndarray:
    if not isinstance(tensor, torch.Tensor) or tensor.dim() != 1 or tensor.dtype not in DTYPES:
        raise StepMessageError(f"{name} must be a 1-D integer tensor ({DTYPES[1:]}), got {_describe(tensor)}")
    return tensor.detach().cpu().numpy()


def _int_array(values, name: str) -> np.ndarray:
    try:
        return np.asarray(values, dtype=np.int64)
    except (TypeError, ValueError, OverflowError) as error:
        raise StepMessageError(f"{name} must be int64 integers: {error}") from error


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    return type(value).__name__


def _pack(scalars: dict, slots: dict[str, np.ndarray]) -> bytes:
    words = [scalars[name] for name in SCALARS]
    parts = []
    total = HEADER_BYTES
    for slot in SLOTS:
        array = slots.get(slot.name)
        if array is None:
            words += (0, 0)
            continue
        words += (NUMPY_DTYPES.index(array.dtype.type), len(array))
        data = array.tobytes()
        parts += (data, bytes(-len(data) % 8))
        total += len(data) + len(parts[-1])
    words[SCALARS.index("total_bytes")] = total
    try:
        header = np.asarray(words, dtype=np.int64).tobytes()
    except OverflowError as error:
        raise StepMessageError(f"a header value does not fit int64: {error}") from error
    return b"".join((header, *parts))


# -- decoding ---------------------------------------------------------------------------------


def decode(data: bytes | bytearray | memoryview | torch.Tensor) -> StepMessage:
    """The message in `data` (a uint8 tensor is read in place), after checking all of it."""
    buf = _as_buffer(data)
    scalars = _read_scalars(buf)
    tensors = _read_slots(buf, scalars)
    _check_counts(scalars, tensors)
    changes = _decode_changes(tensors)
    batch = _decode_batch(scalars, tensors) if scalars["flags"] & HAS_BATCH else None
    return StepMessage(KINDS[scalars["kind"]], batch, changes)


def _as_buffer(data) -> np.ndarray:
    """The bytes as a writable, 8-aligned uint8 array (numpy: slicing it costs a fraction of torch's)."""
    if isinstance(data, torch.Tensor):
        if data.dtype != torch.uint8 or data.dim() != 1 or data.device.type != "cpu":
            raise StepMessageError(f"a step message is a 1-D CPU uint8 tensor, got {_describe(data)}")
        buf = data.numpy()
    elif isinstance(data, (bytes, bytearray, memoryview)):
        buf = np.frombuffer(bytearray(data), dtype=np.uint8)
    else:
        raise StepMessageError(f"a step message is bytes or a uint8 tensor, got {type(data).__name__}")
    # Typed views of the slots need 8-aligned memory.
    return buf if buf.ctypes.data % 8 == 0 and buf.flags.c_contiguous else buf.copy()


def _read_scalars(buf: np.ndarray) -> dict:
    length = len(buf)
    if length < 16:
        raise StepMessageError(f"message of {length} bytes is shorter than magic and version (16)")
    magic, version = buf[:16].view(np.int64).tolist()
    if magic != MAGIC:
        raise StepMessageError(f"bad magic {magic:#x} (expected {MAGIC:#x}): not a step message, or another byte order")
    if version != VERSION:
        raise StepMessageError(f"step message version {version}, this rank speaks {VERSION}: run one graphexec on every rank")
    if length < HEADER_BYTES:
        raise StepMessageError(f"message of {length} bytes is truncated inside its {HEADER_BYTES}-byte header")
    words = buf[:HEADER_BYTES].view(np.int64).tolist()
    scalars = dict(zip(SCALARS, words))
    scalars["slot_words"] = words[len(SCALARS) :]
    if scalars["total_bytes"] != length:
        raise StepMessageError(f"header total_bytes={scalars['total_bytes']} but the message has {length} bytes")
    _check_scalars(scalars)
    return scalars


def _check_scalars(s: dict) -> None:
    if not 0 <= s["kind"] < len(KINDS):
        raise StepMessageError(f"kind code {s['kind']} is not one of 0..{len(KINDS) - 1}")
    flags = s["flags"]
    if flags & ~ALL_FLAGS or (flags and not flags & HAS_BATCH):
        raise StepMessageError(f"flags {flags:#x} are not a combination of {ALL_FLAGS:#x} with the batch bit set")
    forward = KINDS[s["kind"]] is StepKind.FORWARD
    if forward != bool(flags & HAS_BATCH):
        raise StepMessageError(f"a {KINDS[s['kind']].value} message {'needs' if forward else 'takes no'} batch")
    for name in (*BATCH_SCALARS, "num_changes"):
        if s[name] < 0:
            raise StepMessageError(f"header {name}={s[name]} is negative")
    if not forward and any(s[name] for name in BATCH_SCALARS):
        raise StepMessageError(f"a {KINDS[s['kind']].value} message has batch values in its header")
    if forward:
        _check_batch_scalars(s)


def _check_batch_scalars(s: dict) -> None:
    if not s["forward_mode"] < len(MODES):
        raise StepMessageError(f"forward_mode code {s['forward_mode']} is not one of 0..{len(MODES) - 1}")
    extend = MODES[s["forward_mode"]].is_extend()
    if extend != bool(s["flags"] & HAS_EXTEND):
        raise StepMessageError(f"{MODES[s['forward_mode']].name} batch {'needs' if extend else 'takes no'} extend fields")
    if not extend and s["extend_num_tokens"]:
        raise StepMessageError(f"extend_num_tokens={s['extend_num_tokens']} on a batch without extend fields")
    if not s["flags"] & HAS_LOGPROBS and s["max_top_k"]:
        raise StepMessageError(f"max_top_k={s['max_top_k']} on a batch without prompt logprobs")
    if s["num_token_non_padded"] > s["num_tokens"]:
        raise StepMessageError(f"num_token_non_padded={s['num_token_non_padded']} exceeds num_tokens={s['num_tokens']}")


def _read_slots(buf: np.ndarray, scalars: dict) -> dict[str, torch.Tensor]:
    """Each present slot as a tensor viewing buf, every byte accounted for."""
    tensors, offset, length = {}, HEADER_BYTES, len(buf)
    words = scalars["slot_words"]
    for i, slot in enumerate(SLOTS):
        code, rows = words[2 * i], words[2 * i + 1]
        if not _slot_present(slot, code, rows, scalars["flags"], length):
            continue
        nbytes = rows * max(slot.width, 1) * DTYPES[code].itemsize
        end = offset + nbytes + (-nbytes % 8)
        if end > length:
            raise StepMessageError(f"slot {slot.name}: {nbytes} bytes at offset {offset} run past the message's {length}")
        if end > offset + nbytes and buf[offset + nbytes : end].any():
            raise StepMessageError(f"slot {slot.name}: padding bytes are not zero")
        view = buf[offset : offset + nbytes].view(NUMPY_DTYPES[code])
        tensors[slot.name] = torch.from_numpy(view.reshape(rows, slot.width) if slot.width else view)
        offset = end
    if offset != length:
        raise StepMessageError(f"{length - offset} trailing bytes after the last slot (ends at {offset})")
    return tensors


def _slot_present(slot: Slot, code: int, rows: int, flags: int, length: int) -> bool:
    """Whether the header describes the slot as present, after checking it may be (or must be)."""
    expected = slot.group == ALWAYS or bool(flags & slot.group)
    if code == 0:
        if expected or rows:
            raise StepMessageError(f"slot {slot.name} is {'missing' if expected else f'absent with {rows} rows'}")
        return False
    if not expected:
        raise StepMessageError(f"slot {slot.name} is present but its flag is not set")
    if not 0 < code < len(DTYPES):
        raise StepMessageError(f"slot {slot.name}: dtype code {code} is not one of 1..{len(DTYPES) - 1}")
    if not 0 <= rows <= length:
        raise StepMessageError(f"slot {slot.name}: {rows} rows is not a length this {length}-byte message can hold")
    return True


def _check_counts(scalars: dict, tensors: dict[str, torch.Tensor]) -> None:
    for slot in SLOTS:
        if slot.rows and slot.name in tensors:
            want = 1 if slot.rows == "one" else scalars[slot.rows]
            if tensors[slot.name].shape[0] != want:
                raise StepMessageError(f"slot {slot.name} has {tensors[slot.name].shape[0]} rows, header {slot.rows}={want}")


def _decode_batch(s: dict, t: dict[str, torch.Tensor]) -> ForwardBatch:
    mode = MODES[s["forward_mode"]]
    seq_lens_cpu = tuple(t["seq_lens_cpu"].tolist())
    _check_equal(t["seq_lens"].tolist(), seq_lens_cpu, "seq_lens", "seq_lens_cpu")
    if min(seq_lens_cpu, default=0) < 0:
        raise StepMessageError(f"seq_lens_cpu holds a negative length: {min(seq_lens_cpu)}")
    if sum(seq_lens_cpu) != s["seq_lens_sum"]:
        raise StepMessageError(f"seq_lens_sum={s['seq_lens_sum']} but seq_lens_cpu sums to {sum(seq_lens_cpu)}")
    extend = _decode_extend(s, t, seq_lens_cpu) if mode.is_extend() else dict.fromkeys(
        (*EXTEND_TENSORS, "extend_prefix_lens_cpu", "extend_seq_lens_cpu", "extend_num_tokens")
    )
    return ForwardBatch(
        forward_mode=mode,
        batch_size=s["batch_size"],
        input_ids=t["input_ids"],
        positions=t["positions"],
        req_pool_indices=t["req_pool_indices"],
        seq_lens=t["seq_lens"],
        seq_lens_cpu=seq_lens_cpu,
        seq_lens_sum=s["seq_lens_sum"],
        out_cache_loc=t["out_cache_loc"],
        num_token_non_padded=s["num_token_non_padded"],
        sampling_info=None,
        num_token_non_padded_device=t.get("num_token_non_padded_device"),
        prompt_logprobs=_decode_plan(s, t) if s["flags"] & HAS_LOGPROBS else None,
        **extend,
    )


def _decode_extend(s: dict, t: dict[str, torch.Tensor], seq_lens: tuple[int, ...]) -> dict:
    prefix, extend = tuple(t["extend_prefix_lens_cpu"].tolist()), tuple(t["extend_seq_lens_cpu"].tolist())
    _check_equal(t["extend_prefix_lens"].tolist(), prefix, "extend_prefix_lens", "extend_prefix_lens_cpu")
    _check_equal(t["extend_seq_lens"].tolist(), extend, "extend_seq_lens", "extend_seq_lens_cpu")
    if min(prefix + extend, default=0) < 0:
        raise StepMessageError("extend_prefix_lens_cpu / extend_seq_lens_cpu hold a negative length")
    if any(p + e != n for p, e, n in zip(prefix, extend, seq_lens)):
        raise StepMessageError("seq_lens_cpu is not extend_prefix_lens_cpu + extend_seq_lens_cpu")
    starts = np.cumsum((0, *extend[:-1])).tolist() if extend else []
    _check_equal(t["extend_start_loc"].tolist(), starts, "extend_start_loc", "the running sum of extend_seq_lens_cpu")
    if sum(extend) != s["extend_num_tokens"] or s["extend_num_tokens"] > s["num_tokens"]:
        raise StepMessageError(
            f"extend_num_tokens={s['extend_num_tokens']} must equal sum(extend_seq_lens_cpu)={sum(extend)} "
            f"and not exceed num_tokens={s['num_tokens']}"
        )
    return dict(
        extend_prefix_lens=t["extend_prefix_lens"],
        extend_seq_lens=t["extend_seq_lens"],
        extend_start_loc=t["extend_start_loc"],
        extend_prefix_lens_cpu=prefix,
        extend_seq_lens_cpu=extend,
        extend_num_tokens=s["extend_num_tokens"],
    )


def _check_equal(values: list[int], expected, name: str, other: str) -> None:
    if tuple(values) != tuple(expected):
        raise StepMessageError(f"{name} differs from {other}")


def _decode_plan(s: dict, t: dict[str, torch.Tensor]) -> PromptLogprobPlan:
    spans = [PromptLogprobSpan(**dict(zip(SPAN_FIELDS, row))) for row in t["logprob_spans"].tolist()]
    if not spans:
        raise StepMessageError("prompt_logprobs has no spans (a batch where nobody asked carries no plan)")
    for i, span in enumerate(spans):
        if not (
            0 <= span.batch_index < s["batch_size"]
            and span.num_rows >= 1
            and 0 <= span.first_row <= s["num_tokens"] - span.num_rows
            and span.first_position >= 1
            and 0 <= span.top_k <= MAX_LOGPROBS
        ):
            raise StepMessageError(f"prompt_logprobs.spans[{i}]={span} is outside the batch")
    rows = sum(span.num_rows for span in spans)
    for name in ("logprob_rows", "logprob_targets"):
        if t[name].shape[0] != rows:
            raise StepMessageError(f"slot {name} has {t[name].shape[0]} rows, the spans cover {rows}")
    if s["max_top_k"] != max(span.top_k for span in spans):
        raise StepMessageError(f"max_top_k={s['max_top_k']} is not the spans' largest top_k")
    return PromptLogprobPlan(tuple(spans), t["logprob_rows"], t["logprob_targets"], s["max_top_k"])


def _decode_changes(t: dict[str, torch.Tensor]) -> tuple[TableChange, ...]:
    slots, rows, cols = t["change_slots"], t["change_rows"].tolist(), t["change_cols"].tolist()
    if min(rows + cols, default=0) < 0 or len(rows) != len(cols):
        raise StepMessageError("table change rows / cols are negative or differ in length")
    changes, slot_at, point_at = [], 0, 0
    for i, (code, row, start, count) in enumerate(t["change_heads"].tolist()):
        if not 0 <= code < len(CHANGE_KINDS) or min(row, start, count) < 0:
            raise StepMessageError(f"table_changes[{i}]: kind code {code}, row {row}, start {start}, count {count} is no change")
        kind = CHANGE_KINDS[code]
        if kind == "span":
            changes.append((kind, row, start, slots[slot_at : slot_at + count]))
        elif kind == "points" and row == start == 0:
            points = slice(point_at, point_at + count)
            changes.append((kind, rows[points], cols[points], slots[slot_at : slot_at + count]))
            point_at += count
        elif kind == "clear" and start == count == 0:
            changes.append((kind, row))
            continue
        else:
            raise StepMessageError(f"table_changes[{i}]: a {kind} change with row {row}, start {start}, count {count}")
        slot_at += count
    if slot_at != slots.shape[0] or point_at != len(rows):
        raise StepMessageError(
            f"table changes use {slot_at} slots and {point_at} points, the message holds {slots.shape[0]} and {len(rows)}"
        )
    return tuple(changes)
