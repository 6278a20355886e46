"""Invariant: a persisted prompt cache is the K/V a cold prefill computes, or it is refused.

- Saved by one Generator and loaded by a fresh one (a restart), a request starting with the
  saved prefix prefills only its tail and replies exactly as a cold start (greedy, fp32 target,
  exact mode; plain and speculative, the draft's prefix loaded too).
- Every unusable file is refused with PromptCacheError naming why, and a refused load changes
  no slot: another bundle (graph sha256), another exactness setting, another CPU's vector
  extensions or thread count, a draft-less Generator,
  a truncated, corrupt, foreign or pickled file, a missing header, another format version,
  out-of-range tokens, wrong array shapes, a missing path or a directory; saving into a
  missing folder or onto a directory.
- A file edited after its save is refused by its sha256 (issue #41 item 3): another prompt's
  token list put in its header would otherwise answer that prompt's conversation with this
  prompt's K/V; a NaN array would otherwise decode empty text. tests/unit/test_prompt_cache_file.py
  covers the format itself (every kind of tampering, sizes checked before allocation, names).
- ``specedge serve --prompt-cache`` creates the file from --system-prompt, loads it on restart,
  and refuses a file holding another prompt or none to create it from.
"""

from __future__ import annotations

import io
import json
import re
import zipfile

import numpy as np
import pytest

from conftest import PROMPT_IDS
from exactness import assert_agrees

PREFIX = list(range(30, 70))  # a 40-token "system prompt"
TURN = [80, 81, 82, 83, 84]


@pytest.fixture
def fresh():
    from specedge.runtime.generator import Generator

    return lambda bundle, **kw: Generator.from_bundle(bundle, threads=1, **kw)


@pytest.fixture
def saved(int4_bundle, fresh, tmp_path):
    """A prompt cache of PREFIX saved from the int4-draft bundle (fp32 target) in exact mode (a loaded
    prefix then replies as a cold start token for token), and its path."""
    path = tmp_path / "system.cache"
    report = fresh(int4_bundle).save_prompt_cache(path, input_ids=PREFIX, exact=True)
    assert report == {"path": str(path), "tokens": len(PREFIX), "draft_tokens": len(PREFIX),
                      "bytes": path.stat().st_size}
    return path


@pytest.mark.parametrize("options", [dict(speculation=False), dict(drafter="model", draft_tokens=3, adaptive=False)],
                         ids=["plain", "model-k3"])
def test_a_loaded_prefix_replies_as_a_cold_start(int4_bundle, fresh, saved, options):
    restarted = fresh(int4_bundle)
    restarted.warmup(tune=False)  # warm-up runs after the load in a server: it must not drop the slot
    assert restarted.load_prompt_cache(saved, exact=True)["tokens"] == len(PREFIX)
    restarted.warmup(tune=False)
    warm = restarted.generate(input_ids=PREFIX + TURN, max_new_tokens=12, exact=True, **options)
    cold = fresh(int4_bundle).generate(input_ids=PREFIX + TURN, max_new_tokens=12, reuse_prefix=False, exact=True,
                                       **options)
    assert warm.stats.reused_tokens == len(PREFIX)
    assert warm.token_ids == cold.token_ids
    if "drafter" in options:  # the draft's prefix came from the file too: it reads only the new tokens
        assert warm.stats.catchup_tokens < cold.stats.catchup_tokens


def test_another_bundle_is_refused_by_its_graph_hash(self_spec_bundle, fresh, saved):
    from specedge.errors import PromptCacheError

    gen = fresh(self_spec_bundle)
    with pytest.raises(PromptCacheError, match=r"saved for another bundle or setting: draft_sha256 [0-9a-f]{12}… \(this Generator: [0-9a-f]{12}…\); "
                                                  r"draft_precision 'int4' \(this Generator: 'fp32'\)"):
        gen.load_prompt_cache(saved, exact=True)


def test_another_target_is_refused(llama_bundle, fresh, tmp_path, tiny_model, export):
    from specedge.errors import PromptCacheError

    other = export(tiny_model("llama", seed=123))
    path = tmp_path / "other.cache"
    fresh(other).save_prompt_cache(path, input_ids=PREFIX)
    with pytest.raises(PromptCacheError, match=r"target_sha256 [0-9a-f]{12}… \(this Generator: [0-9a-f]{12}…\)$"):
        fresh(llama_bundle).load_prompt_cache(path)


def test_exactness_and_draft_presence_are_part_of_the_key(int4_bundle, fresh, saved):
    from specedge.errors import PromptCacheError

    with pytest.raises(PromptCacheError, match=r"exact True \(this Generator: False\)"):
        fresh(int4_bundle).load_prompt_cache(saved, exact=False)
    with pytest.raises(PromptCacheError, match=r"draft_sha256 [0-9a-f]{12}… \(this Generator: None\)"):
        fresh(int4_bundle, load_draft=False).load_prompt_cache(saved, exact=True)


@pytest.mark.parametrize("field, value, message", [
    ("cpu_isa", "made-up-extension", r"cpu_isa 'made-up-extension' \(this Generator: '"),
    ("threads", 7, r"threads 7 \(this Generator: 1\)"),
])
def test_another_cpu_or_thread_count_is_refused(int4_bundle, fresh, saved, field, value, message):
    """The kernels ONNX Runtime picks depend on the CPU's extensions (and split work by threads): a
    file written elsewhere need not hold the bits a cold prefill computes here."""
    from specedge.errors import PromptCacheError

    def edit(header):
        header["key"][field] = value

    _rewrite(saved, header=edit)
    with pytest.raises(PromptCacheError, match=message):
        fresh(int4_bundle).load_prompt_cache(saved, exact=True)


def _rewrite(path, *, header=None, drop=(), replace=None):
    """Copy an npz prompt cache with its header edited, arrays dropped or replaced."""
    with np.load(path, allow_pickle=False) as archive:
        arrays = {name: archive[name] for name in archive.files if name not in drop}
    if header is not None:
        doc = json.loads(arrays["header"].tobytes())
        header(doc)
        arrays["header"] = np.frombuffer(json.dumps(doc).encode(), np.uint8)
    arrays.update(replace or {})
    with open(path, "wb") as f:
        np.savez(f, **arrays)


def _truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _corrupt(path):
    data = bytearray(path.read_bytes())
    # Flip bytes inside the largest member's stored data: its CRC no longer matches.
    with zipfile.ZipFile(io.BytesIO(bytes(data))) as z:
        info = max(z.infolist(), key=lambda i: i.compress_size)
    middle = info.header_offset + 200 + info.compress_size // 2
    data[middle:middle + 16] = bytes(255 - b for b in data[middle:middle + 16])
    path.write_bytes(bytes(data))


def _pickled(path):
    with open(path, "wb") as f:
        np.savez(f, header=np.array([{"format": "specedge-prompt-cache"}], dtype=object))


@pytest.mark.parametrize("damage, message", [
    (_truncate, "is truncated or corrupt"),
    (_corrupt, "is truncated or corrupt"),
    (lambda p: p.write_text("not a cache"), "is truncated or corrupt"),
    (lambda p: p.write_bytes(b"\x80\x04\x95" + b"\x00" * 64), "is truncated or corrupt"),  # a pickle stream
    (_pickled, r"header is object \[1\], expected a uint8 vector"),  # an object array: never unpickled
    (lambda p: _rewrite(p, drop=("header",)), "has no header"),
    (lambda p: _rewrite(p, header=lambda h: h.update(format="llama.cpp")), "is not a specedge prompt cache"),
    (lambda p: _rewrite(p, header=lambda h: h.update(version=99)), "has format version 99"),
    (lambda p: _rewrite(p, header=lambda h: h.update(tokens=[10**6] * 3, draft_tokens=[])), "out of range"),
    (lambda p: _rewrite(p, header=lambda h: h.update(tokens="abc")), "'tokens' must be a list of token ids"),
    (lambda p: _rewrite(p, header=lambda h: h.update(draft_tokens=[1, 2])), "draft's prefix is not the target's"),
    (lambda p: _rewrite(p, drop=("target.v.1",)), "lacks target.v.1"),
    (lambda p: _rewrite(p, replace={"target.k.0": np.zeros((1, 2, 3), np.float32)}), r"target.k.0 is float32 \[1, 2, 3\]"),
], ids=["truncated", "corrupt", "text", "pickle", "object-array", "no-header", "format", "version", "tokens",
        "tokens-type", "draft-prefix", "missing-array", "shape"])
def test_an_unusable_file_is_refused_and_no_slot_changes(int4_bundle, fresh, saved, damage, message):
    from specedge.errors import PromptCacheError

    gen = fresh(int4_bundle)
    first = gen.generate(input_ids=PROMPT_IDS, max_new_tokens=4, speculation=False)
    damage(saved)
    with pytest.raises(PromptCacheError, match=message):
        gen.load_prompt_cache(saved, exact=True)
    again = gen.generate(input_ids=PROMPT_IDS + first.token_ids, max_new_tokens=2, speculation=False)
    assert again.stats.reused_tokens == len(PROMPT_IDS) + len(first.token_ids) - 1  # the conversation is intact


def test_another_prompts_token_list_is_refused(int4_bundle, fresh, saved, tmp_path):
    """The issue's attack: prompt A's file with prompt B's token list in its header loaded and served
    B's conversation from A's K/V. The sha256 binds the token list to the arrays."""
    from specedge.errors import PromptCacheError

    other = tmp_path / "other.cache"
    other_prefix = list(range(130, 130 + len(PREFIX)))
    fresh(int4_bundle).save_prompt_cache(other, input_ids=other_prefix, exact=True)
    with np.load(other, allow_pickle=False) as archive:
        header = json.loads(archive["header"].tobytes())
    _rewrite(saved, header=lambda h: h.update(tokens=header["tokens"], draft_tokens=header["draft_tokens"]))
    gen = fresh(int4_bundle)
    with pytest.raises(PromptCacheError, match=r"its sha256 does not match its header \(key, token lists\) and arrays"):
        gen.load_prompt_cache(saved, exact=True)
    assert gen.load_prompt_cache(other, exact=True)["token_ids"] == other_prefix  # the untouched file still loads


@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_non_finite_kv_is_refused(int4_bundle, fresh, saved, value):
    """A NaN K array used to load and decode empty text to max_new_tokens, with no NonFiniteLogitsError."""
    from specedge.errors import PromptCacheError

    with np.load(saved, allow_pickle=False) as archive:
        poisoned = np.full_like(archive["target.k.0"], value)
    _rewrite(saved, replace={"target.k.0": poisoned})
    with pytest.raises(PromptCacheError, match=rf"target\.k\.0 holds {poisoned.size} NaN or infinite values"):
        fresh(int4_bundle).load_prompt_cache(saved, exact=True)


def test_paths_are_refused_sensibly(int4_bundle, fresh, tmp_path):
    from specedge.errors import PromptCacheError

    gen = fresh(int4_bundle)
    with pytest.raises(PromptCacheError, match="does not exist"):
        gen.load_prompt_cache(tmp_path / "missing.cache")
    with pytest.raises(PromptCacheError, match="is not a regular file"):
        gen.load_prompt_cache(tmp_path)
    with pytest.raises(PromptCacheError, match=r"folder .*nowhere does not exist"):
        gen.save_prompt_cache(tmp_path / "nowhere" / "x.cache", input_ids=PREFIX)
    with pytest.raises(PromptCacheError, match="is a directory"):
        gen.save_prompt_cache(tmp_path, input_ids=PREFIX)
    path = tmp_path / "named-without-npz"
    gen.save_prompt_cache(path, input_ids=PREFIX)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["named-without-npz"]  # no ".npz" added, no temp left


def test_serve_creates_loads_and_refuses_prompt_caches(int4_bundle, fresh, tmp_path):
    """The startup step of `specedge serve --prompt-cache FILE --system-prompt TEXT`."""
    import click

    from specedge.cli.serve import warm_prompt_cache

    path = tmp_path / "voice.cache"
    system = "t30 t31 t32 t33 t34 t35"
    first = fresh(int4_bundle)
    assert "computed and saved" in warm_prompt_cache(first, path, system)
    restarted = fresh(int4_bundle)
    assert "loaded" in warm_prompt_cache(restarted, path, system)
    assert "loaded" in warm_prompt_cache(fresh(int4_bundle), path, None)  # the file alone is enough
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "t40 t41"}]
    warm = restarted.generate(messages=messages, max_new_tokens=6, speculation=False)
    assert warm.stats.reused_tokens > 0
    cold = fresh(int4_bundle).generate(messages=messages, max_new_tokens=6, speculation=False, reuse_prefix=False)
    # serve warms the default (fast) mode's slots: equal to a cold start up to a near tie of the target
    assert_agrees(restarted, warm.prompt_ids, cold.token_ids, warm.token_ids, exact=False)
    with pytest.raises(click.ClickException, match="holds another prompt than --system-prompt"):
        warm_prompt_cache(fresh(int4_bundle), path, "t50 t51")
    with pytest.raises(click.ClickException, match="does not exist; pass --system-prompt to create it"):
        warm_prompt_cache(fresh(int4_bundle), tmp_path / "none.cache", None)
    _truncate(path)
    with pytest.raises(click.ClickException, match="truncated or corrupt"):
        warm_prompt_cache(fresh(int4_bundle), path, system)
    assert path.stat().st_size > 0  # a refused file is never overwritten


@pytest.mark.parametrize("case", ["tampered", "long-name"])
def test_serve_refuses_a_bad_prompt_cache_with_one_error_line_and_exit_2(int4_bundle, fresh, tmp_path, case):
    """`specedge serve --prompt-cache FILE` with a file it must refuse: the README's one `error:` line
    and exit status 2 before any server starts, no traceback, and the file is left as it was."""
    from click.testing import CliRunner

    from specedge.cli.main import main

    if case == "tampered":  # saved as serve loads it (its default settings), then another token list put in
        path = tmp_path / "serve.cache"
        fresh(int4_bundle).save_prompt_cache(path, input_ids=PREFIX)
        _rewrite(path, header=lambda h: h.update(tokens=PREFIX[::-1], draft_tokens=PREFIX[::-1]))
        message, before = r"its sha256 does not match", path.read_bytes()
    else:
        path, message, before = tmp_path / ("c" * 300), r"the name 'c{24}…' is 300 bytes", None
    result = CliRunner().invoke(main, ["serve", str(int4_bundle), "--prompt-cache", str(path), "--threads", "1",
                                       "--no-warmup", "--port", "0"])
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and re.search(message, lines[0]), result.stderr
    assert "Traceback" not in result.output
    assert before is None or path.read_bytes() == before
