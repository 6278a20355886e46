"""Paired 1-row step times of N bundles' models, interleaved, at 256 cached tokens (2026-12-06, #37).

    python docs/results/2026-12-06-gguf-layout-steps.py [--role target|draft] [--reps 120] BUNDLE...

Loads each bundle's engines with ``runtime.loading.load_bundle`` (2 intra-op threads, checksums
skipped), fills 256 positions, then times one 1-token forward per bundle per round, in an order that
rotates every round so drift and neighbours' load fall on all bundles alike. Prints each bundle's
median and the median of its per-round ratio to the first bundle.
"""
import argparse
import statistics

import numpy as np

from specedge.runtime.costs import time_forward
from specedge.runtime.loading import load_bundle

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("bundles", nargs="+", help="bundle folders; ratios are to the first")
parser.add_argument("--role", choices=("target", "draft"), default="target", help="which model to time")
parser.add_argument("--reps", type=int, default=120, help="timed rounds (one step per bundle each)")
parser.add_argument("--context", type=int, default=256, help="cached tokens before the timed steps")
args = parser.parse_args()

engines = []
for path in args.bundles:
    loaded = load_bundle(path, threads=2, verify_checksums=False, load_draft=args.role == "draft")
    engine = loaded.target if args.role == "target" else loaded.draft
    kv = engine.new_cache()
    engine.forward((np.arange(args.context) * 37 % 20000 + 100).astype(np.int64), kv, 1)
    for _ in range(5):
        time_forward(engine, kv, np.array([11], np.int64))
    engines.append((engine, kv))
times = [[] for _ in engines]
for r in range(args.reps):
    for j in range(len(engines)):
        i = (r + j) % len(engines)
        engine, kv = engines[i]
        times[i].append(time_forward(engine, kv, np.array([11], np.int64)))
for path, t in zip(args.bundles, times):
    ratio = statistics.median(b / a for a, b in zip(times[0], t))
    print(f"{args.role} {path}: median {statistics.median(t) * 1e3:.2f} ms, p25 {np.percentile(t, 25) * 1e3:.2f}, "
          f"p75 {np.percentile(t, 75) * 1e3:.2f}, ratio to first {ratio:.3f}")
