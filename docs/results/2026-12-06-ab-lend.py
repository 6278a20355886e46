"""Paired, interleaved A/B of DefaultK.LEND_FIRST_STEP on the bench's workloads, against 1-row plain decoding.

Usage: python docs/results/2026-12-06-ab-lend.py BUNDLE [WORKLOADS=chat,voice] [ROUNDS=4]
As the bench: per workload a fresh deployment (Generator.forget_replies), 2 prompts, cold requests, a reply memory
per (configuration, round), the order reversed on odd rounds; the two policies keep their own learned memory (the
snapshot the default policy carries between replies), swapped in before each call. Prints, per workload, the
median of paired tok/s ratios to plain (the bench's ratio) and the model steps each run took. Not a test."""
import statistics
import sys

from specedge.bench.suite import load_suite
from specedge.runtime.generator import Generator
from specedge.runtime.options import GenerationConfig
from specedge.runtime.policies import DefaultK
from specedge.runtime.suffix import ReplyMemory
from specedge.runtime.suffix_drafter import DEFAULT_DEPTH, DEFAULT_MEMORY_TOKENS

bundle = sys.argv[1]
categories = (sys.argv[2] if len(sys.argv) > 2 else "chat,voice").split(",")
rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 4
gen = Generator.from_bundle(bundle, threads=2, verify_checksums=False)
gen.warmup()
suite = load_suite()
variants = ("plain", "lend", "no-lend")
for category in categories:
    prompts = [(w, *w.encode(gen)) for w in suite.select([category], 2)]
    learned = {v: {} for v in variants}  # each policy variant's own SpeculationMemory.learned
    gen.forget_replies()
    lengths = gen.memory.reply_lengths
    ratios = {v: [] for v in variants[1:]}
    steps = {v: [] for v in variants[1:]}
    replies = {}
    for r in range(rounds):
        for w, ids, chat in prompts:
            rates = {}
            for v in (variants if r % 2 == 0 else tuple(reversed(variants))):
                DefaultK.LEND_FIRST_STEP = v == "lend"
                gen.memory.learned = learned[v]
                gen.memory.replies = replies.setdefault((v, r), ReplyMemory(DEFAULT_DEPTH, DEFAULT_MEMORY_TOKENS))
                config = GenerationConfig(max_new_tokens=64, chat=chat, reuse_prefix=False, speculation=v != "plain")
                result = gen.generate(input_ids=ids, config=config)
                rates[v] = result.stats.tokens_per_s
                if v != "plain":
                    steps[v].append(int(result.stats.policy.get("model_steps", 0)))
            for v in variants[1:]:
                ratios[v].append(rates[v] / rates["plain"])
    print(f"{category}: " + "; ".join(f"{v} {statistics.median(ratios[v]):.3f}x (worst {min(ratios[v]):.3f}, "
                                        f"model steps per run {steps[v]})" for v in variants[1:]), flush=True)
DefaultK.LEND_FIRST_STEP = True
