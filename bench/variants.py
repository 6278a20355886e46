"""Sweep verify-graph and draft variants: step ms, v(k), c, acceptance, predicted speedup.

    specedge bench variants --target qwen2.5-coder-1.5b-instruct \\
        --draft qwen2.5-coder-0.5b-instruct --work /tmp/variants --threads 2

For each target variant (bits, block size, accuracy level, attention) it builds the
graph once, times 1..9-token steps on a cache of ``--context`` positions (medians),
and for each draft variant (precision, early exit, truncated head) the 1-token draft
step and the greedy acceptance on a few prompts of the bench suite. It prints one
table and Leviathan's predicted speedup (1-a^(k+1)) / ((1-a)(k c + v(k))) at the best
k, so the variant to ship is the one that maximises it. Timings are medians; run on an
otherwise idle machine.
"""

from __future__ import annotations

import json
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .metrics import leviathan_speedup


@dataclass(frozen=True)
class GraphVariant:
    name: str
    precision: str = "int4"  # fp32 | int4 | int8
    block_size: int = 32
    accuracy_level: int = 4
    symmetric: bool = True
    attention: str = "gqa"
    layers: int | None = None  # drafts: early exit after this many layers
    head: int | None = None  # drafts: truncated output layer size


TARGETS = [
    GraphVariant("int4-b32-acc4"),
    GraphVariant("int4-b32-acc1", accuracy_level=1),
    GraphVariant("int4-b128-acc4", block_size=128),
    GraphVariant("int8-b32-acc4", precision="int8"),
    GraphVariant("fp32", precision="fp32"),
]
DRAFTS = [
    GraphVariant("int4-b32-acc4"),
    GraphVariant("int4-acc4-head32k", head=32768),
    GraphVariant("int8-b32-acc4", precision="int8"),
]


def build(loaded, variant: GraphVariant, folder: Path, max_context: int, head_ids=None):
    """Write one variant's graph; return (ModelEntry, graph path)."""
    from ..export.bundle import ExportConfig, _ModelExporter

    folder.mkdir(parents=True, exist_ok=True)
    config = ExportConfig(target="-", out=folder / "unused", precision=variant.precision,
                          block_size=variant.block_size, accuracy_level=variant.accuracy_level,
                          attention=variant.attention, max_context=max_context, quiet=True)
    exporter = _ModelExporter(folder, loaded, config, "")
    entry = exporter._write(variant.name, variant.precision, loaded.source, layers=variant.layers,
                            head_ids=head_ids if variant.head else None)
    return entry, folder / entry.graph


def step_times(entry, graph: Path, threads: int, context: int, max_n: int = 9, repeats: int = 10) -> dict[int, float]:
    from ..engines.base import EngineOptions
    from ..engines.ort import OrtEngine
    from ..runtime.costs import median_forward

    engine = OrtEngine(entry, graph, EngineOptions(intra_op_threads=threads))
    kv = engine.new_cache()
    ids = np.random.default_rng(0).integers(0, entry.vocab_size, context + max_n).astype(np.int64)
    engine.forward(ids[:context], kv, 1)
    return {n: median_forward(engine, kv, ids[context:context + n], repeats=repeats) for n in range(1, max_n + 1)}


def greedy_tokens(entry, graph: Path, prompts: list[list[int]], max_new_tokens: int, threads: int) -> list[list[int]]:
    """The target variant's own greedy continuations (the sequences the draft must predict)."""
    from ..engines.base import EngineOptions
    from ..engines.ort import OrtEngine
    from ..runtime import loop
    from ..runtime.sampling import SamplingConfig

    engine = OrtEngine(entry, graph, EngineOptions(intra_op_threads=threads))
    kv = engine.new_cache()
    out = []
    for ids in prompts:
        result = loop.LoopResult()
        for _ in loop.run(engine, kv, np.array(ids), max_new_tokens=max_new_tokens, eos_token_ids=entry.eos_token_ids,
                          sampling=SamplingConfig(), rng=np.random.default_rng(0), result=result):
            pass
        out.append(result.tokens)
    return out


def teacher_forced_agreement(entry, graph: Path, prompts: list[list[int]], continuations: list[list[int]],
                             head_ids=None) -> float:
    """Fraction of target tokens the draft's argmax predicts given the target's prefix: a per-token a."""
    from ..engines.base import EngineOptions
    from ..engines.ort import OrtEngine

    engine = OrtEngine(entry, graph, EngineOptions())
    hits = total = 0
    for ids, cont in zip(prompts, continuations):
        if not cont:
            continue
        seq = np.array(ids + cont, np.int64)
        logits = engine.forward(seq[:-1], engine.new_cache(), num_logits=len(cont))
        guess = logits.argmax(-1)
        if head_ids is not None:
            guess = head_ids[guess]
        hits += int((guess == np.array(cont)).sum())
        total += len(cont)
    return hits / total if total else 0.0


def run(*, target: str, draft: str, work: Path, threads: int, context: int, max_context: int, max_new_tokens: int,
        target_variants: tuple[str, ...], draft_variants: tuple[str, ...], json_out: Path | None) -> int:
    """Run the sweep (defaults live in ``specedge bench variants``); print the table, write
    ``json_out`` if given. ``work`` is deleted first and used as scratch space."""
    from ..export.bundle import draft_head_tokens
    from ..export.loader import load_source
    from .suite import load_suite

    shutil.rmtree(work, ignore_errors=True)
    targets, drafts = {}, {}

    loaded = load_source(target, quiet=True)
    tok = loaded.tokenizer
    texts = [w.prompt for w in load_suite().select(["code", "chat", "grounded"], per_category=1)
             if isinstance(w.prompt, str)]
    if tok.chat_template:
        prompts = [list(tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                                tokenize=True, return_dict=False)) for t in texts]
    else:
        prompts = [tok.encode(t)[:256] for t in texts]
    continuations = None
    for variant in [v for v in TARGETS if v.name in target_variants]:
        folder = work / f"t-{variant.name}"
        entry, graph = build(loaded, variant, folder, max_context)
        t = step_times(entry, graph, threads, context)
        targets[variant.name] = {"step_ms": t[1] * 1e3, "v": {n: t[n] / t[1] for n in t}}
        if continuations is None:  # the first target variant is the reference for acceptance
            continuations = greedy_tokens(entry, graph, prompts, max_new_tokens, threads)
        print(f"target {variant.name}: step {t[1] * 1e3:.1f} ms, v(5) {t[5] / t[1]:.2f}, v(9) {t[9] / t[1]:.2f}",
              file=sys.stderr, flush=True)
        shutil.rmtree(folder, ignore_errors=True)
    vocab = loaded.model.config.vocab_size
    del loaded

    draft_loaded = load_source(draft, quiet=True)
    for variant in [v for v in DRAFTS if v.name in draft_variants]:
        head_ids = draft_head_tokens(tok, vocab, variant.head, draft_loaded.eos_token_ids) if variant.head else None
        folder = work / f"d-{variant.name}"
        entry, graph = build(draft_loaded, variant, folder, max_context, head_ids)
        t = step_times(entry, graph, threads, context, max_n=1)
        a = teacher_forced_agreement(entry, graph, prompts, continuations, head_ids)
        drafts[variant.name] = {"step_ms": t[1] * 1e3, "a": a}
        print(f"draft {variant.name}: step {t[1] * 1e3:.1f} ms, teacher-forced a {a:.3f}", file=sys.stderr, flush=True)
        shutil.rmtree(folder, ignore_errors=True)

    print("| target | draft | step ms | v(5) | v(9) | c | a | best k | predicted speedup |")
    print("|---|---|---|---|---|---|---|---|---|")
    table = []
    for tname, trow in targets.items():
        for dname, drow in drafts.items():
            c = drow["step_ms"] / trow["step_ms"]
            best = max(range(0, 9), key=lambda k: leviathan_speedup(drow["a"], k, c, trow["v"][k + 1]))
            speed = leviathan_speedup(drow["a"], best, c, trow["v"][best + 1])
            table.append({"target": tname, "draft": dname, "c": c, "a": drow["a"], "best_k": best,
                          "predicted": speed})
            print(f"| {tname} | {dname} | {trow['step_ms']:.1f} | {trow['v'][5]:.2f} | {trow['v'][9]:.2f} | "
                  f"{c:.2f} | {drow['a']:.2f} | {best} | {speed:.2f}x |")
    if json_out is not None:
        json_out.write_text(json.dumps({"targets": targets, "drafts": drafts, "table": table}, indent=2))
    return 0
