"""Hardening: export never runs code shipped inside a model folder, and broken sources are ExportErrors.

What this module tries, on tiny llama folders (built with tests/tiny_models):

- a folder whose only weights are a pickle (``pytorch_model.bin``; transformers 5 has no
  ``safe_serialization=False``, so it is written with ``torch.save``) is refused with an
  ExportError naming ``--trust-pickle``, and nothing is unpickled: a pickle whose
  payload would create a marker file leaves no marker; no bundle appears;
- with ``trust_pickle=True`` the plain-tensor pickle exports, and the bundle generates
  exactly what the safetensors original's bundle generates; a booby-trapped pickle is
  still not executed (torch's weights-only unpickler) and surfaces as an ExportError,
  not an UnpicklingError traceback;
- a config.json / tokenizer_config.json with ``auto_map`` entries pointing at custom
  Python files in the folder (which would create a marker file when imported): the
  export uses transformers' own llama classes, imports none of them, and every
  transformers ``from_pretrained`` call gets ``trust_remote_code=False``; with an
  unknown ``model_type`` (only the custom code could load it) export fails with an
  ExportError and still imports nothing; the GGUF path passes ``trust_remote_code=False``
  too;
- a safetensors file cut in half, or overwritten with garbage: ExportError, no bundle.
"""

from __future__ import annotations

import json
import pathlib
import shutil
from pathlib import Path

import pytest

from specedge.errors import ExportError
from specedge.export.bundle import ExportConfig, export_bundle
from specedge.runtime.generator import Generator
from tiny_models import build_model, load_hf

PROMPT = list(range(6, 26))


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return build_model(tmp_path_factory.mktemp("hardening-untrusted") / "model", "llama", 0)


@pytest.fixture
def variant(folder, tmp_path):
    """``variant(name) -> a private copy of the tiny model folder`` to damage."""
    def make(name: str) -> Path:
        return Path(shutil.copytree(folder, tmp_path / name))

    return make


class _Trap:
    """Unpickling this calls ``marker.touch()``: the proof that a pickle ran code."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (pathlib.Path.touch, (self.marker,))


def _as_pickle(src: Path, weights: dict) -> Path:
    import torch

    (src / "model.safetensors").unlink()
    torch.save(weights, src / "pytorch_model.bin")
    return src


def _export(src: Path, out: Path, **options):
    return export_bundle(ExportConfig(target=str(src), out=out, max_context=64, quiet=True, **options))


def _tokens(bundle: Path) -> list[int]:
    return Generator.from_bundle(bundle, threads=1).generate(input_ids=PROMPT, max_new_tokens=20).token_ids


# --------------------------------------------------------------------------- pickles


def test_pickle_checkpoint_is_refused_without_trust_pickle(folder, variant, tmp_path):
    marker = tmp_path / "pickle-ran"
    src = _as_pickle(variant("pickled"), {"trap": _Trap(marker)})
    out = tmp_path / "bundle"
    with pytest.raises(ExportError, match=r"holds only pickle checkpoints \(pytorch_model.bin\), which can run "
                                          r"code .*pass --trust-pickle if you trust the source"):
        _export(src, out)
    assert not marker.exists()
    assert not out.exists()


def test_pickle_checkpoint_exports_with_trust_pickle(folder, variant, tmp_path):
    weights = load_hf(folder).state_dict()
    src = _as_pickle(variant("pickled"), {k: v.detach().clone() for k, v in weights.items()})
    pickled = tmp_path / "from-pickle"
    _export(src, pickled, trust_pickle=True)
    original = tmp_path / "from-safetensors"
    _export(folder, original)
    assert _tokens(pickled) == _tokens(original)


def test_booby_trapped_pickle_with_trust_pickle_runs_nothing(variant, tmp_path):
    marker = tmp_path / "pickle-ran"
    src = _as_pickle(variant("trapped"), {"trap": _Trap(marker)})
    out = tmp_path / "bundle"
    with pytest.raises(ExportError, match=r"transformers could not load .*UnpicklingError"):
        _export(src, out, trust_pickle=True)
    assert not marker.exists()
    assert not out.exists()


# --------------------------------------------------------------------------- custom code


def _plant_custom_code(src: Path, marker: Path, model_type: str | None = None) -> None:
    """auto_map entries naming Python files that would create ``marker`` when imported."""
    payload = f"import pathlib\npathlib.Path({str(marker)!r}).touch()\n"
    for name in ("configuration_evil.py", "modeling_evil.py", "tokenization_evil.py"):
        (src / name).write_text(payload + "class EvilConfig: pass\nclass EvilModel: pass\nclass EvilTokenizer: pass\n")
    config = json.loads((src / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "configuration_evil.EvilConfig",
                          "AutoModelForCausalLM": "modeling_evil.EvilModel"}
    if model_type is not None:
        config["model_type"] = model_type
    (src / "config.json").write_text(json.dumps(config))
    tok = json.loads((src / "tokenizer_config.json").read_text())
    tok["auto_map"] = {"AutoTokenizer": ["tokenization_evil.EvilTokenizer", None]}
    (src / "tokenizer_config.json").write_text(json.dumps(tok))


@pytest.fixture
def spy_from_pretrained(monkeypatch):
    """Record the keyword arguments of every transformers Auto*.from_pretrained call, and of
    AutoModelForCausalLM.from_config (how export builds a model whose weights it streams)."""
    import transformers

    calls: list[tuple[str, dict]] = []
    for cls, method in ((transformers.AutoModelForCausalLM, "from_pretrained"),
                        (transformers.AutoModelForCausalLM, "from_config"),
                        (transformers.AutoTokenizer, "from_pretrained"), (transformers.AutoConfig, "from_pretrained")):
        real = getattr(cls, method).__func__

        def spy(klass, *args, _real=real, _name=cls.__name__, **kwargs):
            calls.append((_name, dict(kwargs)))
            return _real(klass, *args, **kwargs)

        monkeypatch.setattr(cls, method, classmethod(spy))
    return calls


def test_auto_map_custom_code_is_never_imported(folder, variant, tmp_path, spy_from_pretrained):
    marker = tmp_path / "custom-code-ran"
    src = variant("custom-code")
    _plant_custom_code(src, marker)
    out = tmp_path / "bundle"
    _export(src, out)
    assert not marker.exists()
    assert {name for name, _ in spy_from_pretrained} >= {"AutoModelForCausalLM", "AutoTokenizer"}
    assert all(kwargs.get("trust_remote_code") is False for _, kwargs in spy_from_pretrained), spy_from_pretrained
    original = tmp_path / "original"
    _export(folder, original)
    assert _tokens(out) == _tokens(original)  # the llama classes transformers ships did the loading


def test_custom_code_only_model_type_is_an_export_error(variant, tmp_path):
    marker = tmp_path / "custom-code-ran"
    src = variant("custom-only")
    _plant_custom_code(src, marker, model_type="evil-arch")
    out = tmp_path / "bundle"
    with pytest.raises(ExportError, match=r"transformers could not load"):
        _export(src, out)
    assert not marker.exists()
    assert not out.exists()


def test_gguf_loading_passes_trust_remote_code_false(tmp_path, monkeypatch):
    """No GGUF file is converted here: the config, model and tokenizer calls are recorded, then stopped."""
    import types

    import transformers

    from specedge.export.loader import load_gguf

    class Stop(Exception):
        pass

    monkeypatch.setenv("SPECEDGE_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF" + b"\x00" * 64)
    seen: dict[str, dict] = {}

    def fake_config(klass, *args, **kwargs):
        seen["config"] = kwargs
        return types.SimpleNamespace()

    def fake_model(klass, *args, **kwargs):
        seen["model"] = kwargs
        return types.SimpleNamespace()

    def fake_tokenizer(klass, *args, **kwargs):
        seen["tokenizer"] = kwargs
        raise Stop

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", classmethod(fake_config))
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_config", classmethod(fake_model))
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", classmethod(fake_tokenizer))
    with pytest.raises(ExportError, match=r"cannot read GGUF file .*model\.gguf: Stop"):  # what transformers
        load_gguf(gguf, quiet=True)  # raises on a GGUF it cannot read surfaces as an ExportError naming the file
    for role in ("config", "model", "tokenizer"):
        assert seen[role].get("trust_remote_code") is False, (role, seen[role])
    for role in ("config", "tokenizer"):
        assert seen[role].get("gguf_file") == "model.gguf"


# --------------------------------------------------------------------------- broken weights


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_broken_safetensors_is_an_export_error(variant, tmp_path, damage):
    src = variant(damage)
    weights = src / "model.safetensors"
    raw = weights.read_bytes()
    weights.write_bytes(raw[: len(raw) // 2] if damage == "truncated" else b"\xff" * 4096)
    out = tmp_path / "bundle"
    with pytest.raises(ExportError, match=r"transformers could not load"):
        _export(src, out)
    assert not out.exists()
    assert not any(p.name.startswith(".bundle.") for p in tmp_path.iterdir())
