"""Package discovery for the layout where the repository root is the ``specedge`` package.

pyproject.toml maps ``specedge`` to the root (``package-dir = {specedge = "."}``) so that the
top level reads ``export/ runtime/ engines/ cli/ tests/``. setuptools' own ``packages.find``
names what it finds relative to ``where`` (``runtime``, not ``specedge.runtime``) and cannot
add the prefix, so the discovery lives here: every folder under the root that has an
``__init__.py`` becomes ``specedge.<folder>``. Nothing is listed by hand, so a new subpackage
cannot silently drop out of the wheel (tests/unit/test_packaging.py checks this).

Folders without ``__init__.py`` (tests/, docs/, a virtual environment, build/) are never
packages; ``EXCLUDED`` keeps tests and docs out even if one gains an ``__init__.py``.
This script sits in the root package's folder, so ``BuildPy`` keeps it out of the wheel.
"""

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

EXCLUDED = ("tests", "tests.*", "docs", "docs.*", "build", "build.*", "dist", "dist.*")


def specedge_packages(root: str = ".") -> list[str]:
    """``["specedge", "specedge.bench", ...]``: the root package and every subpackage under it."""
    return ["specedge", *(f"specedge.{name}" for name in sorted(find_packages(root, exclude=EXCLUDED)))]


class BuildPy(build_py):
    """build_py without ``specedge/setup.py``: under PEP 517 builds setuptools does not
    recognise this script as the setup script and would ship it as a module."""

    def find_package_modules(self, package, package_dir):
        return [(pkg, module, path) for pkg, module, path in super().find_package_modules(package, package_dir)
                if (pkg, module) != ("specedge", "setup")]


if __name__ == "__main__":
    setup(packages=specedge_packages(), cmdclass={"build_py": BuildPy})
