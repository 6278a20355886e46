"""Shared fixtures for every test folder (the only conftest.py: tests import its constants by name).

- tests/unit: the numpy reference engine (tests/reference_engine.py) under a full Generator, no
  export, no torch. A guard below fails a unit-only run whose tests or test modules imported
  torch, transformers or onnx: tests/unit must pass in the edge install (.ci/run runs it there).
- tests/integration, slow, gpu: tiny random-weight HF folders and the bundles exported from them.
  Everything heavy is session-scoped and memoised: a model folder is built once per (arch, seed,
  options), a bundle is exported once per (target, draft, options), and a Generator is loaded once
  per bundle. Tests that mutate a bundle copy it first. torch is imported inside the fixtures only.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Callable

import pytest

from tiny_models import PROMPT_IDS, build_model  # noqa: F401 - PROMPT_IDS: tests import it from here

UNIT = Path(__file__).resolve().parent / "unit"
# Top-level packages tests/unit must never import: the edge install has none of them.
HEAVY_PACKAGES = ("torch", "transformers", "onnx")
_HEAVY_AT_START = {name for name in HEAVY_PACKAGES if name in sys.modules}  # e.g. a plugin's; none here


def _heavy_loaded() -> list[str]:
    return sorted(name for name in HEAVY_PACKAGES if name in sys.modules and name not in _HEAVY_AT_START)


# Exact mode needs a target whose 2-row plain steps equal its verify rows bit for bit on this CPU, and
# the Generator refuses it by name where the export recorded otherwise (runtime/generator.py
# check_exact). The fused-attention tiny bundles are row-invariant on the CPUs measured so far (AVX2
# and AVX-512 EPYCs); on a CPU where one is not, a test that asks for exact mode through the API
# meets that refusal: it is reported as skipped with the reason, not failed, since the promise it
# checks does not exist there (fast mode's own property, tests/integration/test_fast_mode.py, still
# runs). A test that expects the refusal catches it itself (pytest.raises) and never gets here.
EXACT_REFUSED = "not row-invariant"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if call.when != "call" or not report.failed or call.excinfo is None:
        return
    from specedge.errors import InvalidParameterError

    exc = call.excinfo.value
    if isinstance(exc, InvalidParameterError) and EXACT_REFUSED in str(exc):
        report.outcome = "skipped"
        report.longrepr = (str(item.path), item.location[1] or 0,
                           "exact mode is refused on this CPU (its target is not row-invariant here): " + str(exc)[:200])


@pytest.fixture(autouse=True)
def _unit_tests_stay_torch_free(request):
    """In a session that runs only tests/unit, no test module (imported at collection) and no test
    may have imported a heavy package. A session that also runs other folders imports torch on
    purpose, so it cannot tell; .ci/run's unit-only run in the edge venv then proves it."""
    unit_only = all(UNIT in Path(item.path).parents for item in request.session.items)
    if unit_only:
        assert not _heavy_loaded(), f"tests/unit imported {_heavy_loaded()} (at collection or in an earlier test)"
    yield
    if unit_only:
        assert not _heavy_loaded(), f"{request.node.nodeid} imported {_heavy_loaded()}"


@pytest.fixture
def reference(tmp_path) -> Callable[..., object]:
    """``reference(**options) -> Generator`` on the numpy reference engines (a fresh one per call, in
    its own folder); options as tests/reference_engine.reference_generator takes them."""
    from reference_engine import reference_generator

    made = []

    def make(**options):
        made.append(reference_generator(tmp_path / f"reference-{len(made)}", **options))
        return made[-1]

    return make

# Seeds whose greedy continuation of PROMPT_IDS runs 64 tokens without meeting EOS (id 1),
# so the decode oracle compares long sequences. Found by running transformers' greedy once.
ARCH_SEEDS = {"llama": 0, "qwen2": 1, "gpt2": 0}
ARCHS = tuple(ARCH_SEEDS)
MAX_CONTEXT = 256  # = the tiny gpt2's learned positions


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Callable[..., Path]:
    """``tiny_model(arch, seed=ARCH_SEEDS[arch], **build_model options) -> folder`` (memoised)."""
    import torch

    torch.set_num_threads(1)  # the reference forwards are tiny; spare the shared cores
    root = tmp_path_factory.mktemp("models")
    made: dict[tuple, Path] = {}

    def make(arch: str, seed: int | None = None, **options) -> Path:
        seed = ARCH_SEEDS[arch] if seed is None else seed
        key = (arch, seed, tuple(sorted((k, str(v)) for k, v in options.items())))
        if key not in made:
            made[key] = build_model(root / f"{arch}-s{seed}-{len(made)}", arch, seed, **options)
        return made[key]

    return make


@pytest.fixture(scope="session")
def export(tmp_path_factory) -> Callable[..., Path]:
    """``export(target_folder, draft=None, **ExportConfig options) -> bundle folder`` (memoised)."""
    from specedge.export.bundle import ExportConfig, export_bundle

    root = tmp_path_factory.mktemp("bundles")
    done: dict[tuple, Path] = {}

    def run(target: Path, draft: str | Path | None = None, **options) -> Path:
        options.setdefault("max_context", MAX_CONTEXT)
        key = (str(target), str(draft), tuple(sorted(options.items())))
        if key not in done:
            out = root / f"bundle-{len(done)}"
            with pytest.MonkeyPatch.context() as mp:
                if options.get("tune_block_size"):  # saved measurements (export/tune_saved.py): not the user's cache
                    mp.setenv("SPECEDGE_CACHE", str(root / "cache"))
                export_bundle(ExportConfig(target=str(target), out=out, draft=None if draft is None else str(draft),
                                           quiet=True, **options))
            done[key] = out
        return done[key]

    return run


@pytest.fixture(scope="session")
def load_generator() -> Callable[[Path], object]:
    """``load_generator(bundle) -> Generator`` with one thread per session (memoised)."""
    from specedge.runtime.generator import Generator

    loaded: dict[Path, object] = {}

    def load(bundle: Path):
        if bundle not in loaded:
            loaded[bundle] = Generator.from_bundle(bundle, threads=1)
        return loaded[bundle]

    return load


@pytest.fixture(scope="session")
def arch_bundle(tiny_model, export) -> Callable[[str], Path]:
    """``arch_bundle(arch)``: the fp32 target-only bundle of that arch's tiny model."""
    return lambda arch: export(tiny_model(arch))


@pytest.fixture(scope="session")
def llama_bundle(arch_bundle) -> Path:
    return arch_bundle("llama")


@pytest.fixture(scope="session")
def self_spec_bundle(tiny_model, export) -> Path:
    """The llama target with an fp32 draft exported from the same folder: draft == target."""
    folder = tiny_model("llama")
    return export(folder, draft=folder)


@pytest.fixture(scope="session")
def int4_bundle(tiny_model, export) -> Path:
    """The llama target (fp32) with its own weight-only int4 copy as the draft."""
    return export(tiny_model("llama"), draft="self-int4")


@pytest.fixture
def bundle_copy(tmp_path) -> Callable[[Path], Path]:
    """``bundle_copy(bundle) -> a private copy`` for tests that edit or break files."""
    def copy(bundle: Path) -> Path:
        return Path(shutil.copytree(bundle, tmp_path / f"copy-{bundle.name}"))

    return copy


@pytest.fixture(scope="session")
def sampling_pair(tmp_path_factory):
    """A 16-token-vocabulary llama target with a perturbed draft (disagrees often, not always),
    small enough for the chi-square tests' thousands of seeded samples."""
    from specedge.export.bundle import ExportConfig, export_bundle
    from specedge.runtime.generator import Generator

    root = tmp_path_factory.mktemp("sampling-pair")
    target = build_model(root / "t", "llama", seed=21, vocab_size=16)
    draft = build_model(root / "d", "llama", seed=22, vocab_size=16, perturb=(target, 0.5))
    export_bundle(ExportConfig(target=str(target), draft=str(draft), out=root / "b", max_context=64, quiet=True))
    return Generator.from_bundle(root / "b")
