"""``specedge doctor`` reads whether ONNX Runtime's packed weights can sit in huge pages, and says how.

A decode step streams every packed weight; glibc's malloc asks for transparent huge pages only when told
to (GLIBC_TUNABLES=glibc.malloc.hugetlb=1, glibc >= 2.35) in the kernel's "madvise" mode. The hint
appears exactly where setting it would change something.
"""

from __future__ import annotations

import pytest

from specedge.cli.doctor import _hints, render
from specedge.engines.hugepages import HUGEPAGE_TUNABLE
from specedge.engines.hugepages import hugepages as _hugepages


def _sysfs(tmp_path, text: str):
    path = tmp_path / "enabled"
    path.write_text(text)
    return path


@pytest.mark.parametrize("text, mode", [("always [madvise] never\n", "madvise"), ("[always] madvise never\n", "always"),
                                        ("always madvise [never]\n", "never"), ("garbled\n", None)])
def test_the_kernel_mode_is_read_from_sysfs(tmp_path, text, mode):
    assert _hugepages(_sysfs(tmp_path, text), {}, ("glibc", "2.36"))["thp_mode"] == mode


def test_a_missing_sysfs_file_and_old_or_other_libcs_are_reported_not_raised(tmp_path):
    facts = _hugepages(tmp_path / "absent", {}, ("", ""))
    assert facts == {"thp_mode": None, "malloc_tunable": False, "glibc_can": False}
    assert not _hugepages(tmp_path / "absent", {}, ("glibc", "2.31"))["glibc_can"]
    assert _hugepages(tmp_path / "absent", {}, ("glibc", "2.35"))["glibc_can"]
    assert not _hugepages(tmp_path / "absent", {}, ("glibc", "weird"))["glibc_can"]


def test_the_tunable_is_found_among_others(tmp_path):
    path = _sysfs(tmp_path, "always [madvise] never\n")
    assert _hugepages(path, {"GLIBC_TUNABLES": f"glibc.malloc.arena_max=2:{HUGEPAGE_TUNABLE}"},
                      ("glibc", "2.36"))["malloc_tunable"]
    assert not _hugepages(path, {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}, ("glibc", "2.36"))["malloc_tunable"]


@pytest.mark.parametrize("mode, tunable, glibc_can, hinted", [
    ("madvise", False, True, True),  # the only case where setting it changes something
    ("madvise", True, True, False),  # already set
    ("always", False, True, False),  # every large allocation gets huge pages anyway
    ("never", False, True, False),  # the kernel gives none
    ("madvise", False, False, False),  # this glibc has no such tunable
])
def test_the_hint_appears_only_where_the_tunable_would_change_something(mode, tunable, glibc_can, hinted):
    facts = {"onnxruntime": {"install_problem": None, "providers": {}, "usable": {"cpu": True, "cuda": False,
                                                                                  "tensorrt": False}},
             "gpus": [], "hugepages": {"thp_mode": mode, "malloc_tunable": tunable, "glibc_can": glibc_can}}
    hints = _hints(facts)
    assert any(f"GLIBC_TUNABLES={HUGEPAGE_TUNABLE}" in h for h in hints) is hinted


def test_render_shows_whether_malloc_uses_huge_pages():
    from specedge.cli.doctor import collect

    facts = collect()
    facts["hugepages"] = {"thp_mode": "madvise", "malloc_tunable": False, "glibc_can": True}
    text = render(facts)
    assert "huge pages: transparent madvise; malloc uses them: no" in text
    assert f"hint: CPU decoding: start specedge with GLIBC_TUNABLES={HUGEPAGE_TUNABLE}" in text
    facts["hugepages"]["malloc_tunable"] = True
    assert "malloc uses them: yes" in render(facts) and "GLIBC_TUNABLES" not in render(facts)


def test_reports_describe_the_state_in_one_line():
    from specedge.engines.hugepages import describe

    assert describe({"thp_mode": "madvise", "malloc_tunable": True, "glibc_can": True}) == \
        "transparent madvise; malloc uses them: yes"
    assert describe({"thp_mode": "madvise", "malloc_tunable": False, "glibc_can": True}).endswith("no")
    assert describe({"thp_mode": "always", "malloc_tunable": False, "glibc_can": False}).endswith("yes")
    assert describe({"thp_mode": "never", "malloc_tunable": True, "glibc_can": True}).endswith("no")
    assert describe({"thp_mode": None, "malloc_tunable": False, "glibc_can": False}) == "unknown"
