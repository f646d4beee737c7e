"""graphexec's GGUF parser against gguf's own GGUFReader, and against damaged and hostile files."""

import struct

import gguf
import numpy as np
import pytest

from graphexec.errors import CheckpointError
from graphexec.loader.gguf_file import read_gguf

Q = gguf.GGMLQuantizationType


def _write(path, alignment=None):
    writer = gguf.GGUFWriter(path, "llama")
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    writer.add_uint8("t.u8", 200)
    writer.add_int8("t.i8", -5)
    writer.add_uint16("t.u16", 60000)
    writer.add_int16("t.i16", -30000)
    writer.add_uint32("t.u32", 4_000_000_000)
    writer.add_int32("t.i32", -2_000_000_000)
    writer.add_float32("t.f32", 1e-5)
    writer.add_uint64("t.u64", 2**63 + 7)
    writer.add_int64("t.i64", -(2**62))
    writer.add_float64("t.f64", 0.1)
    writer.add_bool("t.bool", True)
    writer.add_string("t.str", "héllo ✓")
    writer.add_array("t.strings", ["", "a b", "Ġtoken", "日本"])
    writer.add_array("t.ints", [1, -2, 3])
    writer.add_array("t.floats", [0.5, -1.25])
    writer.add_array("t.bools", [True, False])
    rng = np.random.default_rng(0)
    values = rng.standard_normal((4, 64)).astype(np.float32)
    writer.add_tensor("dense.f32", values)
    writer.add_tensor("dense.f16", values.astype(np.float16))
    writer.add_tensor("vector", values[0])
    for qtype in (Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.BF16):
        writer.add_tensor(f"packed.{qtype.name}", gguf.quants.quantize(values, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("alignment", [None, 64])
def test_same_metadata_and_tensors_as_gguf_reader(tmp_path, alignment):
    path = _write(tmp_path / "all.gguf", alignment)
    ours, theirs = read_gguf(path), gguf.GGUFReader(path)
    expected = {k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    assert ours.metadata == expected
    assert {k: type(v) for k, v in ours.metadata.items()} == {k: type(v) for k, v in expected.items()}
    assert ours.metadata["t.u64"] == 2**63 + 7 and ours.metadata["t.strings"][3] == "日本"
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for mine, ref in zip(ours.tensors, theirs.tensors):
        assert mine.qtype == ref.tensor_type
        assert mine.shape == tuple(reversed(ref.shape.tolist()))
        assert mine.data.dtype == ref.data.dtype and mine.data.shape == ref.data.shape
        assert np.array_equal(mine.data, np.asarray(ref.data)), mine.name
        assert not mine.data.flags.writeable
    # The typed and packed views both dequantize through gguf's own routine.
    q8 = next(t for t in ours.tensors if t.name == "packed.Q8_0")
    assert gguf.quants.dequantize(q8.data, q8.qtype).shape == (4, 64)


def test_every_truncation_is_a_checkpoint_error(tmp_path):
    whole = _write(tmp_path / "all.gguf").read_bytes()
    cut = tmp_path / "cut.gguf"
    # Every prefix through the metadata and tensor table, then a few inside the tensor data.
    header_end = len(whole) - 4 * 64 * (4 + 2 + 1) - 200
    for length in [*range(0, header_end, 7), len(whole) - 1, len(whole) - 100]:
        cut.write_bytes(whole[:length])
        with pytest.raises(CheckpointError, match="cut.gguf"):
            read_gguf(cut)


def _header(kv: bytes, n_kv: int = 1, version: int = 3, n_tensors: int = 0) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", version, n_tensors, n_kv) + kv


def _key(name: str) -> bytes:
    return struct.pack("<Q", len(name)) + name.encode()


@pytest.mark.parametrize("data, message", [
    (b"GGML" + bytes(20), "magic"),
    (_header(b"", 0, version=7), "version 7"),
    (b"GGUF" + struct.pack(">IQQ", 3, 0, 0), "big-endian"),
    # An array claiming 2**60 strings, or a string claiming 2**62 bytes, in a tiny file.
    (_header(_key("k") + struct.pack("<IIQ", 9, 8, 2**60)), "past the end"),
    (_header(_key("k") + struct.pack("<IQ", 8, 2**62)), "past the end"),
    (_header(_key("k") + struct.pack("<IIQ", 9, 12, 2**61)), "past the end"),
    (_header(_key("k") + struct.pack("<I", 77) + bytes(8)), "unknown value type 77"),
    (_header(_key("general.alignment") + struct.pack("<II", 4, 48)), "power of two"),
    (_header(_key("k") + struct.pack("<IQ", 8, 2) + b"\xff\xfe"), "UTF-8"),
])
def test_damaged_or_hostile_headers(tmp_path, data, message):
    path = tmp_path / "bad.gguf"
    path.write_bytes(data)
    with pytest.raises(CheckpointError, match=message):
        read_gguf(path)


def _tensor_info(name: str, dims: tuple[int, ...], type_id: int, offset: int) -> bytes:
    return _key(name) + struct.pack("<I", len(dims)) + struct.pack(f"<{len(dims)}Q", *dims) + struct.pack("<IQ", type_id, offset)


@pytest.mark.parametrize("infos, message", [
    ([("w", (32,), 0, 0), ("w", (32,), 0, 128)], "appears twice"),
    ([("w", (32,), 99, 0)], "unknown type 99"),
    ([("w", (33, 2), 2, 0)], "not whole Q4_0 blocks"),
    ([("w", (32, 2**40), 0, 0)], "past the end"),
    ([("w", (), 0, 0)], "0 dimensions"),
])
def test_damaged_tensor_tables(tmp_path, infos, message):
    table = b"".join(_tensor_info(*info) for info in infos)
    path = tmp_path / "bad.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, len(infos), 0) + table + bytes(512))
    with pytest.raises(CheckpointError, match=message):
        read_gguf(path)


def test_empty_and_missing_files(tmp_path):
    (tmp_path / "empty.gguf").write_bytes(b"")
    with pytest.raises(CheckpointError, match="empty.gguf"):
        read_gguf(tmp_path / "empty.gguf")
    with pytest.raises(CheckpointError, match="not found"):
        read_gguf(tmp_path / "absent.gguf")
