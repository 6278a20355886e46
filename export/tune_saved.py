"""Tuning measurements kept between runs of ``specedge export --tune``, so that a stopped tuning resumes.

Issue #38: a Ctrl-C during ``--tune`` keeps what was measured (export/tune.py), and the same export
run again measures only the block sizes still missing. What a tuning measured (export/tune.py
:class:`~specedge.export.tune.Measurements`: the fp32 greedy reference, then each candidate's
:class:`~specedge.bundle.extra.BlockCandidate`) is written as soon as each part is taken, to
``<cache>/tune/<source>-<role>-<digest>.json`` (the cache of export/fetch.py ``cache_dir``, so
``$SPECEDGE_CACHE`` moves it too; ``specedge fetch --list`` shows these files and ``specedge fetch
--clean tune`` removes them).

A measurement is reused only under the :class:`TuneKey` it was taken with: everything that changes
the graphs measured or how they were measured. The source checkpoint is named by its files'
identities (size, mtime, ctime, inode: export/fetch.py ``file_identity``), not by a hash of its
weights: hashing a 30 GB checkpoint would cost minutes on every run, and a file rewritten in place
gets a new ctime whatever its mtime says. The key is stored in full and compared on reading: a file
that is unreadable, malformed, too large, of another format or for another key is ignored with a
note and measured again, never trusted and never fatal. JSON only, no pickle.

Standard library, bundle/ and export/tune.py only (the versions in the key are read from the
packages the export has already imported).
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

from ..bundle.extra import BlockCandidate, MachineFingerprint
from ..errors import ManifestError
from .tune import Measurements

FOLDER = "tune"  # under the cache folder
FORMAT = 1  # the file's layout; a file of another format is ignored (measured again)
# A saved file holds a key, the fp32 references (5 x 64 token ids) and a few candidates: about 4 KB.
# Anything far larger is not one of ours, and is not read into memory.
MAX_BYTES = 1 << 16
_LABEL_CHARS = 48  # of the source's name in the file name (the digest makes the name unique)


@dataclass(frozen=True)
class TuneKey:
    """What a block-size measurement depends on; a saved one is reused only under an equal key."""

    source: tuple[tuple[str, ...], ...]  # (file name, *file_identity) of each file of the source checkpoint
    role: str  # "target" or "draft"
    bits: int  # 4 or 8
    mix: str  # the quant mix (export/mixquant.py MIXES), "rtn-sym8" at int8
    accuracy_level: int  # MatMulNBits compute precision: changes both speed and agreement
    max_context: int  # the graphs' KV size and the calibration prompts' room
    attention: str  # the graph's attention ops ("gqa" or "standard")
    layers: int  # the graph's layers (a self-draft's --draft-layers keeps fewer)
    head: str  # sha256 of a vocabulary-truncated head's token ids (--draft-vocab), "" for the whole vocabulary
    prompts: str  # sha256 of the calibration prompts' token ids (the tokenizer's reading of them)
    max_verify: int  # the longest verify the exactness check covers (max_draft_tokens + 1)
    step_rows: int  # 2: exact 2-row steps timed (a target with --exact); 1: fast mode's and a draft's 1-row steps
    machine: MachineFingerprint  # CPU model, extensions, cores, and the timing sessions' threads
    method: str  # export/tune.py's measurement settings (tune.METHOD)
    versions: str  # specedge, onnxruntime, transformers: the graph builder, the kernels, a GGUF's dequantization

    def to_dict(self) -> dict[str, Any]:
        """The key as JSON data (lists for tuples), what the file stores and what reading compares."""
        return json.loads(json.dumps(asdict(self) | {"machine": self.machine.to_dict()}))

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()


def source_identity(origin: Path) -> tuple[tuple[str, ...], ...]:
    """``(name, size, mtime_ns, ctime_ns, inode)`` of a GGUF file, or of every file directly in an HF
    folder (config, weights, tokenizer), sorted by name; symlinks (a hub snapshot's) are followed."""
    from .fetch import file_identity

    files = [origin] if origin.is_file() else sorted(p for p in origin.iterdir() if p.is_file())
    return tuple((p.name, *file_identity(p.stat())) for p in files)


def digest_of(data: Any) -> str:
    """sha256 of JSON data (token id lists, for :attr:`TuneKey.prompts` and :attr:`TuneKey.head`)."""
    return hashlib.sha256(json.dumps(data).encode()).hexdigest()


def library_versions() -> str:
    """The versions :attr:`TuneKey.versions` records (the export has imported these packages already)."""
    import onnxruntime
    import transformers

    from .. import __version__

    return f"specedge {__version__}, onnxruntime {onnxruntime.__version__}, transformers {transformers.__version__}"


@dataclass(frozen=True)
class SavedTuning:
    """The file of one export's saved measurements (module docstring)."""

    path: Path
    key: TuneKey

    @classmethod
    def in_cache(cls, key: TuneKey, label: str, cache: Path | None = None) -> "SavedTuning":
        """Where ``key``'s measurements live: ``<cache>/tune/<label>-<role>-<digest>.json``; ``label`` names
        the source for a person reading ``fetch --list`` (characters a file name may not hold are replaced)."""
        from .fetch import cache_dir

        name = re.sub(r"[^A-Za-z0-9._-]", "_", label)[:_LABEL_CHARS].lstrip(".") or "model"
        root = cache_dir() if cache is None else cache
        return cls(root / FOLDER / f"{name}-{key.role}-{key.digest()[:16]}.json", key)

    def load(self, note: Callable[[str], None]) -> Measurements:
        """What was saved; nothing (an empty Measurements) when there is no file or it cannot be trusted
        (``note`` says why)."""
        try:
            if self.path.stat().st_size > MAX_BYTES:
                return self._ignored(note, f"larger than {MAX_BYTES} bytes")
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return Measurements()
        except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
            return self._ignored(note, f"unreadable ({type(exc).__name__})")
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            return self._ignored(note, f"not a format-{FORMAT} tuning file")
        if data.get("key") != self.key.to_dict():
            return self._ignored(note, "measured for another source, export option, machine or version")
        raw, references = data.get("candidates"), data.get("references", [])  # none yet: measured again
        if not isinstance(raw, list):
            return self._ignored(note, "no candidate list")
        if not isinstance(references, list) or not all(
                isinstance(r, list) and all(type(t) is int and t >= 0 for t in r) for r in references):
            return self._ignored(note, "the fp32 references are not lists of token ids")
        measured: dict[int, BlockCandidate] = {}
        try:
            for i, item in enumerate(raw):
                candidate = BlockCandidate.from_dict(item, f"candidates[{i}]")
                if candidate.block_size in measured:
                    return self._ignored(note, f"block {candidate.block_size} listed twice")
                measured[candidate.block_size] = candidate
        except (ManifestError, TypeError, ValueError) as exc:  # the schema's readers raise the first
            return self._ignored(note, str(exc).replace("manifest field", "field"))
        return Measurements(tuple(tuple(r) for r in references), measured)

    def save(self, measured: Measurements, note: Callable[[str], None]) -> None:
        """Write ``measured`` (everything measured so far) in place of the file, atomically: a reader, or a
        run killed mid-write, sees the old file or the new one. A failure to write is a note, not an error."""
        data = {"format": FORMAT, "key": self.key.to_dict(), "references": [list(r) for r in measured.references],
                "candidates": [measured.candidates[b].to_dict() for b in sorted(measured.candidates)]}
        tmp = None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._remove_stale_partials()
            fd, name = tempfile.mkstemp(prefix=f".{self.path.name}.partial-{os.getpid()}-", dir=self.path.parent)
            tmp = Path(name)
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(data, f, indent=1)
            os.chmod(tmp, 0o644)  # mkstemp makes 0600; the cache's other files are readable
            os.replace(tmp, self.path)
            tmp = None
        except OSError as exc:
            note(f"tune: could not save the measurements to {self.path} ({exc.strerror or exc}); "
                 "a stopped tuning will measure them again")
        finally:
            if tmp is not None:  # an error or a Ctrl-C before the rename
                tmp.unlink(missing_ok=True)

    def _remove_stale_partials(self) -> None:
        """Remove the temporary copies that killed runs (SIGKILL mid-write) left beside the file."""
        from .leftovers import is_stale, pid_after

        prefix = f".{self.path.name}.partial-"
        for path in self.path.parent.glob(f"{glob.escape(prefix)}*"):
            if is_stale(path, pid_after(path.name, prefix)):
                path.unlink(missing_ok=True)

    def _ignored(self, note: Callable[[str], None], why: str) -> Measurements:
        note(f"tune: ignoring the saved measurements in {self.path}: {why}; measuring again")
        return Measurements()
