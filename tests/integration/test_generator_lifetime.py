"""Invariant: a Generator loaded from an ONNX bundle (ORT sessions, the batch-invariant target, the
int4 draft) is freed by reference counting alone once dropped, after every kind of call: no
reference cycle keeps its sessions and KV caches alive until a ``gc.collect()`` (issue #41: RSS
grew ~780 MB per load/generate/drop round on a real bundle). The numpy reference Generator and the
RSS check are in tests/unit/test_generator_release.py.
"""

from __future__ import annotations

import gc
import weakref

from specedge.runtime.generator import Generator

PROMPT = "w010 w011 w012"


def test_a_dropped_onnx_generator_is_freed_by_reference_counting_alone(int4_bundle):
    gc.collect()
    gc.disable()
    try:
        gen = Generator.from_bundle(int4_bundle, threads=1, cache_slots=2)
        gen.warmup()
        gen.generate(PROMPT, chat=False, max_new_tokens=8)
        gen.generate(PROMPT, chat=False, max_new_tokens=8, drafter="model", mode="pipelined", exact=True)
        with gen.stream(PROMPT, chat=False, max_new_tokens=8) as stream:
            next(stream)
        gen.prefill(PROMPT + " w013", chat=False)
        freed = weakref.ref(gen)
        del gen, stream
        assert freed() is None, "a reference cycle keeps the Generator alive"
    finally:
        gc.enable()
