"""The export-measuring tools: a fixture checkpoint has its shape's tensors and tokenizer width, is
written under a temporary name, and the progress parser splits an export's stderr into phases.

No torch: the fixture is read back as raw safetensors bytes.
"""

from __future__ import annotations

import json
import struct
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from specedge.errors import InvalidParameterError
from specedge.export.fixture import SHAPES, write_fixture
from specedge.export.measure import folder_bytes, parse_progress


def _header(path: Path) -> tuple[dict, int]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), 8 + n


def test_fixture_has_the_shapes_tensors_config_and_a_tokenizer_as_wide_as_its_vocab(tmp_path):
    # The 1B's layout at a width that writes in milliseconds.
    shape = replace(SHAPES["llama-3.2-1b"], hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, vocab_size=300, extra={})
    out = write_fixture(shape, tmp_path / "m")
    header, start = _header(out / "model.safetensors")
    header.pop("__metadata__")
    names = [n for n, _ in shape.tensors()]
    assert sorted(header) == sorted(names) and len(names) == 2 + 9 * shape.num_hidden_layers  # tied: no lm_head
    assert header["model.embed_tokens.weight"]["shape"] == [300, 128]
    assert header["model.layers.0.self_attn.k_proj.weight"]["shape"] == [2 * 32, 128]
    end = max(v["data_offsets"][1] for v in header.values())
    assert (out / "model.safetensors").stat().st_size == start + end
    config = json.loads((out / "config.json").read_text())
    assert (config["vocab_size"], config["num_hidden_layers"], config["tie_word_embeddings"]) == (300, 2, True)
    vocab = json.loads((out / "tokenizer.json").read_text())["model"]["vocab"]
    assert sorted(vocab.values()) == list(range(300))
    # Weights are seeded noise of std 0.02; norms are ones.
    entry = header["model.layers.0.mlp.down_proj.weight"]
    a, b = entry["data_offsets"]
    w = np.frombuffer((out / "model.safetensors").read_bytes()[start + a:start + b], np.float16)
    assert abs(float(w.astype(np.float32).std()) - 0.02) < 1e-3
    a, b = header["model.norm.weight"]["data_offsets"]
    assert (np.frombuffer((out / "model.safetensors").read_bytes()[start + a:start + b], np.float16) == 1).all()
    assert [p.name for p in tmp_path.iterdir()] == ["m"]  # no partial folder left


def test_fixture_refuses_an_existing_folder_and_an_unknown_shape(tmp_path):
    (tmp_path / "m").mkdir()
    with pytest.raises(InvalidParameterError, match="already exists"):
        write_fixture("llama-3.2-1b", tmp_path / "m")
    with pytest.raises(InvalidParameterError, match="unknown shape"):
        write_fixture("llama-9b", tmp_path / "n")


def test_shapes_carry_the_released_models_sizes():
    assert round(SHAPES["llama-3.2-1b"].parameters / 1e9, 2) == 1.24
    assert round(SHAPES["llama-3.2-3b"].parameters / 1e9, 2) == 3.21
    assert round(SHAPES["llama-3.1-8b"].parameters / 1e9, 2) == 8.03
    assert round(SHAPES["qwen2.5-7b"].parameters / 1e9, 2) == 7.62


def test_progress_lines_start_stages_and_steps_and_nothing_else_does():
    assert parse_progress("[2/4] building + validating target graph (int4)  (t=30s)\n") == \
        "[2/4] building + validating target graph (int4)"
    assert parse_progress("      target: quantizing to int4 (block 32)  (t=95s)\n") == \
        "  target: quantizing to int4 (block 32)"
    assert parse_progress("[specedge export] loading l1b\n") is None
    assert parse_progress("Loading weights:  22%|##  | 32/146\n") is None


def test_folder_bytes_counts_files_and_a_missing_folder_is_empty(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "x").write_bytes(b"12345")
    (tmp_path / "y").write_bytes(b"123")
    assert folder_bytes(tmp_path) == 8
    assert folder_bytes(tmp_path / "missing") == 0
