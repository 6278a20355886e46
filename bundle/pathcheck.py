"""Names the file system will take, checked before a command reads a file or starts minutes of work.

Linux refuses a path component longer than NAME_MAX (255 bytes on ext4, xfs, btrfs and tmpfs) or a
path longer than PATH_MAX with ENAMETOOLONG. Callers ask :func:`name_problem` first, so their typed
error names the component (and its length) instead of an ``OSError`` surfacing from deep inside,
after the work. Imports nothing from specedge: export/ and runtime/ both use it.
"""

from __future__ import annotations

import os
from pathlib import Path

DEFAULT_NAME_MAX = 255  # POSIX file systems' usual limit, when pathconf cannot tell
DEFAULT_PATH_MAX = 4096  # Linux's


def _limit(path: Path, name: str, default: int) -> int:
    """``os.pathconf(name)`` of the nearest existing folder at or above ``path``."""
    for folder in (path, *path.parents):
        try:
            return os.pathconf(folder, name)
        except (OSError, ValueError):  # missing, too long, or a name pathconf does not know here
            continue
    return default


def name_problem(path: Path, *, reserve: int = 0) -> str | None:
    """Why ``path`` cannot be named on this file system, or None.

    A component longer than NAME_MAX bytes (the last one counted ``reserve`` bytes longer: the
    suffix of a temporary sibling the caller writes first and renames), or the whole path longer
    than PATH_MAX. The message names the component by its first characters and gives both lengths.
    """
    path = Path(os.path.abspath(path))
    name_max = _limit(path.parent, "PC_NAME_MAX", DEFAULT_NAME_MAX)
    parts = path.parts[1:]  # the root "/" has no length to check
    for i, part in enumerate(parts):
        extra = reserve if i == len(parts) - 1 else 0
        size = len(os.fsencode(part))
        if size + extra > name_max:
            shown = f"{part[:24]}…" if len(part) > 24 else part
            room = f" (plus {extra} for its temporary sibling)" if extra else ""
            return f"the name {shown!r} is {size} bytes{room}; this file system allows {name_max}"
    path_max = _limit(path.parent, "PC_PATH_MAX", DEFAULT_PATH_MAX)
    size = len(os.fsencode(str(path))) + reserve
    if size >= path_max:  # PATH_MAX counts the terminating NUL
        return f"the path is {size} bytes long; this file system allows {path_max - 1}"
    return None
