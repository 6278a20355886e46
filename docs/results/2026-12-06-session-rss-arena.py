"""RSS of one ORT session of a bundle's target after load and after forwards of 1-96 tokens, arena on or off.

Usage: python 2026-12-06-session-rss-arena.py BUNDLE arena|noarena
"""
import sys, numpy as np, onnxruntime as ort
from pathlib import Path
arena = sys.argv[2] == "arena"
if not arena:
    real = ort.SessionOptions
    class SO(real):
        def __init__(self):
            super().__init__(); self.enable_cpu_mem_arena = False
    ort.SessionOptions = SO
from specedge.bundle.manifest import load_manifest
from specedge.engines.ort import OrtEngine
from specedge.engines.base import EngineOptions
def st():
    d = {}
    for line in open("/proc/self/status"):
        k, v = line.split(":", 1)
        if k in ("VmRSS", "VmHWM", "RssAnon", "RssFile"): d[k] = int(v.split()[0]) / 1e6
    return " ".join(f"{k} {v:.2f}" for k, v in d.items())
b = Path(sys.argv[1]); m = load_manifest(b)
print("before", st(), flush=True)
e = OrtEngine(m.target, b / m.target.graph, EngineOptions())
print("loaded", st(), flush=True)
rng = np.random.default_rng(0)
for n in (1, 16, 64, 96):
    kv = e.new_cache()
    e.forward(rng.integers(0, m.target.vocab_size, n).astype(np.int64), kv, num_logits=n)
    print(f"forward {n}", st(), flush=True)
