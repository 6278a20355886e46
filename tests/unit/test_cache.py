"""The cache's items and their disk use, and cleaning them: ``specedge fetch --list`` shows the disk each
fetched model and converted GGUF copy uses; ``specedge fetch --clean [NAME]`` removes exactly what it names
(an unknown name removes nothing and says so). No network."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from specedge.cli.main import main
from specedge.errors import InvalidParameterError
from specedge.export.cache import cache_items, clean_cache


def _fill(cache: Path) -> None:
    (cache / "models" / "smollm2-135m").mkdir(parents=True)
    (cache / "models" / "smollm2-135m" / "m.gguf").write_bytes(b"x" * 1000)
    (cache / "converted" / "m-0123").mkdir(parents=True)
    (cache / "converted" / "m-0123" / "model.safetensors").write_bytes(b"y" * 3000)
    (cache / "converted" / "n-4567").mkdir(parents=True)
    (cache / "converted" / "n-4567" / "model.safetensors").write_bytes(b"z" * 500)


def test_items_are_listed_by_kind_with_their_disk_use(tmp_path):
    _fill(tmp_path)
    assert [(i.kind, i.name, i.bytes) for i in cache_items(tmp_path)] == [
        ("model", "smollm2-135m", 1000), ("converted", "m-0123", 3000), ("converted", "n-4567", 500)]
    assert cache_items(tmp_path / "missing") == []


def test_clean_removes_what_it_names_and_nothing_else(tmp_path):
    _fill(tmp_path)
    assert [i.name for i in clean_cache("m-0123", tmp_path)] == ["m-0123"]
    assert [i.name for i in cache_items(tmp_path)] == ["smollm2-135m", "n-4567"]
    assert [i.name for i in clean_cache("converted", tmp_path)] == ["n-4567"]
    assert [i.name for i in cache_items(tmp_path)] == ["smollm2-135m"]
    with pytest.raises(InvalidParameterError, match="no cached item is called 'nope'"):
        clean_cache("nope", tmp_path)
    assert [i.name for i in cache_items(tmp_path)] == ["smollm2-135m"]
    assert [i.name for i in clean_cache(None, tmp_path)] == ["smollm2-135m"]
    assert cache_items(tmp_path) == []
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == []  # no renamed-aside leftovers


def test_fetch_list_shows_disk_use_and_clean_frees_it(tmp_path, monkeypatch):
    _fill(tmp_path)
    monkeypatch.setenv("SPECEDGE_CACHE", str(tmp_path))
    listed = CliRunner().invoke(main, ["fetch", "--list", "--json"])
    assert listed.exit_code == 0, listed.output
    rows = json.loads(listed.output)
    assert {r["name"]: r["disk_bytes"] for r in rows if r.get("converted")} == {"m-0123": 3000, "n-4567": 500}
    text = CliRunner().invoke(main, ["fetch", "--list"]).output
    assert "converted GGUF copy" in text and "fetch --clean" in text
    cleaned = CliRunner().invoke(main, ["fetch", "--clean", "converted"])
    assert cleaned.exit_code == 0 and "freed 0 MB" in cleaned.output
    assert [i.kind for i in cache_items(tmp_path)] == ["model"]
    bad = CliRunner().invoke(main, ["fetch", "--clean", "nope"])
    assert bad.exit_code != 0 and "no cached item is called 'nope'" in bad.output


def test_saved_tune_measurements_are_listed_and_cleaned_as_their_own_kind(tmp_path, monkeypatch):
    """export --tune's saved measurements (export/tune_saved.py) are files under tune/: listed by their name,
    removed by name or all at once with 'tune'; a write in progress (.NAME.partial-PID-...) is not an item."""
    _fill(tmp_path)
    (tmp_path / "tune").mkdir()
    (tmp_path / "tune" / "m-target-0123.json").write_text("{}" * 100)
    (tmp_path / "tune" / "m-draft-4567.json").write_text("{}")
    (tmp_path / "tune" / ".m-target-0123.json.partial-1-x").write_text("{")
    assert [(i.kind, i.name, i.bytes) for i in cache_items(tmp_path) if i.kind == "tune"] == [
        ("tune", "m-draft-4567", 2), ("tune", "m-target-0123", 200)]
    monkeypatch.setenv("SPECEDGE_CACHE", str(tmp_path))
    rows = json.loads(CliRunner().invoke(main, ["fetch", "--list", "--json"]).output)
    assert {r["name"] for r in rows if r.get("tune")} == {"m-draft-4567", "m-target-0123"}
    assert "m-target-0123" in CliRunner().invoke(main, ["fetch", "--list"]).output
    assert [i.name for i in clean_cache("m-draft-4567", tmp_path)] == ["m-draft-4567"]
    cleaned = CliRunner().invoke(main, ["fetch", "--clean", "tune"])
    assert cleaned.exit_code == 0 and "removed tune m-target-0123" in cleaned.output
    assert [i.kind for i in cache_items(tmp_path)] == ["model", "converted", "converted"]
    assert [p.name for p in (tmp_path / "tune").iterdir()] == [".m-target-0123.json.partial-1-x"]
