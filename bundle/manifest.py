"""The bundle manifest: the one schema export/ writes and the runtime reads.

A bundle is a folder::

    manifest.json
    tokenizer.json, tokenizer_config.json, chat_template.jinja
    target/model.onnx (+ model.onnx.data)
    draft/model.onnx  (+ model.onnx.data)      optional

This module imports neither torch nor onnxruntime. A manifest is untrusted
data: every field is type-checked, every path must stay inside the bundle, and
every file's sha256 is checked at load unless the caller opts out.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from .extra import ManifestExtra
from ..errors import BundleError, ChecksumError, ManifestError, UnsafePathError, VocabMismatchError
from .graphfile import read_graph_facts
from .schema import (MAX_CONTEXT, MAX_DRAFT_TOKENS, ROLES, choice, positive, read_field, refuse_unknown, relpath,
                     show)

FORMAT_NAME = "specedge-bundle"
# 2: graphs implement sliding-window attention and models record it (attention_windows).
FORMAT_VERSION = 2
# Older versions this specedge still loads, with the caveat each carries (shown by `specedge info`).
LEGACY_FORMAT_NOTES = {
    1: ("format 1 was exported before sliding-window support: if the source checkpoint uses a sliding window "
        "(Mistral, Qwen2 with use_sliding_window, ...), its output past the window is wrong; re-export it with "
        "this specedge"),
}
MANIFEST_FILE = "manifest.json"
PRECISIONS = ("fp32", "fp16", "int4", "int8")
ATTENTIONS = ("standard", "gqa")  # plain ONNX ops, or ORT's fused GroupQueryAttention
KV_DTYPES = ("float32", "float16")

# Reading 1 MiB at a time keeps hashing a 1 GB weight file at disk speed without holding it in RAM.
_HASH_CHUNK = 1 << 20
__all__ = ["ATTENTIONS", "FORMAT_VERSION", "KV_DTYPES", "MANIFEST_FILE", "MAX_CONTEXT", "MAX_DRAFT_TOKENS",
           "PRECISIONS", "ROLES", "FileRecord", "Manifest", "ManifestExtra", "ModelEntry", "ModelIO", "SpeculationDefaults",
           "TokenizerEntry", "check_graph_files", "check_vocab_compatible", "file_record", "load_head_tokens",
           "load_manifest", "parse_manifest", "resolve_inside", "sha256_file", "write_manifest"]


@dataclass(frozen=True)
class ModelIO:
    """Tensor names of one graph. ``%d`` is the layer index.

    Inputs: ``input_ids`` int64 [1, n], ``positions`` int64 [1, n],
    ``num_logits`` int64 [1] (logits are returned for the last that many
    positions), ``past_key``/``past_value`` [past_len, n_kv_heads, head_dim].
    Outputs: ``logits`` float32 [1, num_logits, vocab], ``new_key``/``new_value``
    [n, n_kv_heads, head_dim] (the K/V of the n new tokens, which the engine writes
    into the loop-owned cache).

    With ``attention == "gqa"`` the cache is head-major ``[1, n_kv_heads, max_context,
    head_dim]``, bound both as ``past_*`` input and ``present_*`` output (one buffer,
    written in place), with ``seqlens_k`` int32 [1] = total length - 1 and
    ``total_sequence_length`` int32 scalar.
    """

    input_ids: str = "input_ids"
    positions: str = "position_ids"
    num_logits: str = "num_logits_to_keep"
    logits: str = "logits"
    past_key: str = "past_key.%d"
    past_value: str = "past_value.%d"
    new_key: str = "new_key.%d"
    new_value: str = "new_value.%d"
    # attention == "gqa" only: the shared past/present cache and its length inputs.
    present_key: str = "present_key.%d"
    present_value: str = "present_value.%d"
    seqlens_k: str = "seqlens_k"
    total_sequence_length: str = "total_sequence_length"

    def inputs(self, n_layers: int, attention: str) -> tuple[str, ...]:
        """The graph's input names, in the order the exporter declares them."""
        lengths = (self.seqlens_k, self.total_sequence_length) if attention == "gqa" else ()
        return (self.input_ids, self.positions, self.num_logits, *lengths,
                *(name % i for i in range(n_layers) for name in (self.past_key, self.past_value)))

    def outputs(self, n_layers: int, attention: str) -> tuple[str, ...]:
        """The graph's output names, in the order the exporter declares them: the logits, then per
        layer the new K/V (standard) or the shared present cache (gqa)."""
        key, value = (self.present_key, self.present_value) if attention == "gqa" else (self.new_key, self.new_value)
        return (self.logits, *(name % i for i in range(n_layers) for name in (key, value)))


@dataclass(frozen=True)
class ModelEntry:
    """One compiled model in the bundle (target or draft)."""

    graph: str  # bundle-relative path of the .onnx file
    architecture: str  # e.g. "llama", "qwen2", "gpt2"
    source: str  # where the weights came from (HF folder, GGUF file, "self-int4 of target")
    precision: str  # one of PRECISIONS
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    max_context: int
    eos_token_ids: tuple[int, ...]
    kv_dtype: str = "float32"
    data_files: tuple[str, ...] = ()
    tokenizer_sha256: str = ""  # sha256 of the source's tokenizer.json, to prove draft and target share it
    attention: str = "standard"  # one of ATTENTIONS; decides the KV cache layout
    # A vocabulary-truncated output layer (drafts only): the graph scores head_size tokens,
    # whose ids (int32, little-endian) are stored in the bundle file head_tokens.
    head_tokens: str | None = None
    head_size: int = 0  # 0 = the full vocabulary
    # Per layer: the sliding-window length in tokens the graph applies (0 = full attention).
    # Empty: every layer attends to the whole context.
    attention_windows: tuple[int, ...] = ()

    @property
    def output_size(self) -> int:
        """Width of the graph's logits: head_size for a truncated head, else vocab_size."""
        return self.head_size or self.vocab_size
    io: ModelIO = field(default_factory=ModelIO)


@dataclass(frozen=True)
class TokenizerEntry:
    file: str = "tokenizer.json"
    config: str | None = "tokenizer_config.json"
    chat_template: str | None = "chat_template.jinja"
    sha256: str = ""  # of the tokenizer file: draft and target must share it
    bos_token: str | None = None
    eos_token: str | None = None
    add_bos_token: bool = False


@dataclass(frozen=True)
class SpeculationDefaults:
    """What a bundle runs when the caller does not say otherwise."""

    drafter: str = "auto"  # a drafter name; loading checks it against the runtime's registry (runtime.drafters)
    draft_tokens: int = 4  # k for fixed-k speculation
    max_draft_tokens: int = 8  # the largest verify is max_draft_tokens + 1 tokens
    adaptive: bool = True  # let the cost model choose k per step (k=0 included)


@dataclass(frozen=True)
class FileRecord:
    """The checksum of one bundle file (manifest ``files[relpath]``)."""

    sha256: str  # 64 lowercase hex digits
    size: int  # bytes

    def to_dict(self) -> dict[str, Any]:
        return {"sha256": self.sha256, "size": self.size}

    @classmethod
    def from_dict(cls, obj: Any, where: str) -> "FileRecord":
        if not isinstance(obj, dict):
            raise ManifestError(f"manifest field '{where}' must be an object with sha256 and size")
        refuse_unknown(obj, ("sha256", "size"), where)
        digest = read_field(obj, "sha256", where, str)
        if len(digest) != 64 or any(ch not in "0123456789abcdef" for ch in digest):
            raise ManifestError(f"manifest field '{where}.sha256' must be 64 lowercase hex digits")
        size = read_field(obj, "size", where, int)
        if size < 0:
            raise ManifestError(f"manifest field '{where}.size' must be >= 0")
        return cls(digest, size)


@dataclass(frozen=True)
class Manifest:
    target: ModelEntry
    tokenizer: TokenizerEntry
    speculation: SpeculationDefaults
    files: dict[str, FileRecord]  # bundle-relative path -> its checksum
    draft: ModelEntry | None = None
    created_by: str = ""
    extra: ManifestExtra = field(default_factory=ManifestExtra)  # export facts, cost profile, engine records
    format_version: int = FORMAT_VERSION

    def __post_init__(self) -> None:
        # Decoded JSON given to the constructor goes through the one parser of its part.
        if isinstance(self.extra, dict):
            object.__setattr__(self, "extra", ManifestExtra.from_dict(self.extra))
        if any(isinstance(meta, dict) for meta in self.files.values()):
            object.__setattr__(self, "files", {rel: meta if isinstance(meta, FileRecord) else
                                               FileRecord.from_dict(meta, f"files[{rel!r}]")
                                               for rel, meta in self.files.items()})

    @property
    def total_bytes(self) -> int:
        """The size of every file the manifest lists."""
        return sum(f.size for f in self.files.values())

    @property
    def format_notes(self) -> tuple[str, ...]:
        """Caveats of a bundle written in an older format (empty for the current one)."""
        note = LEGACY_FORMAT_NOTES.get(self.format_version)
        return (note,) if note else ()

    def models(self) -> dict[str, ModelEntry]:
        out = {"target": self.target}
        if self.draft is not None:
            out["draft"] = self.draft
        return out

    def to_json(self) -> dict[str, Any]:
        def entry(m: ModelEntry) -> dict[str, Any]:
            d = asdict(m)
            d["eos_token_ids"] = list(m.eos_token_ids)
            d["data_files"] = list(m.data_files)
            d["attention_windows"] = list(m.attention_windows)
            if not m.attention_windows:
                d.pop("attention_windows")
            if not m.head_tokens:  # keep manifests of full-vocabulary models free of unused fields
                d.pop("head_tokens")
                d.pop("head_size")
            return d

        out: dict[str, Any] = {
            "format": FORMAT_NAME,
            "format_version": self.format_version,
            "created_by": self.created_by,
            "models": {name: entry(m) for name, m in self.models().items()},
            "tokenizer": asdict(self.tokenizer),
            "speculation": asdict(self.speculation),
            "files": {rel: f.to_dict() for rel, f in self.files.items()},
            "extra": self.extra.to_dict(),
        }
        return out


# --------------------------------------------------------------------------- parsing


def _parse_io(obj: dict[str, Any], where: str) -> ModelIO:
    defaults = ModelIO()
    values = {}
    for key in asdict(defaults):
        values[key] = read_field(obj, key, where, str, optional=True, default=getattr(defaults, key))
    for key in ("past_key", "past_value", "new_key", "new_value", "present_key", "present_value"):
        # A printf pattern, formatted as pattern % layer: exactly one %d conversion, and '%'
        # otherwise only as '%%' ("%%d" is a literal "%d", and "%s%d" takes two arguments).
        conversions = re.findall(r"%(.?)", values[key])
        if conversions.count("d") != 1 or any(c not in ("d", "%") for c in conversions):
            raise ManifestError(f"manifest field '{where}.{key}' must contain exactly one '%d' (layer index), "
                                f"and '%' only as '%%'; got {show(values[key])}")
    return ModelIO(**values)


def _parse_model(obj: Any, where: str) -> ModelEntry:
    if not isinstance(obj, dict):
        raise ManifestError(f"manifest field '{where}' must be an object")
    ints = {k: positive(read_field(obj, k, where, int), f"{where}.{k}")
            for k in ("n_layers", "n_heads", "n_kv_heads", "head_dim", "hidden_size", "vocab_size", "max_context")}
    if ints["max_context"] > MAX_CONTEXT:  # it sizes a preallocated KV cache: a lie would be a MemoryError
        raise ManifestError(f"manifest field '{where}.max_context' must be <= {MAX_CONTEXT}, "
                            f"got {ints['max_context']}")
    if ints["n_heads"] % ints["n_kv_heads"]:
        raise ManifestError(f"manifest field '{where}.n_heads' ({ints['n_heads']}) must be a multiple of "
                            f"n_kv_heads ({ints['n_kv_heads']})")
    head_size = read_field(obj, "head_size", where, int, optional=True, default=0)
    if not 0 <= head_size <= ints["vocab_size"]:
        raise ManifestError(f"manifest field '{where}.head_size' must be in [0, vocab_size={ints['vocab_size']}]"
                            f", got {head_size}")
    if bool(head_size) != bool(obj.get("head_tokens")):
        raise ManifestError(f"manifest fields '{where}.head_size' and '{where}.head_tokens' go together")
    eos = read_field(obj, "eos_token_ids", where, list)
    for i, tok in enumerate(eos):
        if isinstance(tok, bool) or not isinstance(tok, int) or not 0 <= tok < ints["vocab_size"]:
            raise ManifestError(f"manifest field '{where}.eos_token_ids[{i}]' must be a token id in "
                                f"[0, {ints['vocab_size']}), got {show(tok)}")
    data_files = read_field(obj, "data_files", where, list, optional=True, default=[])
    for i, rel in enumerate(data_files):
        if not isinstance(rel, str):
            raise ManifestError(f"manifest field '{where}.data_files[{i}]' must be a string")
        relpath(rel, f"{where}.data_files[{i}]")
    io = read_field(obj, "io", where, dict, optional=True, default={})
    windows = read_field(obj, "attention_windows", where, list, optional=True, default=[])
    if windows and len(windows) != ints["n_layers"]:
        raise ManifestError(f"manifest field '{where}.attention_windows' must list one window per layer "
                            f"({ints['n_layers']}), got {len(windows)}")
    for i, window in enumerate(windows):
        if isinstance(window, bool) or not isinstance(window, int) or not 0 <= window <= MAX_CONTEXT:
            raise ManifestError(f"manifest field '{where}.attention_windows[{i}]' must be a window length in "
                                f"[0, {MAX_CONTEXT}] (0 = full attention), got {show(window)}")
    return ModelEntry(
        graph=relpath(read_field(obj, "graph", where, str), f"{where}.graph"),
        architecture=read_field(obj, "architecture", where, str),
        source=read_field(obj, "source", where, str, optional=True, default=""),
        precision=choice(read_field(obj, "precision", where, str), PRECISIONS, f"{where}.precision"),
        kv_dtype=choice(read_field(obj, "kv_dtype", where, str, optional=True, default="float32"), KV_DTYPES,
                         f"{where}.kv_dtype"),
        eos_token_ids=tuple(eos),
        data_files=tuple(data_files),
        tokenizer_sha256=read_field(obj, "tokenizer_sha256", where, str, optional=True, default=""),
        attention=choice(read_field(obj, "attention", where, str, optional=True, default="standard"), ATTENTIONS,
                          f"{where}.attention"),
        head_tokens=(relpath(h, f"{where}.head_tokens")
                     if (h := read_field(obj, "head_tokens", where, str, optional=True)) else None),
        head_size=read_field(obj, "head_size", where, int, optional=True, default=0),
        attention_windows=tuple(windows),
        io=_parse_io(io, f"{where}.io"),
        **ints,
    )


# A drafter name as the manifest may spell it. Which names exist is the runtime's registry's
# business (runtime.drafters); the format only refuses what could never be a name.
_DRAFTER_NAME = re.compile(r"[a-z][a-z0-9_-]{0,63}")


def _drafter_name(name: str) -> str:
    if not _DRAFTER_NAME.fullmatch(name):
        raise ManifestError(f"manifest field 'speculation.drafter' must be a drafter name (lower-case letters, "
                            f"digits, '-' or '_', at most 64), got {name!r}")
    return name


def parse_manifest(obj: Any) -> Manifest:
    """Validate a decoded manifest.json. Raises ManifestError naming the bad field."""
    if not isinstance(obj, dict):
        raise ManifestError("manifest.json must hold a JSON object")
    fmt = read_field(obj, "format", "", str)
    if fmt != FORMAT_NAME:
        raise ManifestError(f"manifest field 'format' must be {FORMAT_NAME!r}, got {fmt!r}: not a specedge bundle")
    version = read_field(obj, "format_version", "", int)
    if version != FORMAT_VERSION and version not in LEGACY_FORMAT_NOTES:
        readable = ", ".join(str(v) for v in sorted({FORMAT_VERSION, *LEGACY_FORMAT_NOTES}))
        raise ManifestError(f"manifest format_version {version} is not supported (this specedge reads "
                            f"versions {readable}); re-export the bundle with this version")
    models = read_field(obj, "models", "", dict)
    if "target" not in models:
        raise ManifestError("manifest field 'models.target' is missing")
    unknown = set(models) - set(ROLES)
    if unknown:
        raise ManifestError(f"manifest field 'models' has unknown entries {sorted(unknown)}; allowed: "
                            f"{', '.join(ROLES)}")
    target = _parse_model(models["target"], "models.target")
    draft = _parse_model(models["draft"], "models.draft") if models.get("draft") is not None else None

    tok = read_field(obj, "tokenizer", "", dict)
    tokenizer = TokenizerEntry(
        file=relpath(read_field(tok, "file", "tokenizer", str), "tokenizer.file"),
        config=relpath(c, "tokenizer.config") if (c := read_field(tok, "config", "tokenizer", str, optional=True)) else None,
        chat_template=(relpath(c, "tokenizer.chat_template")
                       if (c := read_field(tok, "chat_template", "tokenizer", str, optional=True)) else None),
        sha256=read_field(tok, "sha256", "tokenizer", str, optional=True, default=""),
        bos_token=read_field(tok, "bos_token", "tokenizer", str, optional=True),
        eos_token=read_field(tok, "eos_token", "tokenizer", str, optional=True),
        add_bos_token=read_field(tok, "add_bos_token", "tokenizer", bool, optional=True, default=False),
    )

    spec = read_field(obj, "speculation", "", dict, optional=True, default={})
    defaults = SpeculationDefaults()
    max_draft = read_field(spec, "max_draft_tokens", "speculation", int, optional=True, default=defaults.max_draft_tokens)
    if not 1 <= max_draft <= MAX_DRAFT_TOKENS:
        raise ManifestError(f"manifest field 'speculation.max_draft_tokens' must be in [1, {MAX_DRAFT_TOKENS}], "
                            f"got {max_draft}")
    draft_tokens = read_field(spec, "draft_tokens", "speculation", int, optional=True, default=min(defaults.draft_tokens,
                                                                                            max_draft))
    if not 0 <= draft_tokens <= max_draft:
        raise ManifestError(f"manifest field 'speculation.draft_tokens' must be in [0, max_draft_tokens={max_draft}],"
                            f" got {draft_tokens}")
    speculation = SpeculationDefaults(
        drafter=_drafter_name(read_field(spec, "drafter", "speculation", str, optional=True,
                                         default=defaults.drafter)),
        draft_tokens=draft_tokens,
        max_draft_tokens=max_draft,
        adaptive=read_field(spec, "adaptive", "speculation", bool, optional=True, default=defaults.adaptive),
    )


    files = {relpath(rel, f"files[{rel!r}]"): FileRecord.from_dict(meta, f"files[{rel!r}]")
             for rel, meta in read_field(obj, "files", "", dict).items()}
    # Every file the runtime reads needs a checksum, the chat template (rendered) included.
    referenced = [tokenizer.file] + [m.graph for m in (target, draft) if m] + \
                 [d for m in (target, draft) if m for d in m.data_files] + \
                 [m.head_tokens for m in (target, draft) if m and m.head_tokens] + \
                 ([tokenizer.chat_template] if tokenizer.chat_template else [])
    for rel in referenced:
        if rel not in files:
            raise ManifestError(f"manifest lists {rel!r} but has no sha256 for it in 'files'")

    if draft is not None:
        check_vocab_compatible(target, draft)

    return Manifest(
        target=target, draft=draft, tokenizer=tokenizer, speculation=speculation, files=files,
        created_by=read_field(obj, "created_by", "", str, optional=True, default=""),
        extra=ManifestExtra.from_dict(read_field(obj, "extra", "", dict, optional=True, default={})),
        format_version=version,
    )


def check_vocab_compatible(target: ModelEntry, draft: ModelEntry) -> None:
    """Draft tokens are target tokens: the vocabularies must be the same size."""
    if target.vocab_size != draft.vocab_size:
        raise VocabMismatchError(
            f"draft vocab_size {draft.vocab_size} differs from target vocab_size {target.vocab_size}: "
            "a draft must share the target's tokenizer")
    if target.tokenizer_sha256 and draft.tokenizer_sha256 and target.tokenizer_sha256 != draft.tokenizer_sha256:
        raise VocabMismatchError(
            f"draft tokenizer (sha256 {draft.tokenizer_sha256[:12]}…) differs from the target's "
            f"({target.tokenizer_sha256[:12]}…): the same ids would mean different text")


# --------------------------------------------------------------------------- files


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def resolve_inside(bundle: Path, rel: str) -> Path:
    """Return bundle/rel, refusing anything (symlinks included) that resolves outside the bundle."""
    relpath(rel, rel)
    try:
        root = bundle.resolve()
        path = (root / rel).resolve()
    except (OSError, RuntimeError) as exc:  # a symlink loop (RuntimeError before Python 3.13)
        raise UnsafePathError(f"bundle path {show(rel)} cannot be resolved ({exc.__class__.__name__}: "
                              "a symlink loop?)") from None
    if not path.is_relative_to(root):
        raise UnsafePathError(f"bundle path {rel!r} resolves to {path}, outside the bundle {root} (symlink?)")
    return path


def file_record(path: Path) -> FileRecord:
    return FileRecord(sha256_file(path), path.stat().st_size)


def load_head_tokens(bundle: Path, entry: ModelEntry) -> "np.ndarray | None":
    """The token ids of a truncated output layer: int32 [head_size], unique, inside the vocab."""
    if not entry.head_tokens:
        return None
    import numpy as np

    path = resolve_inside(Path(bundle), entry.head_tokens)
    ids = np.fromfile(path, dtype="<i4")
    if len(ids) != entry.head_size:
        raise ManifestError(f"{entry.head_tokens} holds {len(ids)} ids but head_size is {entry.head_size}")
    if len(ids) and (ids.min() < 0 or ids.max() >= entry.vocab_size or len(np.unique(ids)) != len(ids)):
        raise ManifestError(f"{entry.head_tokens} must hold unique token ids in [0, {entry.vocab_size})")
    return ids.astype(np.int64)


def load_manifest(bundle: str | os.PathLike[str], *, verify_checksums: bool = True) -> Manifest:
    """Read and validate ``bundle/manifest.json``.

    Checks that every file the manifest lists exists inside the bundle with the
    recorded size, and (unless ``verify_checksums=False``) the recorded sha256.
    No ONNX session is created here: callers validate everything first.
    """
    root = Path(bundle)
    if not root.exists():
        raise BundleError(f"bundle {root} does not exist")
    if not root.is_dir():
        raise BundleError(f"bundle {root} is not a folder (a bundle is the folder `specedge export` wrote)")
    mpath = root / MANIFEST_FILE
    if not mpath.is_file():
        raise BundleError(f"{root} has no {MANIFEST_FILE}: not a specedge bundle (create one with `specedge export`)")
    try:
        obj = json.loads(mpath.read_text(encoding="utf-8"))
    except ValueError as exc:  # bad UTF-8, bad JSON, or an int literal past Python's digit limit
        raise ManifestError(f"{mpath} is not valid JSON: {str(exc)[:200]}") from None
    except RecursionError:
        raise ManifestError(f"{mpath} is not a manifest: JSON nested too deeply") from None
    manifest = parse_manifest(obj)
    for rel, meta in manifest.files.items():
        path = resolve_inside(root, rel)
        try:
            is_file = path.is_file()
            size = path.stat().st_size if is_file else -1
        except OSError as exc:  # e.g. a name too long for the file system
            raise BundleError(f"bundle file {show(rel)} listed in the manifest cannot be read: "
                              f"{exc.strerror}") from None
        if not is_file:
            raise BundleError(f"bundle file {rel!r} listed in the manifest is missing from {root}")
        if size != meta.size:
            raise ChecksumError(f"bundle file {rel!r} is {size} bytes but the manifest records {meta.size} "
                                "(truncated or replaced); re-export the bundle")
        if verify_checksums:
            digest = sha256_file(path)
            if digest != meta.sha256:
                raise ChecksumError(f"bundle file {rel!r} has sha256 {digest[:16]}… but the manifest records "
                                    f"{meta.sha256[:16]}… (corrupt or tampered); re-export the bundle")
    check_graph_files(root, manifest)
    return manifest


# Initializers holding one row per position, as export/graph.py names them: the fused-GQA
# graph's rotary tables (``cos_cache``, and ``cos_cache.<n>`` for further rope tables) and GPT-2's
# learned position embeddings. A position past their rows fails inside ONNX Runtime
# mid-generation, so max_context must not exceed them.
POSITION_TABLES = ("cos_cache", "pos_embed")


def _position_table(name: str) -> str | None:
    """The POSITION_TABLES kind an initializer name is, or None."""
    base, _, suffix = name.partition(".")
    return base if base in POSITION_TABLES and (not suffix or suffix.isdigit()) else None


def check_graph_files(bundle: Path, manifest: Manifest) -> None:
    """Every file a graph makes ONNX Runtime open is one the manifest lists (and so checksums),
    and the graph has positions for the manifest's whole max_context.

    Reads each graph's protobuf for its tensors' external_data locations (graphfile.py); no
    weights are loaded. An unlisted location would let a file outside the integrity check
    (its bytes never hashed) supply weights.
    """
    for role, entry in manifest.models().items():
        facts = read_graph_facts(resolve_inside(bundle, entry.graph))
        folder = PurePosixPath(entry.graph.replace("\\", "/")).parent
        for location in sorted(facts.external_locations):
            where = f"{entry.graph}'s external_data location {show(location)}"
            if location.startswith(("/", "\\")) or (len(location) > 1 and location[1] == ":"):
                raise UnsafePathError(f"{where} is an absolute path; a bundle graph reads only files beside it")
            rel = relpath(str(folder / location.replace("\\", "/")), where)
            resolve_inside(bundle, rel)
            if rel not in entry.data_files:
                raise ChecksumError(f"{where} names {rel!r}, which models.{role}.data_files does not list, so no "
                                    "checksum covers it (tampered bundle?); re-export the bundle")
        for name, dims in facts.initializer_dims.items():
            table = _position_table(name)
            if table and dims and dims[0] < entry.max_context:
                raise ManifestError(f"manifest field 'models.{role}.max_context' is {entry.max_context} but "
                                    f"{entry.graph} was built for {dims[0]} positions (its {table!r} table); "
                                    f"lower max_context to at most {dims[0]} or re-export with --max-context")


def write_manifest(bundle: Path, manifest: Manifest) -> Path:
    path = bundle / MANIFEST_FILE
    path.write_text(json.dumps(manifest.to_json(), indent=2) + "\n", encoding="utf-8")
    return path
