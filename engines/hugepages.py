"""Whether ONNX Runtime's packed weights can sit in transparent huge pages, and how to ask for them.

ONNX Runtime packs every MatMulNBits weight into memory it mallocs at session start, and a decode step
streams all of it; in 4 KB pages that is a TLB miss every 4 KB. With transparent huge pages in "madvise"
mode (the common default) glibc >= 2.35 asks for 2 MB pages for its large allocations when
GLIBC_TUNABLES=glibc.malloc.hugetlb=1 is set before the process starts. Measured (1-token target steps
in alternating processes, 2-core Xeon family 6 model 207, docs/results/2026-12-08-huge-pages.md):
Qwen2.5-Coder-1.5B int4 0.955x the step time (median of 4 pairs; earlier pairs 0.96-0.97x) for 10% more
resident memory; SmolLM2-135M fp32 no measurable gain (1.02x, noise) for 19% more. So it is a hint
(`specedge doctor`), not a default.
"""

from __future__ import annotations

import os
import platform
import re
from pathlib import Path
from typing import Any

HUGEPAGE_TUNABLE = "glibc.malloc.hugetlb=1"
THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def hugepages(enabled: Path = THP_ENABLED, environ: dict | None = None,
              libc: tuple[str, str] | None = None) -> dict[str, Any]:
    """Transparent huge pages: the kernel's mode (always / madvise / never; None where unknown), whether
    glibc's malloc is told to use them (GLIBC_TUNABLES), and whether this glibc can (>= 2.35)."""
    environ = os.environ if environ is None else environ
    try:
        mode = re.search(r"\[(\w+)\]", enabled.read_text()).group(1)
    except (OSError, AttributeError):
        mode = None
    name, version = libc if libc is not None else platform.libc_ver()
    try:
        capable = name == "glibc" and tuple(int(x) for x in version.split(".")[:2]) >= (2, 35)
    except ValueError:
        capable = False
    tunables = environ.get("GLIBC_TUNABLES", "")
    return {"thp_mode": mode, "malloc_tunable": HUGEPAGE_TUNABLE in tunables.split(":"), "glibc_can": capable}


def describe(facts: dict[str, Any]) -> str:
    """One line for reports: the kernel's mode and whether malloc's large allocations get huge pages."""
    if not facts.get("thp_mode"):
        return "unknown"
    used = facts["thp_mode"] == "always" or (facts["thp_mode"] == "madvise" and facts["malloc_tunable"]
                                             and facts["glibc_can"])
    return f"transparent {facts['thp_mode']}; malloc uses them: {'yes' if used else 'no'}"
