"""Resident memory of one ONNX Runtime session of a bundle's target: VmRSS, RssAnon, RssFile and VmHWM from
/proc/self/status after the session loads and after a 64-token forward (Linux only).

    python docs/results/2026-12-06-session-rss.py BUNDLE
"""
import re
import sys
from pathlib import Path
import numpy as np
from specedge.bundle.manifest import load_manifest
from specedge.engines.base import EngineOptions
from specedge.engines.ort import OrtEngine

def rss(tag):
    s = open("/proc/self/status").read()
    f = {k: int(re.search(rf"{k}:\s+(\d+)", s).group(1)) / 1e6 for k in ("VmRSS", "RssAnon", "RssFile", "VmHWM")}
    print(tag, " ".join(f"{k}={v:.2f}GB" for k, v in f.items()), flush=True)

b = Path(sys.argv[1])
m = load_manifest(b, verify_checksums=False)
rss("start")
e = OrtEngine(m.target, b / m.target.graph, EngineOptions(intra_op_threads=2))
rss("session")
kv = e.new_cache()
e.forward(np.arange(64, dtype=np.int64), kv, num_logits=64)
rss("after a 64-token forward")
