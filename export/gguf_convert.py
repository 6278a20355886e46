"""A GGUF file as a Hugging Face safetensors folder, one tensor at a time.

``AutoModelForCausalLM.from_pretrained(gguf_file=...)`` dequantizes every tensor into one dict
before it builds the model, then ``save_pretrained`` serialises it: peak memory is about twice the
model in float32 (3.9 GB for a 0.5B model, some 64 GB for an 8B one). This module writes the same
folder with memory bounded by one tensor plus one shard:

* the config and tokenizer come from transformers' own GGUF metadata readers (no tensor is read);
* each tensor is read from the file (not memory-mapped: mapped pages would count in the resident
  set), dequantized ``_DEQUANT_ROWS`` rows at a time by the ``gguf`` package, passed through the
  same transformers tensor processor ``from_pretrained`` uses (llama's q/k row order, Gemma's norm
  offset, ...), renamed by the same GGUF -> HF map, and appended to the current shard;
* shards of up to ``SHARD_BYTES`` are written by hand in the safetensors layout (a JSON header,
  then each array's bytes straight from numpy, no serialised copy), with the index file
  transformers reads for sharded folders.

Only dense families stream: a processor that gathers tensors across calls (mixture-of-experts
merges) leaves its results in transformers' ``parsed_parameters`` instead of returning them, and
such a file is converted by transformers whole (:class:`NotStreamable`).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Callable

import numpy as np

from .gguf_import import GgufTensors

# A shard is written once it holds this many bytes; memory then holds at most one shard's arrays plus
# the tensor being converted (a tensor larger than this gets a shard of its own).
SHARD_BYTES = 512 << 20
# Rows dequantized at once: the gguf package's numpy dequantizers make several float32 temporaries of
# their input, so a whole 128,256 x 4,096 embedding would need about 8 GB of them; 8192 rows of it, 0.5 GB.
_DEQUANT_ROWS = 8192
_SAFETENSORS_DTYPES = {np.dtype(np.float32): "F32", np.dtype(np.float16): "F16"}


class NotStreamable(Exception):
    """The file's architecture needs transformers' whole-model conversion (reason in the message)."""


def _dequantized(tensors, name: str) -> np.ndarray:
    """float32 values of GGUF tensor ``name`` of ``tensors`` (export/gguf_import.py GgufTensors), shaped
    as ``gguf.dequantize(tensor.data, ...)`` returns them, ``_DEQUANT_ROWS`` rows at a time."""
    from gguf import dequantize

    raw, kind = tensors.raw(name), tensors.tensors[name].tensor_type
    if raw.ndim < 2 or raw.shape[0] <= _DEQUANT_ROWS:
        return np.asarray(dequantize(raw, kind), np.float32)
    out = None
    for start in range(0, raw.shape[0], _DEQUANT_ROWS):
        part = dequantize(raw[start:start + _DEQUANT_ROWS], kind)
        if out is None:
            out = np.empty((raw.shape[0], *part.shape[1:]), np.float32)
        out[start:start + len(part)] = part
    return out


class _ShardWriter:
    """Writes named arrays into ``model-XXXXX.safetensors`` shards and the index that lists them."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.pending: list[tuple[str, np.ndarray]] = []
        self.pending_bytes = 0
        self.shards: list[tuple[str, list[str]]] = []
        self.total = 0

    def add(self, name: str, array: np.ndarray) -> None:
        array = np.ascontiguousarray(array)
        if array.dtype not in _SAFETENSORS_DTYPES:
            array = array.astype(np.float32)
        if self.pending and self.pending_bytes + array.nbytes > SHARD_BYTES:
            self.flush()
        self.pending.append((name, array))
        self.pending_bytes += array.nbytes

    def flush(self) -> None:
        if not self.pending:
            return
        file = f"model-{len(self.shards) + 1:05d}.safetensors"
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        for name, array in self.pending:
            header[name] = {"dtype": _SAFETENSORS_DTYPES[array.dtype], "shape": list(array.shape),
                            "data_offsets": [offset, offset + array.nbytes]}
            offset += array.nbytes
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * ((-len(encoded)) % 8)  # the data starts 8-byte aligned, as safetensors writes it
        with open(self.folder / file, "wb") as f:
            f.write(struct.pack("<Q", len(encoded)))
            f.write(encoded)
            for _, array in self.pending:
                array.tofile(f)
        self.shards.append((file, [name for name, _ in self.pending]))
        self.total += offset
        self.pending, self.pending_bytes = [], 0

    def close(self) -> None:
        """Write the last shard and the index (``model.safetensors.index.json``)."""
        self.flush()
        weight_map = {name: file for file, names in self.shards for name in names}
        index = {"metadata": {"total_size": self.total}, "weight_map": dict(sorted(weight_map.items()))}
        (self.folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def convert_gguf(path: Path, folder: Path, *, progress: Callable[[int, int], None] = lambda done, total: None) -> None:
    """Write ``path`` (a GGUF file) into the empty ``folder`` as an HF float32 safetensors folder with its
    config, generation config and tokenizer; ``progress(done, total)`` before the first tensor and after
    each. Raises NotStreamable for a family transformers must convert whole, or what transformers raises
    for a file it cannot read."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from transformers.modeling_gguf_pytorch_utils import (TENSOR_PROCESSORS, TensorProcessor,
                                                          get_gguf_hf_weights_map, load_gguf_checkpoint)

    config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name, trust_remote_code=False)
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the folder holds float32 weights
    config.dtype = torch.float32
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, trust_remote_code=False)
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, trust_remote_code=False)
    parsed = load_gguf_checkpoint(str(path), return_tensors=False)
    tensors = GgufTensors(path)
    processor = TENSOR_PROCESSORS.get(tensors.arch, TensorProcessor)(config=parsed["config"])
    mapping = get_gguf_hf_weights_map(model, processor)
    parsed["tensors"] = {}
    writer = _ShardWriter(folder)
    total = len(tensors.tensors)
    progress(0, total)  # the tensors start now (reading the metadata and building the meta model came first)
    for done, name in enumerate(tensors.tensors, 1):
        result = processor.process(weights=_dequantized(tensors, name), name=name,
                                   tensor_key_mapping=mapping, parsed_parameters=parsed)
        if parsed["tensors"]:
            raise NotStreamable(f"transformers' {type(processor).__name__} merges tensors across the file")
        if result.weights is not None and result.name in mapping:
            writer.add(mapping[result.name], result.weights)
        del result
        progress(done, total)
    writer.close()
    config.architectures = [type(model).__name__]  # as save_pretrained records it
    config.save_pretrained(str(folder))
    if model.can_generate():
        GenerationConfig.from_model_config(config).save_pretrained(str(folder))
    tokenizer.save_pretrained(str(folder))
