"""Invariant: a graph's input and output names are exactly the ModelIO its manifest entry records.

For every attention kind, with the default names and with every name changed: the exporter
(export/graph.py) writes the names it is given, in ModelIO.inputs/outputs order, and the ORT
engine binds the names the manifest gives (renamed tensors give bit-identical logits).

No torch: graphs are built from random weights with export/graph.py (onnx only).
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from specedge.bundle.manifest import ATTENTIONS, ModelEntry, ModelIO


# --------------------------------------------------------------------------- graph IO names


def _tiny_graph(tmp_path, attention: str, io: ModelIO):
    """A 2-layer llama-like graph from random weights, built with ``io``; returns (entry, graph path)."""
    from specedge.export.graph import DecoderSpec, build_decoder

    hidden, heads, kv_heads, head_dim, inter, vocab, layers = 32, 4, 2, 8, 48, 64, 2
    rng = np.random.default_rng(0)
    spec = DecoderSpec(architecture="llama", n_layers=layers, hidden_size=hidden, n_heads=heads, n_kv_heads=kv_heads,
                       head_dim=head_dim, intermediate_size=inter, vocab_size=vocab, norm_eps=1e-5,
                       attn_scale=head_dim ** -0.5, inv_freq=tuple(1e4 ** (-np.arange(0, head_dim, 2) / head_dim)),
                       tied_embeddings=True)
    w = {"embed": rng.normal(0, 0.5, (vocab, hidden)), "norm": np.ones(hidden)}
    for i in range(layers):
        w |= {f"layers.{i}.attn_norm": np.ones(hidden), f"layers.{i}.mlp_norm": np.ones(hidden),
              f"layers.{i}.qkv": rng.normal(0, 0.2, (hidden, (heads + 2 * kv_heads) * head_dim)),
              f"layers.{i}.o": rng.normal(0, 0.2, (heads * head_dim, hidden)),
              f"layers.{i}.gate_up": rng.normal(0, 0.2, (hidden, 2 * inter)),
              f"layers.{i}.down": rng.normal(0, 0.2, (inter, hidden))}
    folder = tmp_path / attention
    folder.mkdir(exist_ok=True)
    graph = folder / f"model-{io.input_ids}.onnx"
    build_decoder(spec, {k: np.asarray(v, np.float32) for k, v in w.items()}, graph, attention=attention,
                  max_context=64, io=io)
    entry = ModelEntry(graph=graph.name, architecture="llama", source="random", precision="fp32", n_layers=layers,
                       n_heads=heads, n_kv_heads=kv_heads, head_dim=head_dim, hidden_size=hidden, vocab_size=vocab,
                       max_context=64, eos_token_ids=(0,), attention=attention, io=io)
    return entry, graph


RENAMED = ModelIO(input_ids="ids", positions="pos", num_logits="keep", logits="scores", past_key="k_cache_%d",
                  past_value="v_cache_%d", new_key="k_new_%d", new_value="v_new_%d", present_key="k_out_%d",
                  present_value="v_out_%d", seqlens_k="lengths", total_sequence_length="total")


@pytest.mark.parametrize("attention", ATTENTIONS)
@pytest.mark.parametrize("io", [ModelIO(), RENAMED], ids=["default-names", "renamed"])
def test_graph_io_names_are_the_manifests_model_io(tmp_path, attention, io):
    entry, graph = _tiny_graph(tmp_path, attention, io)
    model = onnx.load(str(graph), load_external_data=False)
    assert tuple(i.name for i in model.graph.input) == io.inputs(entry.n_layers, attention)
    assert tuple(o.name for o in model.graph.output) == io.outputs(entry.n_layers, attention)


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_the_engine_binds_the_names_the_manifest_gives(tmp_path, attention):
    """The same weights under renamed tensors give the same logits: the engine reads entry.io."""
    from specedge.engines.base import EngineOptions
    from specedge.engines.ort import OrtEngine

    ids = np.array([5, 9, 3, 17, 2], np.int64)
    logits = []
    for io in (ModelIO(), RENAMED):
        entry, graph = _tiny_graph(tmp_path, attention, io)
        engine = OrtEngine(entry, graph, EngineOptions(intra_op_threads=1))
        kv = engine.new_cache()
        prefill = engine.forward(ids[:4], kv, num_logits=1).copy()
        logits.append((prefill, engine.forward(ids[4:], kv, num_logits=1).copy()))
    np.testing.assert_array_equal(logits[0][0], logits[1][0])
    np.testing.assert_array_equal(logits[0][1], logits[1][1])


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_caches_bound_once_stay_apart_and_equal_bindings_made_per_step(tmp_path, attention):
    """A GQA cache's K/V are bound once and kept (engines/ort.py); two caches stepped in turn on one
    engine each give what a fresh binding per step gives, logits and K/V bit for bit."""
    from specedge.engines.base import EngineOptions
    from specedge.engines.ort import OrtEngine

    entry, graph = _tiny_graph(tmp_path, attention, ModelIO())
    engine = OrtEngine(entry, graph, EngineOptions(intra_op_threads=1))
    prompts = ([5, 9, 2, 7], [11, 3, 8])
    kept = [engine.new_cache() for _ in prompts]
    logits = {i: [engine.forward(np.asarray(p, np.int64), kept[i]).copy()] for i, p in enumerate(prompts)}
    for step in range(6):  # interleaved: each forward on one cache between two on the other
        for i in range(len(prompts)):
            ids = np.asarray([(step * 7 + i) % 64] * (1 + step % 3), np.int64)
            logits[i].append(engine.forward(ids, kept[i], num_logits=len(ids)).copy())
    if attention == "gqa":
        assert set(engine._kv_bindings) == set(kept)  # one binding per cache, made once
    for i, prompt in enumerate(prompts):
        fresh = engine.new_cache()
        got = [engine.forward(np.asarray(prompt, np.int64), fresh).copy()]
        for step in range(6):
            ids = np.asarray([(step * 7 + i) % 64] * (1 + step % 3), np.int64)
            engine._kv_bindings.pop(fresh, None)  # what every step did before: bind the cache again
            got.append(engine.forward(ids, fresh, num_logits=len(ids)).copy())
        assert all(np.array_equal(a, b) for a, b in zip(logits[i], got))
        n = kept[i].length
        assert all(np.array_equal(a[..., :n, :] if attention == "gqa" else a[:n], b[..., :n, :] if attention == "gqa"
                                  else b[:n]) for a, b in zip(kept[i].keys, fresh.keys))
