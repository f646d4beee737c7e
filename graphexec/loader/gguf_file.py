"""Parse a GGUF file's header, metadata and tensor table, and map its tensor data: nothing more.

The boundary of this room is the file format.  `loader/gguf.py` decides what the tensors mean;
here they are names, shapes, types and read-only views of the memory-mapped file.

Why not gguf's `GGUFReader`: it builds a numpy view per part of every metadata field (each string
of a 49k-token vocabulary is two of them), 4.4 s of SmolLM2's 5.3 s load on a 2-core Xeon
(`graphexec-bench loader`).  Here a string array is one pass of `struct.unpack_from` and a numeric
array one `np.frombuffer`.  Everything is bounds-checked against the file's size before it is read
or allocated, so a truncated or hostile file is a CheckpointError, never a huge allocation.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from graphexec.errors import CheckpointError

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

# GGUF metadata value types (the spec's gguf_metadata_value_type) and their fixed-size layouts.
_STRING, _ARRAY = 8, 9
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_NUMPY = {0: "u1", 1: "i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8", 12: "<f8"}
# Tensor types whose data is handed out typed; every other one as bytes per row (as gguf's reader does,
# so gguf.quants.dequantize takes either).
_TYPED_TENSORS = {
    GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # torch order: outermost dimension first (GGUF stores innermost first)
    qtype: GGMLQuantizationType
    data: np.ndarray  # a read-only view of the file: typed for dense types, else [..., bytes per row] uint8


@dataclass(frozen=True)
class GGUFFile:
    path: Path
    version: int
    metadata: dict[str, Any]  # key -> int / float / bool / str / list (as ReaderField.contents() gives)
    tensors: tuple[GGUFTensor, ...]


class _Cursor:
    """Little-endian reads from the mapped bytes, each checked against their end."""

    def __init__(self, buffer: mmap.mmap | bytes, path: Path):
        self.buffer, self.path, self.offset, self.size = buffer, path, 0, len(buffer)

    def fail(self, what: str) -> CheckpointError:
        return CheckpointError(f"{self.path}: not a readable GGUF file: {what} (at byte {self.offset} of {self.size})")

    def need(self, nbytes: int, what: str) -> None:
        if nbytes < 0 or self.offset + nbytes > self.size:
            raise self.fail(f"{what} runs past the end of the file (truncated?)")

    def scalar(self, fmt: str, what: str) -> Any:
        size = struct.calcsize("<" + fmt)
        self.need(size, what)
        (value,) = struct.unpack_from("<" + fmt, self.buffer, self.offset)
        self.offset += size
        return value

    def string(self, what: str) -> str:
        length = self.scalar("Q", what)
        self.need(length, what)
        raw = self.buffer[self.offset : self.offset + length]
        self.offset += length
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as error:
            raise self.fail(f"{what} is not UTF-8 ({error})") from None

    def value(self, kind: int, what: str) -> Any:
        if kind in _SCALARS:
            return self.scalar(_SCALARS[kind], what)
        if kind == _STRING:
            return self.string(what)
        if kind == _ARRAY:
            return self.array(what)
        raise self.fail(f"{what} has unknown value type {kind}")

    def array(self, what: str) -> list:
        kind, count = self.scalar("I", what), self.scalar("Q", what)
        if kind in _NUMPY:
            dtype = np.dtype(_NUMPY[kind])
            self.need(count * dtype.itemsize, what)
            values = np.frombuffer(self.buffer, dtype, count, self.offset)
            self.offset += count * dtype.itemsize
            return values.tolist()
        # Each string or nested array takes at least 8 bytes: a count past that cannot be real.
        self.need(count * 8, what)
        if kind == _STRING:
            return self._strings(count, what)
        return [self.value(kind, what) for _ in range(count)]

    def _strings(self, count: int, what: str) -> list[str]:
        buffer, offset, size, out = self.buffer, self.offset, self.size, []
        unpack = struct.Struct("<Q").unpack_from
        for _ in range(count):
            if offset + 8 > size:
                break
            (length,) = unpack(buffer, offset)
            end = offset + 8 + length
            if end > size:
                break
            out.append(buffer[offset + 8 : end].decode("utf-8", errors="strict"))
            offset = end
        self.offset = offset
        if len(out) < count:
            raise self.fail(f"{what} runs past the end of the file (truncated?)")
        return out


def read_gguf(path: str | Path) -> GGUFFile:
    """Parse `path`; tensor data stays in the file (read-only views of one memory map)."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"GGUF file not found: {path}")
    try:
        with path.open("rb") as handle:
            buffer = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
    except (OSError, ValueError) as error:  # an empty file cannot be mapped (ValueError)
        raise CheckpointError(f"cannot read GGUF file {path}: {error}") from error
    cursor = _Cursor(buffer, path)
    try:
        return _parse(cursor, buffer)
    except UnicodeDecodeError as error:
        raise cursor.fail(f"a string is not UTF-8 ({error})") from None


def _parse(cursor: _Cursor, buffer: mmap.mmap) -> GGUFFile:
    cursor.need(4, "the magic")
    if buffer[:4] != MAGIC:
        raise cursor.fail(f"magic is {bytes(buffer[:4])!r}, not {MAGIC!r}")
    cursor.offset = 4
    version = cursor.scalar("I", "the version")
    if version not in VERSIONS:
        if version & 0xFFFF == 0:
            raise cursor.fail("big-endian GGUF files are not supported")
        raise cursor.fail(f"version {version} is not one of {VERSIONS}")
    tensor_count, kv_count = cursor.scalar("Q", "the tensor count"), cursor.scalar("Q", "the key count")
    metadata: dict[str, Any] = {}
    for index in range(kv_count):
        key = cursor.string(f"metadata key {index}")
        metadata[key] = cursor.value(cursor.scalar("I", key), key)
    infos = [_tensor_info(cursor, index) for index in range(tensor_count)]
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise cursor.fail(f"general.alignment {alignment!r} is not a power of two")
    data_start = -(-cursor.offset // alignment) * alignment
    names: set[str] = set()
    tensors = []
    for name, dims, qtype, offset in infos:
        if name in names:
            raise cursor.fail(f"tensor {name!r} appears twice")
        names.add(name)
        tensors.append(_tensor(cursor, buffer, name, dims, qtype, data_start + offset))
    return GGUFFile(cursor.path, version, metadata, tuple(tensors))


def _tensor_info(cursor: _Cursor, index: int) -> tuple[str, tuple[int, ...], int, int]:
    name = cursor.string(f"tensor {index}'s name")
    n_dims = cursor.scalar("I", name)
    if not 1 <= n_dims <= 4:
        raise cursor.fail(f"tensor {name!r} has {n_dims} dimensions (GGUF allows 1-4)")
    dims = tuple(cursor.scalar("Q", name) for _ in range(n_dims))
    return name, dims, cursor.scalar("I", name), cursor.scalar("Q", name)


def _tensor(cursor: _Cursor, buffer: mmap.mmap, name: str, dims: tuple[int, ...], type_id: int,
            start: int) -> GGUFTensor:
    try:
        qtype = GGMLQuantizationType(type_id)
        block, block_bytes = GGML_QUANT_SIZES[qtype]
    except (ValueError, KeyError):
        raise cursor.fail(f"tensor {name!r} has unknown type {type_id}") from None
    if dims[0] % block:
        raise cursor.fail(f"tensor {name!r}'s rows ({dims[0]}) are not whole {qtype.name} blocks of {block}")
    shape = tuple(reversed(dims))
    elements = int(np.prod(dims, dtype=object))
    nbytes = elements // block * block_bytes
    if start + nbytes > cursor.size:
        raise cursor.fail(f"tensor {name!r} ({nbytes} bytes at {start}) runs past the end of the file (truncated?)")
    dtype = _TYPED_TENSORS.get(qtype)
    if dtype is not None:
        data = np.frombuffer(buffer, dtype, elements, start).reshape(shape)
    else:
        byte_shape = (*shape[:-1], shape[-1] // block * block_bytes)
        data = np.frombuffer(buffer, np.uint8, nbytes, start).reshape(byte_shape)
    return GGUFTensor(name, shape, qtype, data)
