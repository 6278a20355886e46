"""Where `specedge bench --out` writes: a folder (existing, or named with a trailing "/") or a path stem."""

from __future__ import annotations

from pathlib import Path

from specedge.bench.report import partial_results_path, results_stem

DOC = {"date": "2026-12-03", "bundle": {"name": "qwen-int4"}}


def test_a_new_folder_named_with_a_trailing_slash_gets_dated_files(tmp_path):
    out = f"{tmp_path}/runs/"  # not yet there: the "/" alone says it is a folder
    assert partial_results_path(out, Path("bundles/qwen-int4")) == tmp_path / "runs" / "qwen-int4.partial.jsonl"
    assert results_stem(out, DOC) == tmp_path / "runs" / "2026-12-03-qwen-int4"
    assert (tmp_path / "runs").is_dir()


def test_an_existing_folder_without_the_slash_is_still_a_folder(tmp_path):
    (tmp_path / "runs").mkdir()
    assert results_stem(tmp_path / "runs", DOC) == tmp_path / "runs" / "2026-12-03-qwen-int4"


def test_any_other_path_is_a_stem_and_loses_a_results_suffix(tmp_path):
    assert results_stem(tmp_path / "sub" / "run.json", DOC) == tmp_path / "sub" / "run"
    assert partial_results_path(str(tmp_path / "run.md"), Path("b")) == tmp_path / "run.partial.jsonl"
    assert results_stem(str(tmp_path / "stem"), DOC) == tmp_path / "stem"
