"""Interleaved A/B of DefaultK (new) against a variant of it (old).

Usage: python docs/results/2026-12-05-ab-lookup-share.py BUNDLE CATEGORIES PROMPTS ROUNDS [VARIANT]
VARIANT (default lookup-share): lookup-share = a catch-up weighed against the whole reply (the rule before
48a32cf); budget1024 = the exploration budget capped at 1024 plain steps instead of BUDGET_STEPS.
Two Generators (one per variant, each with its own learned state); per round baseline, old, new (reversed
on odd rounds); each variant keeps its own reply memory per round, as `specedge bench run` does. Not a test."""
import sys, json, statistics as st, collections
from specedge.runtime import generator as G
from specedge.runtime.policies import DEFAULT_POLICY, POLICIES, DefaultK
from specedge.runtime.options import GenerationConfig
from specedge.runtime.suffix import ReplyMemory
from specedge.runtime.suffix_drafter import DEFAULT_DEPTH, DEFAULT_MEMORY_TOKENS
from specedge.bench.suite import load_suite

class WholeReplyK(DefaultK):
    def lookup_share(self):
        return 0.0

class BigBudgetK(DefaultK):
    BUDGET_STEPS = 1024

bundle, cats, prompts, rounds = sys.argv[1], sys.argv[2].split(","), int(sys.argv[3]), int(sys.argv[4])
OldK = {"lookup-share": WholeReplyK, "budget1024": BigBudgetK}[sys.argv[5] if len(sys.argv) > 5 else "lookup-share"]
gens = {"old": G.Generator.from_bundle(bundle, threads=2), "new": G.Generator.from_bundle(bundle, threads=2)}
for g in gens.values():
    g.warmup()
suite = load_suite()
out = collections.defaultdict(lambda: collections.defaultdict(list))
src = collections.defaultdict(lambda: collections.defaultdict(collections.Counter))
for cat in cats:
    for g in gens.values():
        g.forget_replies()
    mem = {}
    ws = suite.select([cat], prompts)
    for w in ws:
        ids, chat = w.encode(gens["new"])
        for r in range(rounds):
            order = ["base", "old", "new"] if r % 2 == 0 else ["new", "old", "base"]
            res = {}
            for v in order:
                gen = gens["new" if v == "base" else v]
                POLICIES[DEFAULT_POLICY] = OldK if v == "old" else DefaultK  # the registry entry the next call builds
                if v != "base":
                    gen.memory.replies = mem.setdefault((v, r), ReplyMemory(DEFAULT_DEPTH, DEFAULT_MEMORY_TOKENS))
                cfg = GenerationConfig(max_new_tokens=64, chat=chat, reuse_prefix=False, speculation=(v != "base"))
                res[v] = gen.generate(input_ids=ids, config=cfg)
                if v != "base":
                    for s_ in ("lookup", "model", "plain"):
                        src[cat][v][s_] += res[v].stats.source_tokens.get(s_, 0)
            for v in ("old", "new"):
                assert res[v].token_ids == res["base"].token_ids, (w.id, v)
                out[cat][v].append(res[v].stats.tokens_per_s / res["base"].stats.tokens_per_s)
            print(w.id, r, {v: round(res[v].stats.tokens_per_s, 2) for v in res},
                  {v: dict(res[v].stats.source_tokens) for v in ("old", "new")}, flush=True)
    print("##", cat, {v: round(st.median(x), 3) for v, x in out[cat].items()},
          "paired new/old", round(st.median([n / o for n, o in zip(out[cat]["new"], out[cat]["old"])]), 3),
          {v: dict(c) for v, c in src[cat].items()}, flush=True)
print(json.dumps({c: {v: x for v, x in d.items()} for c, d in out.items()}))
