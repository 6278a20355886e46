"""Fast mode's near-tie bound measured over the tokens that can win (issue #36), 2026-12-07.

    python docs/results/2026-12-07-near-tie-bound.py ranks BUNDLE [ROLE] [TRIALS]
    python docs/results/2026-12-07-near-tie-bound.py suite BUNDLE [MAX_NEW_TOKENS]

ranks: the largest |verify row - 1-row step| logit difference over the tokens ranked in the first K of
either row, for K = 1, 4, 16, 64, 256 and the whole vocabulary; the largest spread of that difference
within the top K (what the top-2 gap must exceed for no argmax to flip); and the rows whose argmax
flipped, with their top-2 gap. TRIALS random 16-token prompts (default 6), each followed by verifies of
2, 3, 5 and 9 tokens. Then export/validate.py ``batch_variance`` as a new export records it.

suite: every prompt of the bench suite, fast 1-row plain decoding against fast speculation (the default
drafter, n-gram k=4, suffix k=8, and with a draft model k=2 and k=5); at each divergence, the target's
top-2 gap (runtime/divergence.explain) against the near-tie bound the bundle recorded and the one a new
export records (twice ``batch_variance``, at least runtime/verify.py's NEAR_TIE_GAP).
"""
import sys
from pathlib import Path

import numpy as np

from specedge.bench.suite import load_suite
from specedge.bundle.manifest import load_manifest, resolve_inside
from specedge.engines.base import EngineOptions
from specedge.engines.ort import OrtEngine
from specedge.export.validate import batch_variance
from specedge.runtime.divergence import explain
from specedge.runtime.generator import Generator
from specedge.runtime.verify import near_tie_gap

RANKS = (1, 4, 16, 64, 256)


def ranks(bundle: Path, role: str = "target", trials: int = 6) -> None:
    manifest = load_manifest(bundle, verify_checksums=False)
    entry = manifest.target if role == "target" else manifest.draft
    graph = resolve_inside(bundle, entry.graph)
    engine = OrtEngine(entry, graph, EngineOptions())
    rng = np.random.default_rng(1)
    worst = {k: 0.0 for k in (*RANKS, "all")}
    spread = {k: 0.0 for k in RANKS}
    flips = []
    for _ in range(trials):
        for verify in (2, 3, 5, 9):
            ids = rng.integers(0, entry.vocab_size, size=16 + verify).astype(np.int64)
            kv = engine.new_cache()
            engine.forward(ids[:16], kv, num_logits=1)
            rows = engine.forward(ids[16:], kv, num_logits=verify).astype(np.float64)
            kv.rewind(verify)
            steps = np.stack([engine.forward(ids[16 + i:17 + i], kv, num_logits=1)[-1].astype(np.float64)
                              for i in range(verify)])
            diff = rows - steps
            worst["all"] = max(worst["all"], float(np.abs(diff).max()))
            for r in range(verify):
                for k in RANKS:
                    top = np.union1d(np.argsort(-rows[r])[:k], np.argsort(-steps[r])[:k])
                    worst[k] = max(worst[k], float(np.abs(diff[r, top]).max()))
                    spread[k] = max(spread[k], float(diff[r, top].max() - diff[r, top].min()))
                if rows[r].argmax() != steps[r].argmax():
                    first, second = np.sort(rows[r])[-2:][::-1]
                    flips.append(round(float(first - second), 4))
    print(f"{bundle.name} {role}: {trials} prompts x verify 2/3/5/9")
    print("  max |row - step| over the top K of either row:",
          ", ".join(f"K={k}: {v:.4f}" for k, v in worst.items()))
    print("  max spread of (row - step) within the top K:", ", ".join(f"K={k}: {v:.4f}" for k, v in spread.items()))
    print(f"  argmax flips: {len(flips)}, their top-2 gaps {flips}")
    print(f"  recorded batch_variance {manifest.extra.batch_variance.get(role)}; "
          f"export/validate.batch_variance now {batch_variance(entry, graph):.4f}")


def suite(bundle: Path, max_new_tokens: int = 48) -> None:
    manifest = load_manifest(bundle, verify_checksums=False)
    gen = Generator.from_bundle(bundle, threads=2)
    new_bound = near_tie_gap(manifest.target.precision,
                             batch_variance(manifest.target, resolve_inside(bundle, manifest.target.graph)))
    configs = [{}, {"drafter": "ngram", "draft_tokens": 4, "adaptive": False},
               {"drafter": "suffix", "draft_tokens": 8, "adaptive": False}]
    if gen.draft is not None:
        configs += [{"drafter": "model", "draft_tokens": k, "adaptive": False} for k in (2, 5)]
    gaps, compared = [], 0
    for workload in load_suite().workloads:
        ids, _ = workload.encode(gen)
        plain = gen.generate(input_ids=ids, max_new_tokens=max_new_tokens, speculation=False, chat=False,
                             reuse_prefix=False)
        for config in configs:
            spec = gen.generate(input_ids=ids, max_new_tokens=max_new_tokens, chat=False, reuse_prefix=False, **config)
            compared += 1
            d = explain(gen.target.inner, ids, plain.token_ids, spec.token_ids, near_tie=new_bound)
            if d is not None:
                gaps.append(d.top2_gap)
                print(f"{workload.id} {config or 'default'}: token {d.index}, top-2 gap {d.top2_gap:.4f}"
                      f"{'' if d.near_tie else '  OUTSIDE THE NEW BOUND'}", flush=True)
    print(f"{compared} comparisons, {len(gaps)} divergences, largest top-2 gap {max(gaps, default=0):.4f}; "
          f"near-tie bound recorded {gen.near_tie_gap:.4f}, measured now {new_bound:.4f}")


if __name__ == "__main__":
    mode, path, *rest = sys.argv[1:]
    if mode == "ranks":
        ranks(Path(path), rest[0] if rest else "target", int(rest[1]) if len(rest) > 1 else 6)
    else:
        suite(Path(path), int(rest[0]) if rest else 48)
