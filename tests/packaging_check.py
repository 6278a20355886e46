"""What the built distributions must hold, and that every module of the installed wheel imports.

Used by .ci/run with the interpreter of a clean virtual environment that holds only the wheel
as the edge install, ``specedge[cpu]`` (no pytest, no other extra), from a folder outside the
source tree::

    python tests/packaging_check.py dist/specedge-X-py3-none-any.whl dist/specedge-X.tar.gz

and, for its pure checks, by tests/unit/test_packaging.py. Standard library only.

- the wheel: every file lies under ``specedge/`` or the dist-info folder; inside ``specedge/``
  only Python modules and the package data (the bench's prompts, ``bench/prompts/*.json``, and
  ``specedge eval``'s texts, ``quality/texts/*.txt``); the runtime,
  engines, export, cli, server, bench and quality packages are there; no tests, docs or results;
  the license is in the dist-info;
- the sdist: LICENSE, and the tests with the helpers they import (conftest.py, tiny_models.py,
  distribution.py, the numpy reference engine...), so its unit tests can run (.ci/run runs them
  against the installed wheel);
- the installed wheel: ``pkgutil.walk_packages`` over ``specedge`` imports every module.
  Modules that need an optional extra may fail only as listed in ``NEEDS_EXTRA``, and only
  because that extra's package is missing.
"""

from __future__ import annotations

import fnmatch
import importlib
import pkgutil
import sys
import tarfile
import zipfile
from pathlib import Path, PurePosixPath

# The subpackages the product promises (the wheel may hold more; setup.py discovers them).
REQUIRED_PACKAGES = ("runtime", "engines", "export", "cli", "server", "bench", "quality")
# Package data: the only non-Python files in the wheel, as globs relative to specedge/.
PACKAGE_DATA = ("bench/prompts/*.json", "quality/texts/*.txt", "export/calibration/*.txt")
# Modules that need an optional extra at import time: module -> the top-level package it needs.
# A package listed here cannot be imported, so its submodules are not walked either.
# Everything else must import with the edge install: the base dependencies (numpy, tokenizers,
# click, jinja2) and the cpu extra (onnxruntime).
NEEDS_EXTRA = {
    "specedge.export.graph": "onnx",  # [export]: builds ONNX graphs
    "specedge.export.families": "onnx",  # [export]: one graph builder per model family (the package)
    "specedge.export.features": "onnx",  # [export]: checks a checkpoint against the families
    "specedge.export.weights": "onnx",  # [export]
    "specedge.server.app": "starlette",  # [serve]
    "specedge.server.serving": "uvicorn",  # [serve]: runs the app
}
# What the sdist needs so that `python -m pytest` runs in it (tests/unit with the wheel alone: .ci/run).
SDIST_FILES = ("LICENSE", "README.md", "pyproject.toml", "setup.py", "tests/conftest.py", "tests/tiny_models.py",
               "tests/distribution.py", "tests/reference_engine.py", "tests/fetch_fakes.py", "tests/sigint.py")


def wheel_problems(names: list[str]) -> list[str]:
    """Problems with a wheel's file list (``zipfile.ZipFile.namelist()``); empty when it is right."""
    problems = []
    package = [PurePosixPath(n) for n in names if n.startswith("specedge/")]
    others = [n for n in names if not n.startswith("specedge/")]
    for name in others:
        top = name.split("/")[0]
        if not (top.startswith("specedge-") and top.endswith(".dist-info")):
            problems.append(f"{name}: outside specedge/ and the dist-info folder")
    for path in package:
        inner = str(path.relative_to("specedge"))
        if path.suffix == ".py" and "tests" not in path.parts:
            continue
        if any(fnmatch.fnmatch(inner, glob) for glob in PACKAGE_DATA):
            continue
        problems.append(f"{path}: neither a module nor package data ({', '.join(PACKAGE_DATA)})")
    present = {str(p.relative_to("specedge")) for p in package}
    for sub in REQUIRED_PACKAGES:
        if f"{sub}/__init__.py" not in present:
            problems.append(f"specedge/{sub}/__init__.py is missing")
    for glob in PACKAGE_DATA:
        if not any(fnmatch.fnmatch(p, glob) for p in present):
            problems.append(f"no package data matches specedge/{glob}")
    if not any(n.endswith(".dist-info/licenses/LICENSE") for n in others):
        problems.append("the dist-info holds no licenses/LICENSE")
    return problems


def sdist_problems(names: list[str]) -> list[str]:
    """Problems with an sdist's member list (``tarfile.TarFile.getnames()``); empty when it is right."""
    inner = {n.split("/", 1)[1] for n in names if "/" in n}
    problems = [f"{f} is missing" for f in SDIST_FILES if f not in inner]
    if not any(n.startswith("tests/unit/test_") and n.endswith(".py") for n in inner):
        problems.append("no tests/unit/test_*.py")
    problems += [f"{n}: benchmark results do not belong in the sdist" for n in sorted(inner)
                 if n.startswith("docs/results/")]
    return problems


def import_problems() -> list[str]:
    """Import every module of the installed ``specedge``; problems, empty when all import."""
    import specedge

    location = Path(specedge.__file__).resolve()
    if "site-packages" not in location.parts:
        return [f"specedge was imported from {location}, not from an installed wheel"]
    problems, imported = [], []
    for module in pkgutil.walk_packages(specedge.__path__, "specedge."):
        needs = NEEDS_EXTRA.get(module.name)
        try:
            importlib.import_module(module.name)
        except ModuleNotFoundError as exc:
            if needs is None or (exc.name or "").split(".")[0] != needs:
                problems.append(f"{module.name}: {exc!r}")
            continue
        except Exception as exc:  # any import-time failure is a packaging problem here
            problems.append(f"{module.name}: {exc!r}")
            continue
        imported.append(module.name)
        if needs is not None and needs not in sys.modules:
            problems.append(f"{module.name} imports without {needs}: remove it from NEEDS_EXTRA")
    stale = sorted(set(NEEDS_EXTRA) - {m.name for m in pkgutil.walk_packages(specedge.__path__, "specedge.")})
    problems += [f"NEEDS_EXTRA names {name}, which the wheel does not have" for name in stale]
    print(f"imported {len(imported)} modules; skipped for missing extras: "
          f"{sorted(set(NEEDS_EXTRA) - set(imported) - set(stale))}")
    return problems


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    wheel, sdist = argv
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
    with tarfile.open(sdist) as tf:
        members = tf.getnames()
    problems = ([f"wheel: {p}" for p in wheel_problems(names)] + [f"sdist: {p}" for p in sdist_problems(members)]
                + [f"import: {p}" for p in import_problems()])
    package_files = [n for n in names if n.startswith("specedge/")]
    print(f"wheel: {len(package_files)} files in specedge/ "
          f"({sum(n.endswith('.py') for n in package_files)} modules); sdist: {len(members)} members")
    for p in problems:
        print(f"PACKAGING PROBLEM: {p}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
