"""The layers import downwards only: bundle (the format) <- engines <- runtime <- export, cli, server, bench.

Read from the source with ``ast`` (nothing is imported): a module-level or function-level import of a
higher layer from a lower one fails here with the file and line.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# For each layer, the specedge subpackages it must never import.
FORBIDDEN = {
    "bundle": {"runtime", "engines", "export", "cli", "server", "bench", "quality"},
    "engines": {"runtime", "export", "cli", "server", "bench", "quality"},
    "runtime": {"export", "cli", "server", "bench", "quality"},
}


def _imported_subpackages(source: str, package: tuple[str, ...]) -> list[tuple[int, str]]:
    """(line, first subpackage under specedge) of every specedge import in ``source``, a module of
    ``package`` (``("runtime", "policies")`` for runtime/policies/x.py), relative imports resolved."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.level:
            if node.level - 1 > len(package):
                continue  # above the package root: not specedge's
            parts = [*package[:len(package) - (node.level - 1)], *(node.module or "").split(".")]
            parts = [p for p in parts if p]
            found += [(node.lineno, parts[0])] if parts else [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("specedge"):
            parts = node.module.split(".")[1:]
            found += [(node.lineno, parts[0])] if parts else [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name.split(".")[1]) for a in node.names if a.name.startswith("specedge.")]
    return found


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_a_layer_imports_no_higher_layer(layer):
    wrong = [f"{path.relative_to(ROOT)}:{line} imports specedge.{sub}"
             for path in sorted((ROOT / layer).rglob("*.py"))
             for line, sub in _imported_subpackages(path.read_text(encoding="utf-8"),
                                                    path.relative_to(ROOT).parent.parts)
             if sub in FORBIDDEN[layer]]
    assert not wrong, "\n".join(wrong)


def test_the_package_root_keeps_only_its_entry_points():
    """The root holds __init__, errors and the public client; the bundle format lives in bundle/."""
    modules = sorted(p.name for p in ROOT.glob("*.py"))
    assert modules == ["__init__.py", "client.py", "errors.py", "setup.py"]


def test_the_resolver_sees_relative_and_absolute_imports():
    """The checker itself: it must notice the imports it exists to forbid."""
    source = ("from ..runtime import loop\nfrom specedge.cli import main\nimport specedge.server.app\n"
              "from . import extra\nfrom ...export.graph import build\nfrom specedge import bench\nimport numpy\n")
    assert [sub for _, sub in _imported_subpackages(source, ("bundle",))] == ["runtime", "cli", "server", "bundle",
                                                                              "bench"]
    assert [sub for _, sub in _imported_subpackages(source, ("runtime", "policies"))][4] == "export"
