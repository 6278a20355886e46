"""A persisted prompt cache: the K/V of a fixed prefix (a system prompt) in a file, so a restart
does not pay for its prefill again (llama.cpp's ``--prompt-cache``).

File format: a NumPy ``.npz`` archive (a zip of ``.npy`` arrays), read with
``np.load(allow_pickle=False)`` so a file can never run code:

- ``header``: uint8, the UTF-8 bytes of a JSON object: ``format`` (``FORMAT``), ``version``,
  ``key`` (:func:`cache_key`: what must match for the K/V to be the ones this Generator would
  compute), ``tokens`` (the prefix's token ids), ``draft_tokens`` (the draft cache's prefix, maybe
  empty) and ``layout``;
- ``target.k.<i>`` / ``target.v.<i>`` (and ``draft.k.<i>`` / ``draft.v.<i>``): layer i's K and V of
  those positions, in the cache's own layout (``[n, n_kv_heads, head_dim]`` position-major,
  ``[1, n_kv_heads, n, head_dim]`` head-major).

Exactness: the target's K/V in the file are the bits a cold prefill computes on the same graph,
ONNX Runtime version and provider (every row of a >= 2-row forward is bit-identical whatever the
row count, engines/invariant.py), so a reply continuing a loaded prefix equals a cold reply. The
key pins all of that; anything else is refused with :class:`PromptCacheError` naming the field.
"""

from __future__ import annotations

import json
import os
import zipfile
from pathlib import Path
from typing import Sequence

import numpy as np

from ..bundle_extra import MachineFingerprint
from ..engines.base import KVCache
from ..errors import PromptCacheError
from ..manifest import Manifest, ModelEntry

FORMAT = "specedge-prompt-cache"
VERSION = 2  # 2: the key holds the CPU's extensions and the thread count
# A header is a few KB (a token list at most max_context long); anything much larger is not ours.
MAX_HEADER_BYTES = 16 << 20


def _graph_sha256(manifest: Manifest, entry: ModelEntry | None) -> str | None:
    """sha256 of a model's graph and data files, from the manifest (one string: graph first)."""
    if entry is None:
        return None
    return ",".join(manifest.files[rel].sha256 for rel in (entry.graph, *entry.data_files))


def cache_key(manifest: Manifest, *, exact: bool, runtime: str, with_draft: bool, threads: int) -> dict:
    """Everything a cached K/V depends on: the graphs (by sha256), their precision, cache shape and
    dtype, the exactness setting (2-row steps or not), the runtime that computed it
    (``"onnxruntime <version> <provider>"``: kernels differ in the low bits across versions), the
    CPU's vector extensions (ONNX Runtime's MLAS picks its matmul kernels by them: AVX2 and AVX-512
    int4 kernels round differently, so a file moved between such machines would not hold the bits a
    cold prefill computes there) and the intra-op thread count (how the kernels split their work;
    equal bits at 1 and 2 threads were measured, not promised)."""
    t, d = manifest.target, manifest.draft if with_draft else None
    return {"target_sha256": _graph_sha256(manifest, t), "target_precision": t.precision,
            "draft_sha256": _graph_sha256(manifest, d), "draft_precision": d.precision if d else None,
            "max_context": t.max_context, "kv_dtype": t.kv_dtype, "attention": t.attention,
            "tokenizer_sha256": manifest.tokenizer.sha256, "exact": exact, "runtime": runtime,
            "cpu_isa": MachineFingerprint.here(threads).isa, "threads": threads}


def _host(kv: KVCache, what: str) -> None:
    if not all(isinstance(a, np.ndarray) for a in (*kv.keys, *kv.values)):
        raise PromptCacheError(f"the {what} cache lives on a device: prompt caches are saved from and loaded into "
                               "host caches (provider cpu)")


def _committed(kv: KVCache, array: np.ndarray, n: int) -> np.ndarray:
    return array[:n] if kv.layout == "position-major" else array[:, :, :n]


def _check_path_to_write(path: Path) -> None:
    if path.is_dir():
        raise PromptCacheError(f"prompt cache path {path} is a directory; give a file name")
    if not path.parent.is_dir():
        raise PromptCacheError(f"prompt cache path {path}: folder {path.parent} does not exist")


def save(path: str | os.PathLike[str], key: dict, tokens: Sequence[int], target_kv: KVCache,
         draft_tokens: Sequence[int] = (), draft_kv: KVCache | None = None) -> int:
    """Write ``target_kv[:len(tokens)]`` (and ``draft_kv[:len(draft_tokens)]``) under ``key``.

    Written to a temporary file beside ``path`` and renamed over it, so a crash never leaves a
    truncated cache behind. Returns the file's size in bytes.
    """
    path = Path(path)
    _check_path_to_write(path)
    n, nd = len(tokens), len(draft_tokens) if draft_kv is not None else 0
    if not 0 < n <= target_kv.length or nd > (draft_kv.length if draft_kv is not None else 0):
        raise PromptCacheError(f"nothing to save: the cache holds {target_kv.length} positions, asked for {n}")
    _host(target_kv, "target")
    arrays = {}
    for role, kv, count in (("target", target_kv, n), ("draft", draft_kv, nd)):
        if kv is None or not count:
            continue
        _host(kv, role)
        for i, (k, v) in enumerate(zip(kv.keys, kv.values)):
            arrays[f"{role}.k.{i}"] = _committed(kv, k, count)
            arrays[f"{role}.v.{i}"] = _committed(kv, v, count)
    header = {"format": FORMAT, "version": VERSION, "key": key, "layout": target_kv.layout,
              "tokens": [int(t) for t in tokens], "draft_tokens": [int(t) for t in draft_tokens[:nd]]}
    raw = np.frombuffer(json.dumps(header).encode("utf-8"), np.uint8)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:  # a file object: np.savez would append ".npz" to a name
            np.savez(f, header=raw, **arrays)
        os.replace(tmp, path)
    except OSError as exc:
        raise PromptCacheError(f"cannot write prompt cache {path}: {exc.strerror or exc}") from None
    finally:
        tmp.unlink(missing_ok=True)
    return path.stat().st_size


class Loaded:
    """A validated prompt cache: ``tokens``, ``draft_tokens`` and their K/V per layer."""

    def __init__(self, tokens: list[int], draft_tokens: list[int], arrays: dict[str, np.ndarray]) -> None:
        self.tokens = tokens
        self.draft_tokens = draft_tokens
        self.arrays = arrays

    def fill(self, role: str, kv: KVCache) -> None:
        """Copy this file's ``role`` K/V into ``kv`` (from position 0) and set its length."""
        _host(kv, role)
        n = len(self.tokens if role == "target" else self.draft_tokens)
        for i, (k, v) in enumerate(zip(kv.keys, kv.values)):
            _committed(kv, k, n)[...] = self.arrays[f"{role}.k.{i}"]
            _committed(kv, v, n)[...] = self.arrays[f"{role}.v.{i}"]
        kv.length = n


def _mismatch(got: dict, want: dict) -> list[str]:
    def short(value):  # a graph's digests: the first 12 hex digits name it well enough in a message
        digest = isinstance(value, str) and len(value) > 24 and set(value) <= set("0123456789abcdef,")
        return f"{value[:12]}…" if digest else repr(value)

    return [f"{name} {short(got.get(name))} (this Generator: {short(value)})" for name, value in want.items()
            if got.get(name) != value]


def load(path: str | os.PathLike[str], key: dict, target_kv: KVCache, draft_kv: KVCache | None,
         vocab_size: int) -> Loaded:
    """Read and check a prompt cache written by :func:`save` for caches shaped like ``target_kv``
    (``draft_kv``). Raises PromptCacheError naming what is wrong: a missing or non-file path, a
    truncated or foreign file, a key field that differs, arrays of the wrong shape or dtype."""
    path = Path(path)
    if not path.exists():
        raise PromptCacheError(f"prompt cache {path} does not exist")
    if not path.is_file():
        raise PromptCacheError(f"prompt cache {path} is not a regular file")
    try:
        with np.load(path, allow_pickle=False) as archive:
            if "header" not in archive.files:
                raise PromptCacheError(f"prompt cache {path} has no header: not a specedge prompt cache")
            raw = archive["header"]
            if raw.dtype != np.uint8 or raw.ndim != 1 or raw.size > MAX_HEADER_BYTES:
                raise PromptCacheError(f"prompt cache {path}: malformed header")
            header = json.loads(raw.tobytes().decode("utf-8"))
            if not isinstance(header, dict) or header.get("format") != FORMAT:
                raise PromptCacheError(f"prompt cache {path} is not a specedge prompt cache")
            if header.get("version") != VERSION:
                raise PromptCacheError(f"prompt cache {path} has format version {header.get('version')!r}; this "
                                       f"specedge reads version {VERSION}: rebuild it")
            got = header.get("key")
            wrong = _mismatch(got if isinstance(got, dict) else {}, key)
            if wrong:
                raise PromptCacheError(f"prompt cache {path} was saved for another bundle or setting: "
                                       + "; ".join(wrong))
            tokens, draft_tokens = _tokens(header, "tokens", path), _tokens(header, "draft_tokens", path)
            if not 0 < len(tokens) < target_kv.capacity or len(draft_tokens) > len(tokens) or \
                    any(not 0 <= t < vocab_size for t in tokens + draft_tokens):
                raise PromptCacheError(f"prompt cache {path}: its token ids are out of range for this bundle")
            if draft_tokens != tokens[:len(draft_tokens)]:
                raise PromptCacheError(f"prompt cache {path}: the draft's prefix is not the target's")
            if header.get("layout") != target_kv.layout:
                raise PromptCacheError(f"prompt cache {path} holds a {header.get('layout')!r} cache; this "
                                       f"Generator's is {target_kv.layout!r}")
            arrays = {}
            for role, kv, n in (("target", target_kv, len(tokens)), ("draft", draft_kv, len(draft_tokens))):
                if not n:
                    continue
                if kv is None:
                    raise PromptCacheError(f"prompt cache {path} holds a draft cache; this Generator has no "
                                           "draft model")
                for i, (k, _) in enumerate(zip(kv.keys, kv.values)):
                    want = _committed(kv, k, n).shape
                    for part in "kv":
                        name = f"{role}.{part}.{i}"
                        if name not in archive.files:
                            raise PromptCacheError(f"prompt cache {path} lacks {name}: truncated or not ours")
                        array = archive[name]
                        if array.shape != want or array.dtype != k.dtype:
                            raise PromptCacheError(f"prompt cache {path}: {name} is {array.dtype} "
                                                   f"{list(array.shape)}, expected {k.dtype} {list(want)}")
                        arrays[name] = array
    except PromptCacheError:
        raise
    except (OSError, ValueError, EOFError, zipfile.BadZipFile, UnicodeDecodeError) as exc:
        # np.load raises ValueError/BadZipFile on a truncated or foreign file (and on a pickled
        # object array, which allow_pickle=False refuses), zipfile a CRC error on corrupt bytes.
        raise PromptCacheError(f"prompt cache {path} is truncated or corrupt ({type(exc).__name__}: "
                               f"{str(exc)[:200]}); delete it and let it be rebuilt") from None
    return Loaded(tokens, draft_tokens, arrays)


def _tokens(header: dict, name: str, path: Path) -> list[int]:
    value = header.get(name)
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise PromptCacheError(f"prompt cache {path}: header field {name!r} must be a list of token ids")
    return value
