"""Readers for untrusted JSON fields: the primitives every part of the bundle schema parses with.

The manifest (manifest.py), its typed extras (extra.py) and anything else that reads a
bundle's JSON use these, so a bad field gets the same message wherever it sits:
``manifest field '<dotted.path>' must be ...``, raised as :class:`~specedge.errors.ManifestError`
(a :class:`~specedge.errors.BundleError`), or :class:`~specedge.errors.UnsafePathError` for a path
that could leave the bundle.

Imports neither torch nor onnxruntime nor numpy.
"""

from __future__ import annotations

import math
import reprlib
from pathlib import PurePosixPath
from typing import Any

from ..errors import ManifestError, UnsafePathError

# Integer fields are counts and sizes: anything past int64 is garbage, and past ~4300 digits
# Python cannot even print it (str(int) raises ValueError), so it is refused before any message.
MAX_INT_BITS = 63
# Error messages quote untrusted values: bounded in nesting and length (a plain repr() of a
# 5000-deep list raises RecursionError).
_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother = 3, 60, 60

# Bounds of the bundle schema (one definition: the exporter, the options and the parsers use these).
MAX_CONTEXT = 1 << 20  # the largest max_context a bundle may declare (it sizes a preallocated KV cache)
# The largest draft length a bundle may declare: a verify of 65 tokens is far past any measured gain.
MAX_DRAFT_TOKENS = 64
ROLES = ("target", "draft")  # the models a bundle may hold, as manifest keys


def show(value: Any) -> str:
    """A short repr of an untrusted value for an error message."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > MAX_INT_BITS:
        return f"<{value.bit_length()}-bit integer>"
    return _REPR.repr(value)


def dotted(where: str, key: str) -> str:
    """The dotted field path of ``key`` inside ``where`` ('' is the document's top level)."""
    return f"{where}.{key}" if where else key


def read_field(obj: dict[str, Any], key: str, where: str, kind: type | tuple[type, ...], *, optional: bool = False,
               default: Any = None) -> Any:
    """Fetch ``obj[key]`` and check its type; errors name the dotted field path.

    ``optional``: a missing key or JSON null gives ``default``. An int field refuses true/false
    (bool is an int subclass) and integers past 64 bits.
    """
    name = dotted(where, key)
    if key not in obj:
        if optional:
            return default
        raise ManifestError(f"manifest field '{name}' is missing")
    value = obj[key]
    if value is None and optional:
        return default
    return check_type(value, name, kind)


def check_type(value: Any, name: str, kind: type | tuple[type, ...]) -> Any:
    """``value`` if it is a ``kind``, else ManifestError naming field ``name``."""
    if kind is int or (isinstance(kind, tuple) and int in kind and bool not in kind):
        if isinstance(value, bool):
            raise ManifestError(f"manifest field '{name}' must be an integer, got {value!r}")
    if not isinstance(value, kind):
        want = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise ManifestError(f"manifest field '{name}' must be {want}, got {type(value).__name__} {show(value)}")
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > MAX_INT_BITS:
        raise ManifestError(f"manifest field '{name}' must fit in 64 bits, got {show(value)}")
    return value


def refuse_unknown(obj: dict[str, Any], allowed: tuple[str, ...] | frozenset[str], where: str) -> None:
    """ManifestError naming the first key of ``obj`` that is not in ``allowed``."""
    unknown = sorted(str(k) for k in obj if k not in allowed)
    if unknown:
        raise ManifestError(f"manifest field '{dotted(where, unknown[0])}' is not part of the schema "
                            f"(allowed in '{where or 'manifest'}': {', '.join(sorted(allowed))})")


def positive(value: int, name: str) -> int:
    if value < 1:
        raise ManifestError(f"manifest field '{name}' must be >= 1, got {value}")
    return value


def choice(value: str, allowed: tuple[str, ...], name: str) -> str:
    if value not in allowed:
        raise ManifestError(f"manifest field '{name}' must be one of {', '.join(allowed)}; got {value!r}")
    return value


def finite(value: Any, name: str, *, positive: bool = False) -> float:
    """A JSON number that is finite and >= 0 (> 0 with ``positive``), as a float."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value < 0 or (positive and value == 0):
        raise ManifestError(f"manifest field '{name}' must be a finite number {'> 0' if positive else '>= 0'}, "
                            f"got {show(value)}")
    return float(value)


def relpath(value: str, name: str) -> str:
    """Refuse paths that could leave the bundle before touching the file system."""
    if not value or "\x00" in value:
        raise UnsafePathError(f"manifest field '{name}' is an empty or invalid path")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate ("\ud800" in the JSON): no file system can name it
        raise UnsafePathError(f"manifest field '{name}' is not a valid UTF-8 path: {show(value)}") from None
    if value.startswith(("/", "\\")) or (len(value) > 1 and value[1] == ":"):
        raise UnsafePathError(f"manifest field '{name}' is an absolute path ({value!r}); bundle paths are relative")
    parts = PurePosixPath(value.replace("\\", "/")).parts
    if ".." in parts:
        raise UnsafePathError(f"manifest field '{name}' ({value!r}) contains '..' and would leave the bundle")
    return value


def optional_relpath(obj: dict[str, Any], key: str, where: str) -> str:
    """A bundle-relative path field that may be absent or "" (then "")."""
    value = read_field(obj, key, where, str, optional=True, default="")
    return relpath(value, dotted(where, key)) if value else ""


def string_map(obj: Any, name: str) -> dict[str, str]:
    """A JSON object whose values are all strings."""
    check_type(obj, name, dict)
    for key, value in obj.items():
        if not isinstance(value, str):
            raise ManifestError(f"manifest field '{name}.{key}' must be str, got {type(value).__name__} "
                                f"{show(value)}")
    return dict(obj)
