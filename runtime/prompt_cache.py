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
  ``[1, n_kv_heads, n, head_dim]`` head-major), C order, stored (not compressed);
- ``sha256``: uint8, the hex digest (:func:`_digest`) of the header's bytes and every array (name,
  dtype, shape, bytes), so the token list cannot be edited or swapped, nor an array replaced,
  zeroed or scaled, without the load noticing. It detects corruption and edits by anything that
  does not recompute it; it is not a signature: a file is as trustworthy as whoever can write it.

Loading never trusts a size in the file before checking it: the file's size, each member's
declared (inflated) size and compression ratio, and each ``.npy`` header's dtype and shape are
compared with what this Generator's caches can hold before a byte of array data is read, and
every array must be finite.

Exactness: the target's K/V in the file are the bits a cold prefill computes on the same graph,
ONNX Runtime version and provider (every row of a >= 2-row forward is bit-identical whatever the
row count, engines/invariant.py), so a reply continuing a loaded prefix equals a cold reply. The
key pins all of that; anything else is refused with :class:`PromptCacheError` naming the field.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import stat
import zipfile
from pathlib import Path
from typing import Sequence

import numpy as np
from numpy.lib import format as npy

from ..bundle.extra import MachineFingerprint
from ..engines.base import KVCache
from ..errors import PromptCacheError
from ..bundle.manifest import Manifest, ModelEntry
from ..bundle.pathcheck import name_problem

FORMAT = "specedge-prompt-cache"
VERSION = 3  # 3: a sha256 member binds the header to the arrays; 2: the key holds the CPU's extensions and threads
# A header is a few KB (a token list at most max_context long); anything much larger is not ours.
MAX_HEADER_BYTES = 16 << 20
DIGEST = "sha256"  # the member holding the digest
# An .npy member's own header: magic and lengths (12 bytes) and a dict literal numpy pads to 64
# bytes and reads only up to 10000 bytes long (numpy.lib.format's max_header_size).
MAX_NPY_HEADER_BYTES = 12 + 10_000
# deflate cannot inflate more than 1032-fold (RFC 1951: a 258-byte match costs at least 2 bits); a
# member declaring more is forged. save() stores members uncompressed.
MAX_DEFLATE_RATIO = 1032
# Zip bookkeeping per member (local header, central directory entry, zip64 extras), generously.
ZIP_MEMBER_OVERHEAD = 1024


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


def _tmp_name(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def _stat(path: Path) -> os.stat_result | None:
    """``path``'s stat, None when it does not exist; PromptCacheError for a name the OS refuses."""
    problem = name_problem(path)
    if problem:  # the path itself is not repeated: it may be kilobytes long
        raise PromptCacheError(f"prompt cache path refused: {problem}")
    try:
        return path.stat()
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        raise PromptCacheError(f"prompt cache path {path}: {exc.strerror or exc}") from None


def exists(path: str | os.PathLike[str]) -> bool:
    """Whether a file (or anything) is at ``path``; PromptCacheError for a name the OS refuses
    (too long) or cannot look up, where ``Path.exists`` raises OSError."""
    return _stat(Path(path)) is not None


def _check_path_to_write(path: Path) -> None:
    problem = name_problem(path, reserve=len(_tmp_name(path).name) - len(path.name))
    if problem:
        raise PromptCacheError(f"prompt cache path refused: {problem}")
    st = _stat(path)
    if st is not None and stat.S_ISDIR(st.st_mode):
        raise PromptCacheError(f"prompt cache path {path} is a directory; give a file name")
    if not path.parent.is_dir():
        raise PromptCacheError(f"prompt cache path {path}: folder {path.parent} does not exist")


def _digest(header: bytes, arrays: dict[str, np.ndarray]) -> str:
    """sha256 over the header's bytes, then each array (sorted by name): its name, dtype, shape and
    C-order bytes. The header holds the key and the token lists, so this binds them to the K/V."""
    h = hashlib.sha256(FORMAT.encode() + b"\0header\0" + len(header).to_bytes(8, "little"))
    h.update(header)
    for name in sorted(arrays):
        array = np.ascontiguousarray(arrays[name])
        h.update(f"\0{name}\0{array.dtype.str}\0{list(array.shape)}\0".encode())
        h.update(array.data)
    return h.hexdigest()


def _finite(name: str, array: np.ndarray, where: str) -> None:
    bad = array.size - int(np.count_nonzero(np.isfinite(array)))
    if bad:
        raise PromptCacheError(f"{where}: {name} holds {bad} NaN or infinite values; a prompt cache holds finite "
                               "K/V only (corrupt or tampered)")


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
            arrays[f"{role}.k.{i}"] = np.ascontiguousarray(kv.committed(k, count))  # C order, as load expects
            arrays[f"{role}.v.{i}"] = np.ascontiguousarray(kv.committed(v, count))
    for name, array in arrays.items():  # a file load() would refuse is not written
        _finite(name, array, f"prompt cache {path} not saved")
    header = {"format": FORMAT, "version": VERSION, "key": key, "layout": target_kv.layout,
              "tokens": [int(t) for t in tokens], "draft_tokens": [int(t) for t in draft_tokens[:nd]]}
    raw = json.dumps(header).encode("utf-8")
    digest = np.frombuffer(_digest(raw, arrays).encode("ascii"), np.uint8)
    tmp = _tmp_name(path)
    try:
        with open(tmp, "wb") as f:  # a file object: np.savez would append ".npz" to a name
            np.savez(f, header=np.frombuffer(raw, np.uint8), **{DIGEST: digest}, **arrays)
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
            kv.committed(k, n)[...] = self.arrays[f"{role}.k.{i}"]
            kv.committed(v, n)[...] = self.arrays[f"{role}.v.{i}"]
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
    (``draft_kv``). Raises PromptCacheError naming what is wrong: a missing, non-file or
    unnameable path, a truncated, foreign or older-format file, a key field that differs, a size
    or shape beyond what these caches hold (checked before it is allocated), arrays of the wrong
    shape or dtype, non-finite values, or contents that do not match the file's sha256."""
    path = Path(path)
    st = _stat(path)
    if st is None:
        raise PromptCacheError(f"prompt cache {path} does not exist")
    if not stat.S_ISREG(st.st_mode):
        raise PromptCacheError(f"prompt cache {path} is not a regular file")
    caches = [kv for kv in (target_kv, draft_kv) if kv is not None]
    members = 2 + sum(2 * len(kv.keys) for kv in caches)
    largest = (MAX_HEADER_BYTES + sum(kv.nbytes for kv in caches)
               + members * (MAX_NPY_HEADER_BYTES + ZIP_MEMBER_OVERHEAD))
    if st.st_size > largest:
        raise PromptCacheError(f"prompt cache {path} is {st.st_size} bytes; a prompt cache for this Generator's "
                               f"caches is at most {largest}: not ours")
    where = f"prompt cache {path}"
    try:
        with open(path, "rb") as file, zipfile.ZipFile(file) as archive:
            infos = {}
            for info in archive.infolist():
                if info.filename in infos:
                    raise PromptCacheError(f"{where} holds {info.filename} twice: not ours")
                infos[info.filename] = info
            if "header.npy" not in infos:
                raise PromptCacheError(f"{where} has no header: not a specedge prompt cache")
            raw = _read_npy(archive, infos, "header", where, np.dtype(np.uint8), None)
            header = json.loads(raw.tobytes().decode("utf-8"))
            if not isinstance(header, dict) or header.get("format") != FORMAT:
                raise PromptCacheError(f"{where} is not a specedge prompt cache")
            if header.get("version") != VERSION:
                raise PromptCacheError(
                    f"{where} has format version {header.get('version')!r}; this specedge reads version {VERSION}, "
                    "whose sha256 binds the arrays to the header: save it again (delete the file; `specedge serve "
                    "--prompt-cache FILE --system-prompt ...` writes it anew)")
            got = header.get("key")
            wrong = _mismatch(got if isinstance(got, dict) else {}, key)
            if wrong:
                raise PromptCacheError(f"{where} was saved for another bundle or setting: " + "; ".join(wrong))
            tokens, draft_tokens = _tokens(header, "tokens", path), _tokens(header, "draft_tokens", path)
            if not 0 < len(tokens) < target_kv.capacity or len(draft_tokens) > len(tokens) or \
                    any(not 0 <= t < vocab_size for t in tokens + draft_tokens):
                raise PromptCacheError(f"{where}: its token ids are out of range for this bundle")
            if draft_tokens != tokens[:len(draft_tokens)]:
                raise PromptCacheError(f"{where}: the draft's prefix is not the target's")
            if header.get("layout") != target_kv.layout:
                raise PromptCacheError(f"{where} holds a {header.get('layout')!r} cache; this "
                                       f"Generator's is {target_kv.layout!r}")
            expected = {}  # name -> (dtype, shape), from this Generator's caches and the header's token counts
            for role, kv, n in (("target", target_kv, len(tokens)), ("draft", draft_kv, len(draft_tokens))):
                if not n:
                    continue
                if kv is None:
                    raise PromptCacheError(f"{where} holds a draft cache; this Generator has no draft model")
                for i, k in enumerate(kv.keys):
                    for part in "kv":
                        expected[f"{role}.{part}.{i}"] = (k.dtype, kv.committed(k, n).shape)
            for name in sorted(expected):
                if f"{name}.npy" not in infos:
                    raise PromptCacheError(f"{where} lacks {name}: truncated or not ours")
            extra = sorted(set(infos) - {f"{name}.npy" for name in (*expected, "header", DIGEST)})
            if extra:
                raise PromptCacheError(f"{where} holds {extra[0]!r}, which no prompt cache for this Generator "
                                       "holds: not ours")
            if f"{DIGEST}.npy" not in infos:
                raise PromptCacheError(f"{where} lacks its {DIGEST}: truncated or not ours")
            digest = _read_npy(archive, infos, DIGEST, where, np.dtype(np.uint8), (64,)).tobytes()
            arrays = {}
            for name, (dtype, shape) in expected.items():
                arrays[name] = _read_npy(archive, infos, name, where, dtype, shape)
                _finite(name, arrays[name], where)
            if _digest(raw.tobytes(), arrays).encode("ascii") != digest:
                raise PromptCacheError(f"{where}: its {DIGEST} does not match its header (key, token lists) and "
                                       "arrays: the file was changed after it was saved; delete it and let it be "
                                       "rebuilt")
    except PromptCacheError:
        raise
    except (OSError, ValueError, EOFError, zipfile.BadZipFile, UnicodeDecodeError, SyntaxError) as exc:
        # zipfile raises BadZipFile on a truncated or foreign file and on a CRC error, numpy's .npy
        # header parser ValueError (a bad magic or dict, a pickled object dtype) or SyntaxError.
        raise PromptCacheError(f"{where} is truncated or corrupt ({type(exc).__name__}: "
                               f"{str(exc)[:200]}); delete it and let it be rebuilt") from None
    return Loaded(tokens, draft_tokens, arrays)


def _read_npy(archive: zipfile.ZipFile, infos: dict[str, zipfile.ZipInfo], name: str, where: str,
              dtype: np.dtype, shape: tuple[int, ...] | None) -> np.ndarray:
    """Member ``name`` as an array of ``dtype`` and ``shape`` (None: the header, 1-D and at most
    MAX_HEADER_BYTES). Every size the file declares is checked before anything of that size is
    allocated or inflated: the member's inflated size and compression ratio from the zip directory,
    then the .npy header's dtype and shape; then exactly that many bytes are read, and the member
    must end there (zipfile checks its CRC at the end)."""
    info = infos[f"{name}.npy"]
    most = MAX_HEADER_BYTES if shape is None else math.prod(shape) * dtype.itemsize
    if info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
        raise PromptCacheError(f"{where}: {name} uses zip compression method {info.compress_type}: not ours")
    if info.file_size > most + MAX_NPY_HEADER_BYTES:
        raise PromptCacheError(f"{where}: {name} inflates to {info.file_size} bytes; it holds at most "
                               f"{most + MAX_NPY_HEADER_BYTES} here: not ours")
    if info.compress_type == zipfile.ZIP_DEFLATED and info.file_size > MAX_DEFLATE_RATIO * max(info.compress_size, 1):
        raise PromptCacheError(f"{where}: {name} claims to inflate {info.file_size} bytes from {info.compress_size}, "
                               f"more than deflate's {MAX_DEFLATE_RATIO}-fold: forged")
    with archive.open(info) as f:
        version = npy.read_magic(f)
        if version not in ((1, 0), (2, 0)):
            raise PromptCacheError(f"{where}: {name} has .npy format version {version}: not ours")
        read_header = npy.read_array_header_1_0 if version == (1, 0) else npy.read_array_header_2_0
        got_shape, fortran, got_dtype = read_header(f, max_header_size=MAX_NPY_HEADER_BYTES)
        if shape is None:
            if got_dtype != dtype or len(got_shape) != 1 or got_shape[0] > MAX_HEADER_BYTES:
                raise PromptCacheError(f"{where}: {name} is {got_dtype} {list(got_shape)}, expected a uint8 vector of "
                                       f"at most {MAX_HEADER_BYTES} bytes")
        elif got_dtype != dtype or tuple(got_shape) != tuple(shape):
            raise PromptCacheError(f"{where}: {name} is {got_dtype} {list(got_shape)}, expected {dtype} {list(shape)}")
        if fortran:
            raise PromptCacheError(f"{where}: {name} is stored in Fortran order; prompt caches are C order")
        nbytes = math.prod(got_shape) * got_dtype.itemsize
        if info.file_size - f.tell() != nbytes:
            raise PromptCacheError(f"{where}: {name} holds {info.file_size - f.tell()} bytes of data for the "
                                   f"{nbytes} its shape needs: truncated or not ours")
        data = f.read(nbytes)
        if len(data) != nbytes or f.read(1):
            raise PromptCacheError(f"{where}: {name} is truncated or corrupt")
    return np.frombuffer(data, got_dtype).reshape(got_shape)


def _tokens(header: dict, name: str, path: Path) -> list[int]:
    value = header.get(name)
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise PromptCacheError(f"prompt cache {path}: header field {name!r} must be a list of token ids")
    return value
