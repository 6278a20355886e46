"""Invariant: packaging cannot silently drop code, and CI runs what the README says.

- every folder under the repository root that holds an ``__init__.py`` (outside tests/, docs/
  and hidden or build folders) is a package setup.py hands to setuptools, as ``specedge.<path>``;
  nothing is listed by hand;
- the package data globs match files that exist;
- tests/packaging_check.py, which .ci/run applies to the built wheel and sdist, accepts a right
  file list and names each kind of wrong one (tests, results, docs, a missing subpackage,
  missing prompt data, a missing license, an sdist without its test helpers);
- .ci/run runs the README's test command verbatim, and that command puts its venv outside
  the package folder; it also runs the sdist's tests/unit against the wheel in the edge venv.

The wheel itself is built, installed in a clean venv and imported module by module in .ci/run.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

import packaging_check

ROOT = Path(__file__).resolve().parents[2]  # tests/unit/ -> the repository root


def _setup_module():
    pytest.importorskip("setuptools")  # setup.py's discovery; a venv of Python >= 3.12 has no setuptools
    spec = importlib.util.spec_from_file_location("specedge_setup", ROOT / "setup.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # setup() itself runs only under __main__
    return module


def _package_folders() -> set[str]:
    """Dotted names of the folders under the root that hold an __init__.py, walked independently
    of setuptools; folders inside a non-package folder are not importable and do not count."""
    found = set()

    def walk(folder: Path, prefix: str) -> None:
        for child in sorted(folder.iterdir()):
            if not child.is_dir() or child.name.startswith(".") or child.name in {"tests", "docs", "build", "dist"}:
                continue
            if (child / "__init__.py").is_file() and child.name.isidentifier():
                found.add(prefix + child.name)
                walk(child, prefix + child.name + ".")

    walk(ROOT, "specedge.")
    return found


def test_every_package_folder_is_discovered_and_nothing_else():
    packages = _setup_module().specedge_packages(str(ROOT))
    assert packages[0] == "specedge"
    assert set(packages[1:]) == _package_folders()
    assert {f"specedge.{name}" for name in packaging_check.REQUIRED_PACKAGES} <= set(packages)
    assert not any(p.split(".")[1] in {"tests", "docs"} for p in packages[1:])


def test_discovery_finds_a_new_subpackage(tmp_path):
    """The failure this guards against: a new folder that imports in tests but is not in the wheel."""
    (tmp_path / "runtime" / "newthing").mkdir(parents=True)
    for folder in (tmp_path, tmp_path / "runtime", tmp_path / "runtime" / "newthing"):
        (folder / "__init__.py").write_text("")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "__init__.py").write_text("")  # even a tests package stays out
    (tmp_path / "notes").mkdir()  # no __init__.py: not a package
    assert _setup_module().specedge_packages(str(tmp_path)) == ["specedge", "specedge.runtime",
                                                                "specedge.runtime.newthing"]


def test_package_data_matches_files_and_the_checker_agrees_with_pyproject():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert config["package-dir"] == {"specedge": "."}
    assert config["include-package-data"] is False
    data = {f"{pkg.removeprefix('specedge.').replace('.', '/')}/{glob}"
            for pkg, globs in config["package-data"].items() for glob in globs}
    assert data == set(packaging_check.PACKAGE_DATA)
    for glob in data:
        assert list(ROOT.glob(glob)), f"package data {glob} matches no file"


def _wheel(*extra: str, drop: tuple[str, ...] = ()) -> list[str]:
    names = ["specedge/__init__.py", "specedge/errors.py", "specedge/bench/prompts/suite.json",
             "specedge/quality/texts/prose.txt", "specedge/export/calibration/prose.txt",
             *(f"specedge/{p}/__init__.py" for p in packaging_check.REQUIRED_PACKAGES),
             "specedge-0.1.0.dist-info/METADATA", "specedge-0.1.0.dist-info/licenses/LICENSE",
             "specedge-0.1.0.dist-info/RECORD", *extra]
    return [n for n in names if n not in drop]


def test_the_wheel_check_accepts_a_right_wheel():
    assert packaging_check.wheel_problems(_wheel()) == []


@pytest.mark.parametrize("names, problem", [
    (_wheel("specedge/tests/conftest.py"), "specedge/tests/conftest.py: neither a module nor package data"),
    (_wheel("specedge/bench/results/run.md"), "specedge/bench/results/run.md: neither a module nor package data"),
    (_wheel("specedge/docs/results/run.png"), "specedge/docs/results/run.png: neither a module nor package data"),
    (_wheel("specedge/README.md"), "specedge/README.md: neither a module nor package data"),
    (_wheel("tests/test_cli.py"), "tests/test_cli.py: outside specedge/ and the dist-info folder"),
    (_wheel("runtime/loop.py"), "runtime/loop.py: outside specedge/ and the dist-info folder"),
    (_wheel(drop=("specedge/server/__init__.py",)), "specedge/server/__init__.py is missing"),
    (_wheel(drop=("specedge/bench/prompts/suite.json",)), "no package data matches specedge/bench/prompts/*.json"),
    (_wheel(drop=("specedge/quality/texts/prose.txt",)), "no package data matches specedge/quality/texts/*.txt"),
    (_wheel(drop=("specedge/export/calibration/prose.txt",)),
     "no package data matches specedge/export/calibration/*.txt"),
    (_wheel(drop=("specedge-0.1.0.dist-info/licenses/LICENSE",)), "the dist-info holds no licenses/LICENSE"),
], ids=["tests", "bench-results", "docs", "readme", "top-level-tests", "unprefixed-package", "missing-subpackage",
        "missing-prompts", "missing-eval-texts", "missing-calibration-texts", "missing-license"])
def test_the_wheel_check_names_what_is_wrong(names, problem):
    problems = packaging_check.wheel_problems(names)
    assert len(problems) == 1 and problems[0].startswith(problem), problems


def test_the_sdist_check_wants_the_test_helpers_and_no_results():
    right = [f"specedge-0.1.0/{f}" for f in (*packaging_check.SDIST_FILES, "tests/unit/test_cli.py")]
    assert packaging_check.sdist_problems(right) == []
    assert packaging_check.sdist_problems([n for n in right if not n.endswith("conftest.py")]) == \
        ["tests/conftest.py is missing"]
    assert packaging_check.sdist_problems(right + ["specedge-0.1.0/docs/results/a.md"]) == \
        ["docs/results/a.md: benchmark results do not belong in the sdist"]


def test_sdist_manifest_ships_every_file_the_tests_import():
    """MANIFEST.in grafts tests/, so any helper module the tests import ships; the checker's list
    names the ones known today."""
    manifest = (ROOT / "MANIFEST.in").read_text().splitlines()
    assert "graft tests" in manifest
    helpers = {p.name for p in (ROOT / "tests").glob("*.py") if not p.name.startswith("test_")}
    assert {Path(f).name for f in packaging_check.SDIST_FILES if f.startswith("tests/")} <= helpers


def test_ci_runs_the_readme_test_command_with_the_venv_outside_the_package():
    readme = (ROOT / "README.md").read_text()
    commands = re.findall(r"^python3 -m venv .*pytest.*$", readme, flags=re.M)
    assert len(commands) == 1, commands
    command = commands[0]
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert command in ci, "the README's test command and .ci/run differ"
    venv = re.match(r'python3 -m venv (?:--clear )?("[^"]+"|\S+)', command).group(1).strip('"')
    assert venv.startswith("$PWD-") or venv.startswith("../"), f"the venv {venv} is inside the package folder"
    assert "packaging_check.py" in "\n".join(ci)
    # the sdist's unit tests run against the installed wheel in the edge venv, from outside the tree
    assert any("wheel-venv/bin/python\" -m pytest" in line and "sdist/specedge-*/tests/unit" in line for line in ci)
