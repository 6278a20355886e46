"""Invariant: a prompt cache file loads only as the exact bytes save() wrote, and a hostile one costs nothing.

runtime/prompt_cache.py on plain numpy caches (no bundle, no model), issue #41 items 3 and 4:

- save -> load is bit-exact in both cache layouts;
- contents changed after the save are refused by the file's sha256 (over the header, its token
  lists and every array): another prompt's token list, arrays swapped between layers, zeroed or
  scaled; NaN or infinite values are refused by name (and never saved); a version-2 file, which has
  no digest, is refused with a request to save it again;
- sizes the file declares are checked before anything of that size is allocated or inflated: a
  header declaring 10^12 bytes, a K array declaring (10^9, 3, 64), a deflate bomb inflating to
  64 MiB, a file larger than the caches could hold; each is refused while tracemalloc's peak stays
  under 4 MiB;
- names the OS refuses (300 characters; 250 plus the temporary sibling's suffix) and paths that
  are not files are PromptCacheErrors, not OSErrors.
"""

from __future__ import annotations

import io
import json
import tracemalloc
import zipfile

import numpy as np
import pytest

from specedge.engines.base import KVCache
from specedge.errors import PromptCacheError
from specedge.runtime import prompt_cache

KEY = {"target_sha256": "ab" * 32, "threads": 1}
VOCAB = 100
TOKENS = list(range(20, 36))  # 16 positions
OTHER_TOKENS = list(range(50, 66))  # another prompt of the same length
DRAFT_TOKENS = TOKENS[:12]
LAYERS, HEADS, HEAD_DIM, CAPACITY = 2, 3, 64, 64
ALLOCATION_BOUND = 4 << 20  # bytes: the real caches here are 2 x 2 x 64 x 3 x 64 x 4 = 196 KB


def _caches(layout: str = "position-major") -> tuple[KVCache, KVCache]:
    return (KVCache(LAYERS, HEADS, HEAD_DIM, CAPACITY, layout=layout),
            KVCache(1, HEADS, HEAD_DIM, CAPACITY, layout=layout))


def _filled(layout: str, seed: int = 0) -> tuple[KVCache, KVCache]:
    target, draft = _caches(layout)
    rng = np.random.default_rng(seed)
    for kv, n in ((target, len(TOKENS)), (draft, len(DRAFT_TOKENS))):
        for array in (*kv.keys, *kv.values):
            array[...] = rng.standard_normal(array.shape, np.float32)
        kv.length = n
    return target, draft


def _load(path, layout: str = "position-major") -> prompt_cache.Loaded:
    target, draft = _caches(layout)
    return prompt_cache.load(path, KEY, target, draft, VOCAB)


@pytest.fixture
def saved(tmp_path):
    path = tmp_path / "system.cache"
    target, draft = _filled("position-major")
    prompt_cache.save(path, KEY, TOKENS, target, DRAFT_TOKENS, draft)
    return path


def _members(path) -> dict[str, np.ndarray]:
    with np.load(path, allow_pickle=False) as archive:
        return {name: archive[name] for name in archive.files}


def _rewrite(path, *, header=None, drop=(), replace=None) -> None:
    """Rewrite the npz with its header edited, members dropped or replaced; the sha256 member is
    copied as it was (what a tool that does not know about it would do)."""
    arrays = {name: array for name, array in _members(path).items() if name not in drop}
    if header is not None:
        doc = json.loads(arrays["header"].tobytes())
        header(doc)
        arrays["header"] = np.frombuffer(json.dumps(doc).encode(), np.uint8)
    arrays.update(replace(arrays) if callable(replace) else replace or {})
    with open(path, "wb") as f:
        np.savez(f, **arrays)


@pytest.mark.parametrize("layout", ["position-major", "head-major"])
def test_save_then_load_is_bit_exact(tmp_path, layout):
    path = tmp_path / "c"
    target, draft = _filled(layout)
    prompt_cache.save(path, KEY, TOKENS, target, DRAFT_TOKENS, draft)
    loaded = _load(path, layout)
    assert (loaded.tokens, loaded.draft_tokens) == (TOKENS, DRAFT_TOKENS)
    into, into_draft = _caches(layout)
    loaded.fill("target", into)
    loaded.fill("draft", into_draft)
    for kv, got, n in ((target, into, len(TOKENS)), (draft, into_draft, len(DRAFT_TOKENS))):
        assert got.length == n
        for want, have in zip((*kv.keys, *kv.values), (*got.keys, *got.values)):
            np.testing.assert_array_equal(kv.committed(have, n), kv.committed(want, n))
    assert sorted(_members(path)) == sorted(["header", "sha256", "target.k.0", "target.v.0", "target.k.1",
                                             "target.v.1", "draft.k.0", "draft.v.0"])


def _swap_layers(arrays):
    return {"target.k.0": arrays["target.k.1"], "target.k.1": arrays["target.k.0"]}


@pytest.mark.parametrize("tamper", [
    dict(header=lambda h: h.update(tokens=OTHER_TOKENS, draft_tokens=OTHER_TOKENS[:12])),
    dict(header=lambda h: h.update(tokens=TOKENS[:-1] + [99])),
    dict(replace=_swap_layers),
    dict(replace=lambda a: {"target.v.0": np.zeros_like(a["target.v.0"])}),
    dict(replace=lambda a: {"target.k.1": a["target.k.1"] * np.float32(2)}),
    dict(replace=lambda a: {"draft.v.0": np.zeros_like(a["draft.v.0"])}),
], ids=["another-prompts-tokens", "one-token", "layers-swapped", "zeroed", "scaled", "draft-zeroed"])
def test_contents_changed_after_the_save_are_refused_by_the_digest(saved, tamper):
    _rewrite(saved, **tamper)
    with pytest.raises(PromptCacheError, match=r"its sha256 does not match its header \(key, token lists\) and arrays: "
                                               r"the file was changed after it was saved"):
        _load(saved)


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_non_finite_arrays_are_refused_by_name(saved, value):
    def poison(arrays):
        bad = arrays["target.v.1"].copy()
        bad[3, 1, 7] = value
        return {"target.v.1": bad}

    _rewrite(saved, replace=poison)
    with pytest.raises(PromptCacheError, match=r"target\.v\.1 holds 1 NaN or infinite values; a prompt cache holds "
                                               r"finite K/V only"):
        _load(saved)


def test_non_finite_caches_are_never_saved(tmp_path):
    target, draft = _filled("position-major")
    target.keys[0][2, 0, 0] = np.nan
    with pytest.raises(PromptCacheError, match=r"not saved: target\.k\.0 holds 1 NaN or infinite values"):
        prompt_cache.save(tmp_path / "c", KEY, TOKENS, target, DRAFT_TOKENS, draft)
    assert list(tmp_path.iterdir()) == []


def test_a_file_without_a_digest_is_refused_asking_to_save_it_again(saved):
    """Version 2 had no sha256: its arrays were bound to nothing, so it is not trusted."""
    _rewrite(saved, header=lambda h: h.update(version=2), drop=("sha256",))
    with pytest.raises(PromptCacheError, match=r"has format version 2; this specedge reads version 3, whose sha256 "
                                               r"binds the arrays to the header: save it again"):
        _load(saved)


@pytest.mark.parametrize("tamper, message", [
    (dict(drop=("sha256",)), r"lacks its sha256: truncated or not ours"),
    (dict(replace={"notes": np.zeros(3, np.uint8)}), r"holds 'notes\.npy', which no prompt cache for this Generator "
                                                     r"holds"),
    (dict(replace={"sha256": np.zeros(65, np.uint8)}), r"sha256 is uint8 \[65\], expected uint8 \[64\]"),
], ids=["no-digest", "extra-member", "digest-shape"])
def test_members_are_exactly_the_expected_ones(saved, tamper, message):
    _rewrite(saved, **tamper)
    with pytest.raises(PromptCacheError, match=message):
        _load(saved)


# ----------------------------------------------------------------------------- hostile sizes
def _npy(shape: tuple[int, ...], dtype, body: bytes) -> bytes:
    """An .npy member whose header declares ``shape`` whatever ``body`` holds."""
    out = io.BytesIO()
    np.lib.format.write_array_header_1_0(out, {"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)),
                                               "fortran_order": False, "shape": shape})
    return out.getvalue() + body


def _with_member(path, name: str, data: bytes) -> None:
    """The saved file with member ``name`` replaced by raw ``data`` (stored)."""
    with zipfile.ZipFile(path) as old:
        members = {info.filename: old.read(info) for info in old.infolist()}
    members[f"{name}.npy"] = data
    with zipfile.ZipFile(path, "w") as new:
        for member, content in members.items():
            new.writestr(member, content)


def _declared_header(path):
    _with_member(path, "header", _npy((10**12,), np.uint8, b"{}"))


def _declared_k_array(path):
    _with_member(path, "target.k.0", _npy((10**9, 3, 64), np.float32, bytes(64)))


def _deflate_bomb(path):
    """header.npy declaring and holding 64 MiB of zeros, deflated to about 64 KB."""
    size = 64 << 20
    chunk = bytes(1 << 20)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED, compresslevel=1) as z:
        with z.open("header.npy", "w") as member:
            member.write(_npy((size,), np.uint8, b""))
            for _ in range(size // len(chunk)):
                member.write(chunk)
    assert path.stat().st_size < size // 100


def _oversized_file(path):
    with open(path, "r+b") as f:
        f.truncate(64 << 20)  # sparse: no disk is used


@pytest.mark.parametrize("attack, message", [
    (_declared_header, r"header is uint8 \[1000000000000\], expected a uint8 vector of at most 16777216 bytes"),
    (_declared_k_array, r"target\.k\.0 is float32 \[1000000000, 3, 64\], expected float32 \[16, 3, 64\]"),
    (_deflate_bomb, r"header inflates to \d+ bytes; it holds at most 16787228 here: not ours"),
    (_oversized_file, r"is 67108864 bytes; a prompt cache for this Generator's caches is at most \d+: not ours"),
], ids=["header-10^12", "k-array-10^9x3x64", "deflate-bomb", "oversized-file"])
def test_declared_sizes_are_checked_before_anything_is_allocated(saved, attack, message):
    attack(saved)
    target, draft = _caches()
    tracemalloc.start()
    try:
        with pytest.raises(PromptCacheError, match=message):
            prompt_cache.load(saved, KEY, target, draft, VOCAB)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < ALLOCATION_BOUND, f"refusing the file allocated {peak / 1e6:.1f} MB"


# ----------------------------------------------------------------------------- names
def test_names_the_os_refuses_are_prompt_cache_errors(tmp_path):
    target, draft = _filled("position-major")
    with pytest.raises(PromptCacheError, match=r"prompt cache path refused: the name 'x{24}…' is 300 bytes; this file "
                                               r"system allows \d+"):
        _load(tmp_path / ("x" * 300))
    with pytest.raises(PromptCacheError, match=r"the name 'y{24}…' is 300 bytes \(plus \d+ for its temporary "
                                               r"sibling\); this file system allows"):
        prompt_cache.save(tmp_path / ("y" * 300), KEY, TOKENS, target, DRAFT_TOKENS, draft)
    # 250 characters fit, but not with the temporary sibling's ".NAME.tmp-PID" around them
    with pytest.raises(PromptCacheError, match=r"the name 'z{24}…' is 250 bytes \(plus \d+ for its temporary "
                                               r"sibling\); this file system allows"):
        prompt_cache.save(tmp_path / ("z" * 250), KEY, TOKENS, target, DRAFT_TOKENS, draft)
    assert list(tmp_path.iterdir()) == []


def test_paths_that_are_not_files_are_refused(tmp_path):
    (tmp_path / "a-file").write_bytes(b"")
    with pytest.raises(PromptCacheError, match="does not exist"):
        _load(tmp_path / "missing")
    with pytest.raises(PromptCacheError, match="does not exist"):
        _load(tmp_path / "a-file" / "under-a-file")
    with pytest.raises(PromptCacheError, match="is not a regular file"):
        _load(tmp_path)
