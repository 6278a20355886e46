"""Checks an export runs before it loads anything: where ``--out`` goes, and whether each source can be read.

An export takes seconds to minutes (loading, graph building, validation, tuning), and it writes
the bundle last. Every reason the final rename would fail is checked here first, with an
ExportError naming the path, so a bad ``--out`` or a broken source file costs nothing:

- ``--out`` is resolved through symlinks. A symlink, dangling or not, names where the bundle goes:
  the bundle is written at its target (the way ``cp`` and a shell's ``>`` treat a dangling link),
  and the temporary folder beside the target, so the final rename stays on one file system and the
  link keeps pointing at the bundle. A symlink loop is refused.
- Every component's name fits NAME_MAX, with room for the temporary sibling's suffix.
- The folder the bundle goes in, or its nearest existing ancestor (missing folders are created),
  is a folder (``--out FILE/sub`` is refused), is not on a kernel pseudo-file system (/proc,
  /sys, /dev...), and takes a new folder: a write probe (a folder created and removed), the only
  honest check against permissions, read-only mounts and immutable folders alike, for root too.
- A source path exists; a source file is a GGUF whose fixed header is whole and plausible
  (a catalog name is fetched later, by the loader).
"""

from __future__ import annotations

import os
import struct
import tempfile
from pathlib import Path

from ..errors import ExportError
from ..bundle.pathcheck import name_problem

# Kernel pseudo-file systems: their folders refuse new files (proc, sysfs) or hold device nodes and
# kernel state in memory (devtmpfs, cgroup...); a bundle never belongs there, even where root may write.
PSEUDO_FILESYSTEMS = frozenset({
    "proc", "sysfs", "devtmpfs", "devpts", "cgroup", "cgroup2", "debugfs", "tracefs", "securityfs", "configfs",
    "bpf", "pstore", "efivarfs", "fusectl", "mqueue", "binfmt_misc", "autofs", "hugetlbfs", "rpc_pipefs", "nsfs"})
GGUF_MAGIC = b"GGUF"
GGUF_VERSIONS = (1, 2, 3)  # llama.cpp's GGUF format versions (1 has 32-bit counts)
# A GGUF's fixed header: magic, version, tensor count, metadata count (64-bit counts from version 2).
_GGUF_HEADER = struct.Struct("<4sIQQ")
# The smallest tensor-info and key/value records a GGUF can hold: a count above file size / this is a lie.
_GGUF_MIN_RECORD = 8


def temporary_suffix_bytes() -> int:
    """Bytes the export's temporary siblings add to ``--out``'s name: ``.NAME.partial-PID``."""
    return len(f"..partial-{os.getpid()}")


def check_out(out: Path) -> Path:
    """The absolute, symlink-free path the bundle will be written to; ExportError when it cannot be.

    Creates nothing that outlives the call (the write probe's folder is removed at once)."""
    problem = name_problem(out, reserve=temporary_suffix_bytes())
    if problem:
        raise ExportError(f"--out refused: {problem}")
    try:
        resolved = Path(out).resolve()
    except (RuntimeError, OSError) as exc:  # a symlink loop (RuntimeError before Python 3.13)
        raise ExportError(f"--out {out}: cannot resolve it ({exc})") from None
    if resolved != Path(os.path.abspath(out)):
        problem = name_problem(resolved, reserve=temporary_suffix_bytes())
        if problem:
            raise ExportError(f"--out {out} is a symlink to a path that cannot be created: {problem}")
    if resolved.parent == resolved:
        raise ExportError(f"--out {out} is the file system's root; name a folder to create")
    folder = resolved.parent
    while True:  # the nearest existing ancestor: missing folders are created by the export
        try:
            is_dir = folder.is_dir()
            exists = is_dir or folder.exists()
        except OSError as exc:
            raise ExportError(f"--out {out}: cannot look at {folder} ({exc.strerror or exc})") from None
        if exists and not is_dir:
            raise ExportError(f"--out {out}: {folder} is a file, not a folder")
        if exists:
            break
        folder = folder.parent
    fstype = _filesystem_type(folder)
    if fstype in PSEUDO_FILESYSTEMS:
        raise ExportError(f"--out {out}: {folder} is on a {fstype} file system (kernel state, not storage); "
                          "choose a folder on a disk")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=f".{resolved.name[:32]}.probe-", dir=folder))
    except OSError as exc:
        raise ExportError(f"--out {out}: cannot write in {folder} ({exc.strerror or exc})") from None
    return resolved


def _filesystem_type(folder: Path) -> str | None:
    """The type of the file system holding ``folder`` (from /proc/self/mounts; None off Linux)."""
    try:
        lines = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return None
    best, fstype = "", None
    text = str(folder)
    for line in lines:
        fields = line.split()
        if len(fields) < 3:
            continue
        # mounts escapes space, tab, newline and backslash in octal
        point = fields[1].replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n").replace("\\134", "\\")
        inside = text == point or text.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):  # the last of equal mount points is the visible one
            best, fstype = point, fields[2]
    return fstype


def check_source(src: str, role: str) -> None:
    """ExportError when source ``src`` (``--target`` or ``--draft``) cannot be what the loader reads:
    a missing path, a file that is not a GGUF, a GGUF whose header is cut short or implausible.
    A catalog name passes (fetched later); so does a folder (its files are the loader's to judge)."""
    from .catalog import CATALOG

    if src in CATALOG:
        return
    path = Path(src).expanduser()
    problem = name_problem(path)
    if problem:
        raise ExportError(f"--{role} refused: {problem}")
    try:
        is_file, exists = path.is_file(), path.exists()
    except OSError as exc:
        raise ExportError(f"--{role} {src}: {exc.strerror or exc}") from None
    if not exists:
        raise ExportError(f"source {src!r} (--{role}) is neither an existing path nor a catalog model "
                          f"({', '.join(CATALOG)})")
    if not is_file:
        return
    if path.suffix != ".gguf":
        raise ExportError(f"--{role} {path} is a file but not a .gguf; pass a GGUF file or an HF folder")
    check_gguf_header(path)


def check_gguf_header(path: Path) -> None:
    """ExportError naming ``path`` unless it starts with a whole, plausible GGUF header."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(_GGUF_HEADER.size)
    except OSError as exc:
        raise ExportError(f"cannot read GGUF file {path}: {exc.strerror or exc}") from None
    if head[:4] != GGUF_MAGIC:
        raise ExportError(f"{path} is not a GGUF file (it does not start with {GGUF_MAGIC!r})")
    if len(head) < 8:
        raise ExportError(f"GGUF file {path} is truncated: {size} bytes, shorter than its header")
    version = int.from_bytes(head[4:8], "little")
    if version not in GGUF_VERSIONS:
        raise ExportError(f"GGUF file {path} declares format version {version}; GGUF versions are "
                          f"{', '.join(map(str, GGUF_VERSIONS))}: corrupt or not a GGUF")
    if version == 1:  # 32-bit counts
        if len(head) < 16:
            raise ExportError(f"GGUF file {path} is truncated: {size} bytes, shorter than its header")
        tensors, entries = struct.unpack_from("<II", head, 8)
    else:
        if len(head) < _GGUF_HEADER.size:
            raise ExportError(f"GGUF file {path} is truncated: {size} bytes, shorter than its "
                              f"{_GGUF_HEADER.size}-byte header")
        _, _, tensors, entries = _GGUF_HEADER.unpack(head)
    if tensors == 0 or (tensors + entries) * _GGUF_MIN_RECORD > size:
        raise ExportError(f"GGUF file {path} declares {tensors} tensors and {entries} metadata entries, which "
                          f"{size} bytes cannot hold: truncated or corrupt")
