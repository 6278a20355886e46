"""1-token target steps with and without glibc's huge-page tunable, in alternating processes.

    python docs/results/2026-12-08-huge-pages.py BUNDLE [PAIRS]
    python docs/results/2026-12-08-huge-pages.py /work/bundles/qwen-wide 4

GLIBC_TUNABLES=glibc.malloc.hugetlb=1 must be set before a process starts, so each side is its own
process: PAIRS pairs, the side without the tunable first in odd pairs and second in even ones. Each
process loads the bundle (threads 2), warms it up, prefills 200 tokens and times 60 1-token steps of the
target; it reports the median step, its resident memory and how much of it sits in huge pages. Printed:
every process's figures, then the median over pairs of (with / without) step times.
"""
import json
import os
import statistics
import subprocess
import sys

CHILD = r"""
import json, re, sys, time
import numpy as np
from specedge.runtime.generator import Generator
gen = Generator.from_bundle(sys.argv[1], threads=2)
gen.warmup()
engine = gen.target.inner
kv = engine.new_cache()
ids = np.random.default_rng(0).integers(100, 5000, 260).astype(np.int64)
engine.forward(ids[:200], kv, num_logits=1)
times = []
for i in range(60):
    start = time.perf_counter()
    engine.forward(ids[200 + i:201 + i], kv, num_logits=1)
    times.append(time.perf_counter() - start)
status = open("/proc/self/status").read()
rollup = open("/proc/self/smaps_rollup").read()
print(json.dumps({"step_ms": float(np.median(times)) * 1e3,
                  "rss_mb": int(re.search(r"VmRSS:\s+(\d+)", status).group(1)) / 1024,
                  "huge_mb": int(re.search(r"AnonHugePages:\s+(\d+)", rollup).group(1)) / 1024}))
"""
TUNABLE = "glibc.malloc.hugetlb=1"


def run(bundle: str, huge: bool) -> dict:
    env = dict(os.environ)
    tunables = [t for t in env.get("GLIBC_TUNABLES", "").split(":") if t and not t.startswith("glibc.malloc.hugetlb")]
    env["GLIBC_TUNABLES"] = ":".join(tunables + ([TUNABLE] if huge else []))
    out = subprocess.run([sys.executable, "-c", CHILD, bundle], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


bundle = sys.argv[1]
pairs = int(sys.argv[2]) if len(sys.argv) > 2 else 4
ratios = []
for pair in range(pairs):
    order = (False, True) if pair % 2 == 0 else (True, False)
    got = {huge: run(bundle, huge) for huge in order}
    for huge in (False, True):
        r = got[huge]
        print(f"pair {pair + 1} {'with   ' if huge else 'without'}: step {r['step_ms']:.2f} ms, "
              f"RSS {r['rss_mb']:.0f} MB, in huge pages {r['huge_mb']:.0f} MB")
    ratios.append(got[True]["step_ms"] / got[False]["step_ms"])
print(f"{bundle}: step with / without the tunable, median of {pairs} pairs: {statistics.median(ratios):.3f} "
      f"(each: {', '.join(f'{r:.3f}' for r in ratios)})")
