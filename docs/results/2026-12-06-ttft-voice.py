"""TTFT of the default against 1-row plain decoding on the bench suite's longest voice prompt, interleaved.

Usage: python docs/results/2026-12-06-ttft-voice.py BUNDLE [ROUNDS=8]
Each round runs plain and the default (order alternating), each as a cold request on a Generator that has
forgotten every reply (a fresh deployment: the default's draft has read nothing). Prints each TTFT and the
medians. Not a test."""
import statistics
import sys

from specedge.bench.suite import load_suite
from specedge.runtime.generator import Generator
from specedge.runtime.options import GenerationConfig

bundle = sys.argv[1]
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 8
gen = Generator.from_bundle(bundle, threads=2, verify_checksums=False)
gen.warmup()
prompts = [(w, *w.encode(gen)) for w in load_suite().select(["voice"], None)]
w, ids, chat = max(prompts, key=lambda p: len(p[1]))
configs = {"plain": GenerationConfig(max_new_tokens=64, speculation=False, chat=chat, reuse_prefix=False),
           "default": GenerationConfig(max_new_tokens=64, chat=chat, reuse_prefix=False)}
ttft = {name: [] for name in configs}
for r in range(rounds):
    for name in (list(configs) if r % 2 == 0 else list(reversed(configs))):
        gen.forget_replies()
        result = gen.generate(input_ids=ids, config=configs[name])
        ttft[name].append(result.stats.time_to_first_token_s)
print(f"{w.id}: {len(ids)} prompt tokens, {rounds} interleaved rounds")
for name, values in ttft.items():
    print(f"{name:<8} median {1e3 * statistics.median(values):.0f} ms  " + " ".join(f"{1e3 * v:.0f}" for v in values))
ratios = [d / p for d, p in zip(ttft["default"], ttft["plain"])]
print(f"default/plain TTFT, median of paired ratios: {statistics.median(ratios):.3f}")
