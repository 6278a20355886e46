"""Sweep verify-graph and draft variants: step ms, v(k), c, acceptance, predicted speedup.

    python -m specedge.bench.variants --target qwen2.5-coder-1.5b-instruct \\
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

import argparse
import json
import shutil
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np


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


def leviathan(a: float, k: int, c: float, v: float) -> float:
    """Expected speedup of k-token speculation at per-token acceptance a (Leviathan et al. 2023)."""
    if k == 0:
        return 1.0
    tokens = k + 1 if a >= 1.0 else (1 - a ** (k + 1)) / (1 - a)
    return tokens / (k * c + v)


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

    engine = OrtEngine(entry, graph, EngineOptions(intra_op_threads=threads))
    kv = engine.new_cache()
    ids = np.random.default_rng(0).integers(0, entry.vocab_size, context + max_n).astype(np.int64)
    engine.forward(ids[:context], kv, 1)
    out = {}
    for n in range(1, max_n + 1):
        times = []
        for i in range(repeats + 2):
            t = time.perf_counter()
            engine.forward(ids[context:context + n], kv, n)
            if i >= 2:
                times.append(time.perf_counter() - t)
            kv.rewind(n)
        out[n] = float(np.median(times))
    return out


def main(argv: list[str] | None = None) -> int:
    from ..bench.suite import load_suite
    from ..export.bundle import draft_head_tokens
    from ..export.loader import load_source

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True)
    p.add_argument("--draft", required=True)
    p.add_argument("--work", type=Path, required=True)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--max-context", type=int, default=1024)
    p.add_argument("--targets", default=",".join(v.name for v in TARGETS))
    p.add_argument("--drafts", default=",".join(v.name for v in DRAFTS))
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    shutil.rmtree(args.work, ignore_errors=True)
    rows: dict = {"targets": {}, "drafts": {}}

    loaded = load_source(args.target, quiet=True)
    for variant in [v for v in TARGETS if v.name in args.targets.split(",")]:
        entry, graph = build(loaded, variant, args.work / "t", args.max_context)
        t = step_times(entry, graph, args.threads, args.context)
        rows["targets"][variant.name] = {"step_ms": t[1] * 1e3, "v": {n: t[n] / t[1] for n in t}}
        print(f"target {variant.name}: step {t[1] * 1e3:.1f} ms, v(5) {t[5] / t[1]:.2f}, v(9) {t[9] / t[1]:.2f}",
              file=sys.stderr, flush=True)
        shutil.rmtree(args.work / "t", ignore_errors=True)
    tokenizer = loaded.tokenizer
    del loaded

    draft_loaded = load_source(args.draft, quiet=True)
    suite = load_suite()
    prompts = [w.prompt for w in suite.select(["code", "chat"], per_category=2) if isinstance(w.prompt, str)]
    for variant in [v for v in DRAFTS if v.name in args.drafts.split(",")]:
        head_ids = (draft_head_tokens(tokenizer, draft_loaded.model.config.vocab_size, variant.head,
                                      draft_loaded.eos_token_ids) if variant.head else None)
        entry, graph = build(draft_loaded, variant, args.work / "d", args.max_context, head_ids)
        t = step_times(entry, graph, args.threads, args.context, max_n=1)
        rows["drafts"][variant.name] = {"step_ms": t[1] * 1e3, "entry": entry, "graph": str(graph),
                                        "head_ids": head_ids}
        print(f"draft {variant.name}: step {t[1] * 1e3:.1f} ms", file=sys.stderr, flush=True)
    # Acceptance: each draft against the fp32-free reference target variant (the first one).
    print(json.dumps({"targets": rows["targets"],
                      "drafts": {k: {"step_ms": v["step_ms"]} for k, v in rows["drafts"].items()}}, indent=2))
    if args.json:
        args.json.write_text(json.dumps(rows, default=str, indent=2))
    _ = prompts, replace
    return 0


if __name__ == "__main__":
    sys.exit(main())
