"""What specedge's cache holds and how much disk each item uses; removing items.

Three kinds of item live under the cache folder (export/fetch.py ``cache_dir``):
``models/<name>/`` (a fetched catalog model), ``converted/<gguf stem>-<key>/`` (the
fp32 safetensors copy of a GGUF file that ``specedge export --keep-converted`` keeps; it is
often several times the GGUF's size) and ``tune/<source>-<role>-<key>.json`` (one export's
block-size measurements, kept so that a stopped ``export --tune`` resumes: export/tune_saved.py;
a few KB each). Standard library only.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from ..errors import InvalidParameterError
from .fetch import cache_dir
from .measure import folder_bytes

KINDS = ("model", "converted", "tune")
_FOLDERS = {"model": "models", "converted": "converted", "tune": "tune"}


@dataclass(frozen=True)
class CacheItem:
    kind: str  # "model" | "converted" | "tune"
    name: str  # the catalog name, the converted folder's name, or the tune file's name without ".json"
    path: Path
    bytes: int  # disk its files use


def cache_items(cache: Path | None = None) -> list[CacheItem]:
    """Every item in the cache, models first, each kind sorted by name."""
    cache = cache_dir() if cache is None else cache
    items = []
    for kind in KINDS:
        folder = cache / _FOLDERS[kind]
        if not folder.is_dir():
            continue
        for path in sorted(folder.iterdir()):
            if path.is_symlink():
                continue
            if kind == "tune":  # ".NAME.partial-PID-..." is a write in progress (or one a killed run left)
                if path.is_file() and path.suffix == ".json" and not path.name.startswith("."):
                    items.append(CacheItem(kind, path.stem, path, path.stat().st_size))
            elif path.is_dir():
                items.append(CacheItem(kind, path.name, path, folder_bytes(path)))
    return items


def clean_cache(name: str | None = None, cache: Path | None = None) -> list[CacheItem]:
    """Remove the cache item(s) called ``name`` (a model name, a converted folder's or a tune file's name),
    every item of a kind for ``name`` "converted" or "tune", or everything for None; return what was removed.

    An unknown name is refused (nothing is removed), so a typo never reads as a clean cache.
    """
    items = cache_items(cache)
    if name is None:
        chosen = items
    elif name in ("converted", "tune"):
        chosen = [i for i in items if i.kind == name]
    else:
        chosen = [i for i in items if i.name == name]
        if not chosen:
            known = ", ".join(i.name for i in items) or "the cache is empty"
            raise InvalidParameterError(f"no cached item is called {name!r} ({known})")
    for item in chosen:
        # Renamed aside first, so a folder half-deleted by an interrupt is never taken for a complete one.
        doomed = item.path.with_name(f".{item.path.name}.removing-{os.getpid()}")
        os.replace(item.path, doomed)
        if doomed.is_dir():
            shutil.rmtree(doomed, ignore_errors=True)
        else:  # a tune file
            doomed.unlink(missing_ok=True)
    return chosen
