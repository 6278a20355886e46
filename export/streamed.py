"""A source model whose weights stay on disk until a forward or the graph builder reads them.

``load_streamed(folder)`` builds the transformers model with every parameter on the ``meta``
device (buffers such as rotary frequencies are computed as usual, on the CPU), and reads
each parameter from the safetensors files only while the module that owns it runs: a
forward pre-hook puts the module's parameters in place (float32, as the in-memory loader
converts them), a forward hook puts the ``meta`` placeholders back. A forward therefore holds
one module's weights at a time (the embedding or the output layer is the largest), and its
logits equal the in-memory model's bit for bit: the same float32 values, the same modules.

``StreamedStateDict`` is the ``model.state_dict()`` the family builders (export/families/)
read: each item is read from disk when asked for, so a builder that keeps reads lazy
(``Lazy``) never holds the model either.

Only what the checkpoint spells as the model does is streamed; a folder whose parameter names,
dtypes or files do not map one to one (pickles, renamed keys, quantized storage), or whose files
are damaged, returns None, and the caller loads the model whole (and reports the damage as before).
"""

from __future__ import annotations

import contextlib
import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping

import numpy as np

from ..errors import ExportError

# Safetensors dtype -> (numpy storage dtype, bytes per element). bf16 is stored as uint16 and
# widened by a shift (its bits are the high half of a float32).
_DTYPES = {"F32": (np.dtype("<f4"), 4), "F16": (np.dtype("<f2"), 2), "BF16": (np.dtype("<u2"), 2)}
# Elements converted per read: a fp16 tensor is widened chunk by chunk into its float32 array,
# so reading a tensor holds its float32 copy plus at most this many source elements (32 MiB of fp16),
# not a second whole copy.
_CHUNK_ELEMENTS = 1 << 24


@dataclass(frozen=True)
class TensorRecord:
    """Where one tensor lives: ``file`` bytes ``start .. start + n_bytes``, ``dtype`` (safetensors name), ``shape``."""

    file: Path
    start: int
    n_bytes: int
    dtype: str
    shape: tuple[int, ...]


def read_safetensors_index(folder: Path) -> dict[str, TensorRecord] | None:
    """Every tensor of the folder's ``*.safetensors`` files by name, or None when one has a dtype
    this reader does not widen (int8, fp8, ...) or a name appears twice. Headers only are read."""
    records: dict[str, TensorRecord] = {}
    for path in sorted(folder.glob("*.safetensors")):
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise ExportError(f"{path} is not a safetensors file (shorter than its 8-byte header length)")
            (header_len,) = struct.unpack("<Q", raw)
            # A header is JSON metadata; 100 MB is far above any real one and stops a corrupt length
            # from asking for the file's whole size.
            if header_len > 100_000_000:
                raise ExportError(f"{path}: safetensors header length {header_len} is not plausible")
            try:
                header = json.loads(f.read(header_len))
            except ValueError as exc:
                raise ExportError(f"{path}: the safetensors header is not JSON ({exc})") from None
        base = 8 + header_len
        size = path.stat().st_size
        for name, info in header.items():
            if name == "__metadata__":
                continue
            if info["dtype"] not in _DTYPES or name in records:
                return None
            begin, end = info["data_offsets"]
            shape = tuple(int(d) for d in info["shape"])
            if end - begin != int(np.prod(shape, dtype=np.int64)) * _DTYPES[info["dtype"]][1] or base + end > size:
                raise ExportError(f"{path}: tensor {name} ({info['dtype']} {list(shape)}) does not fit its "
                                  f"byte range {begin}..{end} in a {size}-byte file")
            records[name] = TensorRecord(path, base + begin, end - begin, info["dtype"], shape)
    return records


def read_float32(record: TensorRecord) -> np.ndarray:
    """The tensor as a new float32 array of ``record.shape`` (widened in chunks, never memory-mapped,
    so the file's pages do not count in this process's resident set)."""
    storage, width = _DTYPES[record.dtype]
    count = record.n_bytes // width
    out = np.empty(count, np.float32)
    with open(record.file, "rb") as f:
        f.seek(record.start)
        for begin in range(0, count, _CHUNK_ELEMENTS):
            n = min(_CHUNK_ELEMENTS, count - begin)
            chunk = np.fromfile(f, storage, n)
            if len(chunk) != n:
                raise ExportError(f"{record.file} ends inside a tensor (read {len(chunk)} of {n} elements)")
            if record.dtype == "BF16":
                out[begin:begin + n] = (chunk.astype(np.uint32) << 16).view(np.float32)
            else:
                out[begin:begin + n] = chunk
    return out.reshape(record.shape)


class StreamedStateDict(Mapping):
    """``model.state_dict()`` of a streamed model: parameter name -> float32 torch tensor read on access
    (a new tensor per read, not kept); buffers as the model holds them."""

    def __init__(self, sources: Mapping[str, TensorRecord], buffers: Mapping[str, Any]) -> None:
        self._sources = dict(sources)
        self._buffers = dict(buffers)

    def __getitem__(self, key: str) -> Any:
        import torch

        if key in self._sources:
            return torch.from_numpy(read_float32(self._sources[key]))
        return self._buffers[key]

    def __contains__(self, key: object) -> bool:
        # Mapping's own __contains__ calls __getitem__, which would read (and widen) the whole tensor
        # from disk to answer ``"lm_head.weight" in state_dict``.
        return key in self._sources or key in self._buffers

    def __iter__(self) -> Iterator[str]:
        yield from self._sources
        yield from (k for k in self._buffers if k not in self._sources)

    def __len__(self) -> int:
        return len(self._sources) + sum(1 for k in self._buffers if k not in self._sources)


class StreamedModel:
    """The parts of a transformers model the exporter uses, with weights read per module on demand.

    Calling it runs the model's forward; ``config``, ``generation_config``, ``base_model`` and any
    other attribute are the model's own. ``state_dict()`` is a :class:`StreamedStateDict`.
    """

    def __init__(self, model: Any, sources: Mapping[str, TensorRecord]) -> None:
        self._model = model
        self._sources = dict(sources)

    def __call__(self, *args, **kwargs):
        return self._model(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)

    def state_dict(self) -> StreamedStateDict:
        # The model's own state_dict() holds the meta placeholders for parameters: only its buffers are kept.
        return StreamedStateDict(self._sources, {k: v for k, v in self._model.state_dict().items()
                                                 if k not in self._sources})


@contextlib.contextmanager
def _parameters_on_meta():
    """Every ``nn.Module`` parameter registered inside goes to the ``meta`` device (no storage);
    buffers stay where they are made. Each parameter's CPU storage exists only while its module's
    constructor creates it (one tensor at a time)."""
    import torch

    register = torch.nn.Module.register_parameter

    def on_meta(module, name, param):
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            module._parameters[name] = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    torch.nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register


def _parameter_sources(model: Any, records: Mapping[str, TensorRecord]) -> dict[str, TensorRecord] | None:
    """Each parameter name (tied ones included) -> the checkpoint tensor it loads, or None when one
    has no tensor of its shape in the checkpoint."""
    named = list(model.named_parameters(remove_duplicate=False))
    prefix = getattr(model, "base_model_prefix", "") + "."
    by_object: dict[int, TensorRecord] = {}
    for name, param in named:  # a name the checkpoint has, or has without the base model's prefix
        record = records.get(name) or (records.get(name[len(prefix):]) if name.startswith(prefix) else None)
        if record is not None and record.shape == tuple(param.shape):
            by_object.setdefault(id(param), record)
    sources = {}
    for name, param in named:  # a tied output layer reads the embedding's tensor
        if id(param) not in by_object:
            return None
        sources[name] = by_object[id(param)]
    return sources


def _install_hooks(model: Any, sources: Mapping[str, TensorRecord]) -> None:
    """Pre-hook: the module's own parameters read from disk; hook: the meta placeholders back."""
    import torch

    for module_name, module in model.named_modules(remove_duplicate=False):
        own = [n for n, p in module._parameters.items() if p is not None]
        if not own:
            continue
        prefix = f"{module_name}." if module_name else ""
        keys = {n: sources[prefix + n] for n in own}

        def load(mod, _args, keys=keys):
            mod._streamed_placeholders = {n: mod._parameters[n] for n in keys}
            for n, record in keys.items():
                mod._parameters[n] = torch.nn.Parameter(torch.from_numpy(read_float32(record)), requires_grad=False)

        def unload(mod, _args, _output):
            mod._parameters.update(mod._streamed_placeholders)
            del mod._streamed_placeholders

        module.register_forward_pre_hook(load)
        # always_call: a forward that raises still puts the placeholders back (else the real weights would
        # stay resident, and the next pre-hook would keep them as the "placeholders").
        module.register_forward_hook(unload, always_call=True)


def load_streamed(folder: Path) -> StreamedModel | None:
    """The model of HF folder ``folder`` with its weights left in its safetensors files, or None
    when they cannot be streamed (see the module docstring). Raises what transformers raises for a
    config it cannot build."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    try:
        records = read_safetensors_index(folder)
    except ExportError:  # a damaged file: the whole-model loader refuses it with transformers' own reason
        return None
    if not records:
        return None
    config = AutoConfig.from_pretrained(str(folder), trust_remote_code=False)
    if getattr(config, "quantization_config", None) is not None:
        return None  # the family builders refuse it by name on the whole-model path
    with _parameters_on_meta():
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, trust_remote_code=False)
    sources = _parameter_sources(model, records)
    if sources is None:
        return None
    with contextlib.suppress(OSError, ValueError):  # no generation_config.json: the config's own ids
        model.generation_config = GenerationConfig.from_pretrained(str(folder))
    model.eval()
    _install_hooks(model, sources)
    return StreamedModel(model, sources)
