"""A prefill of N random tokens in one forward vs chunks of 256/128/64, interleaved, median of 5 rounds.

Usage: python 2026-12-06-prefill-chunks.py BUNDLE N  (docs/results/2026-12-06-export-memory-2.md)
"""
import sys, time, statistics
import numpy as np
from pathlib import Path
from specedge.bundle.manifest import load_manifest
from specedge.engines.ort import OrtEngine
from specedge.engines.base import EngineOptions
b = Path(sys.argv[1]); n = int(sys.argv[2])
m = load_manifest(b)
e = OrtEngine(m.target, b / m.target.graph, EngineOptions(intra_op_threads=2))
ids = np.random.default_rng(0).integers(0, m.target.vocab_size, n).astype(np.int64)
kv = e.new_cache()
def run(chunk):
    kv.length = 0
    t = time.perf_counter()
    for s in range(0, n, chunk):
        out = e.forward(ids[s:s+chunk], kv, num_logits=1)
    return time.perf_counter() - t, out.copy()
run(n); run(128)
res = {c: [] for c in (n, 256, 128, 64)}
outs = {}
for r in range(5):
    for c in res:
        t, o = run(c); res[c].append(t); outs[c] = o
base = statistics.median(res[n])
for c in res:
    print(f"{b.name} n={n} chunk={c}: {statistics.median(res[c])*1e3:.0f} ms  ratio {statistics.median(res[c])/base:.3f}  same-logits {np.array_equal(outs[c], outs[n])}  maxdiff {np.abs(outs[c]-outs[n]).max():.2e}")
