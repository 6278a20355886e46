"""Hardening: long back-to-back runs do not grow memory, and the KV caches are allocated once.

What this module tries, on a tiny llama target with its int4 self-draft (max_context 1024):

- 20 generations of 512 tokens each, back to back, with speculation on (the model
  drafter, fixed k = 4, so every run does the same work), after one warm-up generation
  that lets ONNX Runtime's arenas reach their working size. The process's resident set
  (VmRSS from /proc/self/status) may grow by less than RSS_GROWTH_BOUND_MB; both numbers
  are printed (run with ``-s``);
- the Generator's target and draft KV caches are the same objects with the same buffers
  (``ctypes.data`` of every layer's K and V) before and after, with capacity equal to
  max_context: bounded and reused, never reallocated per call;
- every run produced the same 512 tokens (no state leaks from one run into the next).
"""

from __future__ import annotations

import gc
from pathlib import Path

import pytest

from specedge.runtime.generator import Generator
from tiny_models import build_model

MAX_CONTEXT = 1024
RUNS = 20
NEW_TOKENS = 512
# The KV caches are ~0.5 MB here; what could grow is per-call Python state (stats lists, profiles)
# or ORT arenas. 20 MB is far above noise from the allocator and far below a per-run leak of
# anything the size of a cache or a logits history (20 runs x >= 1 MB).
RSS_GROWTH_BOUND_MB = 20.0
PROMPT = list(range(6, 26))


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024  # kB -> MB
    pytest.skip("no VmRSS in /proc/self/status")


def _buffers(gen: Generator) -> list[tuple[int, int]]:
    out = []
    for cache in (gen.target_kv, gen.draft_kv):
        out += [(id(cache), a.ctypes.data) for a in (*cache.keys, *cache.values)]
    return out


@pytest.fixture(scope="module")
def gen(tmp_path_factory) -> Generator:
    from specedge.export.bundle import ExportConfig, export_bundle

    root = tmp_path_factory.mktemp("hardening-long")
    folder = build_model(root / "model", "llama", 0)
    out = root / "bundle"
    export_bundle(ExportConfig(target=str(folder), out=out, draft="self-int4", max_context=MAX_CONTEXT, quiet=True))
    return Generator.from_bundle(out, threads=1)


def test_back_to_back_long_generations_do_not_grow_memory(gen):
    settings = dict(input_ids=PROMPT, max_new_tokens=NEW_TOKENS, drafter="model", draft_tokens=4, adaptive=False)
    first = gen.generate(**settings)  # warm-up: arenas, tokenizer caches, lazily built templates
    assert len(first.token_ids) == NEW_TOKENS and first.finish_reason == "length"
    assert first.stats.drafted > 0 and first.stats.accepted > 0  # speculation really ran
    caches = (gen.target_kv, gen.draft_kv)
    buffers = _buffers(gen)
    del first
    gc.collect()
    before = _rss_mb()
    outputs = []
    for _ in range(RUNS):
        result = gen.generate(**settings)
        outputs.append(result.token_ids)
        del result
    gc.collect()
    after = _rss_mb()
    print(f"\n[hardening] RSS before {before:.1f} MB, after {RUNS} x {NEW_TOKENS} tokens {after:.1f} MB "
          f"(growth {after - before:+.1f} MB, bound {RSS_GROWTH_BOUND_MB:.0f} MB)")
    assert after - before < RSS_GROWTH_BOUND_MB
    assert all(tokens == outputs[0] for tokens in outputs) and len(outputs[0]) == NEW_TOKENS
    assert (gen.target_kv, gen.draft_kv) == caches and _buffers(gen) == buffers
    for cache in caches:
        assert cache.capacity == MAX_CONTEXT
        assert all(k.shape[-2] == MAX_CONTEXT for k in cache.keys)  # head-major [1, kv, capacity, dim]
