"""Load a source model for export: a local HF folder (safetensors), a GGUF file, or a catalog name.

Pickle-based checkpoints (.bin, .pt) can execute code when loaded, so they are
refused unless the user passes ``trust_pickle=True``. ``trust_remote_code`` is
never set: only architectures transformers ships are loaded.
"""

from __future__ import annotations

import contextlib

import hashlib
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ExportError

_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


@dataclass
class LoadedModel:
    model: Any  # transformers PreTrainedModel (torch, float32, eval)
    tokenizer: Any  # transformers PreTrainedTokenizerFast
    source: str  # human-readable origin
    eos_token_ids: tuple[int, ...]
    # The checkpoint as given: an HF folder, or the GGUF file (not its dequantized copy, whose
    # tokenizer_config.json lacks the file's tokenizer.ggml.* flags). Tokenizer parity reads it.
    origin: Path | None = None
    # A converted GGUF copy outside the cache (load_source's convert_into), for the caller to delete.
    scratch: Path | None = None


def _log(msg: str, quiet: bool) -> None:
    if not quiet:
        print(f"[specedge export] {msg}", file=sys.stderr, flush=True)


def resolve_source(src: str) -> Path:
    """A catalog name is fetched (cached); anything else must be an existing path."""
    from .catalog import CATALOG
    from .fetch import fetch

    if src in CATALOG:
        return fetch(src)
    path = Path(src).expanduser()
    if not path.exists():
        raise ExportError(f"source {src!r} is neither an existing path nor a catalog model "
                          f"({', '.join(CATALOG)})")
    return path


def _eos_ids(model: Any, tokenizer: Any) -> tuple[int, ...]:
    ids: list[int] = []
    for value in (getattr(model.generation_config, "eos_token_id", None), model.config.eos_token_id,
                  tokenizer.eos_token_id):
        for v in (value if isinstance(value, (list, tuple)) else [value]):
            if isinstance(v, int) and v not in ids and 0 <= v < model.config.vocab_size:
                ids.append(v)
    return tuple(ids)


def converted_cache_dir(gguf: Path) -> Path:
    """Where :func:`load_gguf` keeps ``gguf``'s converted HF folder (it may not exist yet): keyed by the file's
    path, size and modification time, so a changed file is converted again."""
    from .fetch import cache_dir

    st = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{st.st_size}:{int(st.st_mtime)}".encode()).hexdigest()[:16]
    return cache_dir() / "converted" / f"{gguf.stem}-{key}"


def load_gguf(path: Path, *, quiet: bool = False, into: Path | None = None) -> tuple[Path, str]:
    """Dequantize a GGUF file to an HF safetensors folder, one tensor at a time (export/gguf_convert.py;
    about a minute on 2 cores for 0.5B parameters).

    ``into`` None: into the cache, kept and reused by later runs. A folder: into that folder, which the
    caller deletes when done (a float32 copy is 4 bytes a parameter: 7 GB for 1.5B). Either way, a
    copy the cache already holds is reused.
    """
    out = converted_cache_dir(path)
    if (out / "config.json").exists() and (out / "tokenizer.json").exists():
        return out, f"gguf:{path.name}"
    if into is None:
        _log(f"converting {path.name} from GGUF (dequantizing; cached after this run)", quiet)
    else:
        _log(f"converting {path.name} from GGUF (dequantizing; the float32 copy is deleted after this export, "
             "--keep-converted keeps it in the cache)", quiet)
        out = into
    t = time.perf_counter()
    tmp = out.with_name(out.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        try:
            _convert(path, tmp, quiet)
        except Exception as exc:  # a corrupt body past a sound header: gguf's reader raises struct.error, ValueError...
            lines = str(exc).strip().splitlines() or [""]
            raise ExportError(f"cannot read GGUF file {path}: {type(exc).__name__}: {lines[0][:300]}") from None
        shutil.rmtree(out, ignore_errors=True)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    _log(f"converted in {time.perf_counter() - t:.0f} s -> {out}", quiet)
    return out, f"gguf:{path.name}"


def _convert(path: Path, folder: Path, quiet: bool) -> None:
    """``path`` into the empty ``folder`` one tensor at a time (export/gguf_convert.py), or, for a family
    whose tensors transformers merges across the file, through transformers' whole-model loader."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .gguf_convert import NotStreamable, convert_gguf
    from .progress import Eta

    eta: list[Eta] = []

    def progress(done: int, total: int) -> None:
        if not eta:  # the clock starts at the first tensor, not while transformers reads the metadata
            eta.append(Eta(f"dequantizing {path.name}", total, "tensors", lambda line: _log(line.strip(), quiet)))
        eta[0].update(done, total)

    try:
        convert_gguf(path, folder, progress=progress)
        return
    except NotStreamable as exc:
        _log(f"{exc}: converting the whole model at once", quiet)
        for item in folder.iterdir():
            item.unlink()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32,
                                                 trust_remote_code=False)
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, trust_remote_code=False)
    # save_pretrained refuses a GGUF-loaded model while it still carries the quantizer.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(str(folder), safe_serialization=True)
    tokenizer.save_pretrained(str(folder))


def _load_tokenizer(path: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)


@contextlib.contextmanager
def _library_progress_off(quiet: bool):
    """transformers' own progress bars ("Loading weights") off while ``quiet``, restored after."""
    if not quiet:
        yield
        return
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def load_source(src: str, *, trust_pickle: bool = False, quiet: bool = False, stream: bool = False,
                convert_into: Path | None = None) -> LoadedModel:
    """Load ``src`` (see the module docstring). ``stream``: leave the weights in the checkpoint's
    safetensors files and read each module's while it runs (export/streamed.py), for a folder whose
    tensors map one to one onto the model's parameters; anything else loads whole, as without it.
    ``convert_into``: a GGUF source not yet in the cache is converted into this folder, not the cache
    (``LoadedModel.scratch`` then names it: the caller deletes it once done with the model)."""
    import torch
    from transformers import AutoModelForCausalLM

    path = resolve_source(src)
    origin = path
    description = str(src)
    if path.is_file():
        if path.suffix != ".gguf":
            raise ExportError(f"{path} is a file but not a .gguf; pass a GGUF file or an HF folder")
        path, description = load_gguf(path, quiet=quiet, into=convert_into)
    if not (path / "config.json").is_file():
        raise ExportError(f"{path} has no config.json: not a Hugging Face model folder")
    has_safetensors = any(path.glob("*.safetensors"))
    pickles = [p.name for p in path.iterdir() if p.suffix in _PICKLE_SUFFIXES]
    if not has_safetensors and pickles and not trust_pickle:
        raise ExportError(f"{path} holds only pickle checkpoints ({', '.join(pickles[:3])}), which can run code "
                          "when loaded; convert them to safetensors or pass --trust-pickle if you trust the source")
    if not has_safetensors and not pickles:
        raise ExportError(f"{path} has no weights (*.safetensors)")
    if stream and has_safetensors:
        from .streamed import load_streamed

        try:
            streamed = load_streamed(path)
            tokenizer = _load_tokenizer(path) if streamed is not None else None
        except (OSError, ValueError, KeyError) as exc:
            raise ExportError(f"transformers could not load {path}: {exc}") from None
        if streamed is not None:
            _log(f"loading {description} (weights streamed from disk, one module at a time)", quiet)
            return LoadedModel(streamed, tokenizer, description, _eos_ids(streamed, tokenizer), origin,
                               _scratch(path, convert_into))
        _log(f"{description}: its tensors do not map one to one onto the model's; loading it whole", quiet)
    _log(f"loading {description}", quiet)
    try:
        with _library_progress_off(quiet):
            model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32,
                                                         use_safetensors=has_safetensors or not trust_pickle,
                                                         trust_remote_code=False)
        tokenizer = _load_tokenizer(path)
    except (OSError, ValueError, KeyError) as exc:
        raise ExportError(f"transformers could not load {path}: {exc}") from None
    except Exception as exc:  # a corrupt safetensors file (SafetensorError), a pickle torch refuses (UnpicklingError)
        lines = str(exc).strip().splitlines() or [""]
        raise ExportError(f"transformers could not load {path}: {type(exc).__name__}: {lines[0][:300]}") from None
    model.eval()
    return LoadedModel(model, tokenizer, description, _eos_ids(model, tokenizer), origin, _scratch(path, convert_into))


def _scratch(path: Path, convert_into: Path | None) -> Path | None:
    return path if convert_into is not None and path == convert_into else None
