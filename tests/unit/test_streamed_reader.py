"""The safetensors reader a streamed export source uses (export/streamed.py), torch-free.

- Each tensor comes back as float32 equal to its stored values widened (F32 as is, F16 by numpy's
  conversion, BF16 as the high half of a float32), also when read in several chunks.
- A header or byte range that does not fit the file is an ExportError naming the file and tensor,
  and a dtype the reader does not widen makes the folder unstreamable (None), not an error.
"""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest

from specedge.errors import ExportError
from specedge.export import streamed
from specedge.export.streamed import read_float32, read_safetensors_index


def _write(path, tensors: dict[str, tuple[str, np.ndarray]], *, truncate: int = 0) -> None:
    """A safetensors file: name -> (dtype name, array holding the stored bits)."""
    header, blobs, offset = {}, [], 0
    for name, (dtype, array) in tensors.items():
        raw = np.ascontiguousarray(array).tobytes()
        header[name] = {"dtype": dtype, "shape": list(array.shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    head = json.dumps(header).encode()
    body = b"".join(blobs)
    path.write_bytes(struct.pack("<Q", len(head)) + head + body[:len(body) - truncate])


def _bf16_bits(values: np.ndarray) -> np.ndarray:
    return (values.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)


def test_each_dtype_is_widened_to_the_stored_values(tmp_path):
    rng = np.random.default_rng(0)
    f32 = rng.standard_normal((3, 5)).astype(np.float32)
    f16 = rng.standard_normal((4, 7)).astype(np.float16)
    bf16 = _bf16_bits(rng.standard_normal((2, 9)))
    _write(tmp_path / "model.safetensors", {"a": ("F32", f32), "b": ("F16", f16), "c": ("BF16", bf16)})
    index = read_safetensors_index(tmp_path)
    assert sorted(index) == ["a", "b", "c"] and index["b"].shape == (4, 7)
    assert np.array_equal(read_float32(index["a"]), f32)
    assert np.array_equal(read_float32(index["b"]), f16.astype(np.float32))
    expected = (bf16.astype(np.uint32) << 16).view(np.float32)
    got = read_float32(index["c"])
    assert got.dtype == np.float32 and np.array_equal(got, expected)


def test_a_tensor_read_in_chunks_is_the_same(tmp_path, monkeypatch):
    values = np.arange(1000, dtype=np.float16).reshape(10, 100)
    _write(tmp_path / "model.safetensors", {"w": ("F16", values)})
    monkeypatch.setattr(streamed, "_CHUNK_ELEMENTS", 64)  # 16 chunks, the last one short
    assert np.array_equal(read_float32(read_safetensors_index(tmp_path)["w"]), values.astype(np.float32))


def test_tensors_of_every_file_in_the_folder_are_indexed(tmp_path):
    _write(tmp_path / "model-00001-of-00002.safetensors", {"x": ("F32", np.ones(3, np.float32))})
    _write(tmp_path / "model-00002-of-00002.safetensors", {"y": ("F32", np.zeros(2, np.float32))})
    index = read_safetensors_index(tmp_path)
    assert index["x"].file.name.startswith("model-00001") and index["y"].file.name.startswith("model-00002")
    assert np.array_equal(read_float32(index["y"]), np.zeros(2, np.float32))


def test_a_truncated_file_is_refused_by_name(tmp_path):
    _write(tmp_path / "model.safetensors", {"w": ("F32", np.ones((4, 4), np.float32))}, truncate=8)
    with pytest.raises(ExportError, match="model.safetensors: tensor w"):
        read_safetensors_index(tmp_path)


def test_a_header_that_is_not_json_is_refused(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", 5) + b"{oops")
    with pytest.raises(ExportError, match="not JSON"):
        read_safetensors_index(tmp_path)


def test_a_dtype_it_does_not_widen_means_not_streamable(tmp_path):
    _write(tmp_path / "model.safetensors", {"q": ("I8", np.ones(4, np.int8)), "w": ("F32", np.ones(4, np.float32))})
    assert read_safetensors_index(tmp_path) is None


def test_membership_reads_nothing_from_disk(tmp_path, monkeypatch):
    """``"lm_head.weight" in state_dict`` (the family builders ask it of every optional weight) answers
    from the index: reading the tensor to answer would cost the whole head's I/O on an 8B model."""
    _write(tmp_path / "model.safetensors", {"embed.weight": ("F32", np.ones((4, 2), np.float32))})
    records = read_safetensors_index(tmp_path)

    def no_reads(*_args, **_kw):
        raise AssertionError("a membership test read a tensor")

    monkeypatch.setattr(streamed, "read_float32", no_reads)
    state = streamed.StreamedStateDict(records, {"rotary.inv_freq": object()})
    assert "embed.weight" in state and "rotary.inv_freq" in state
    assert "lm_head.weight" not in state and 1 not in state
