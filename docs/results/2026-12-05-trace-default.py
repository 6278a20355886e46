"""Trace DefaultK's per-step choices (budget, catch-up, best model k, realized rate, plan) on one bench workload.

Usage: python docs/results/2026-12-05-trace-default.py BUNDLE [CATEGORY=chat] [ROUNDS=2] [PROMPTS=2] [summary]
(summary: one line per reply instead of every step). Not a test."""
import sys, json, collections
import numpy as np
from specedge.runtime import generator as G
from specedge.runtime.policies import DEFAULT_POLICY, POLICIES, DefaultK
from specedge.runtime.costs import StepOutcome

LOG = []

class TracedK(DefaultK):
    def choose(self, limit, *, catchup_tokens=0, expected_remaining=None, lookup_tokens=0, lookup_match=0):
        info = dict(budget=self.budget_s, catchup=catchup_tokens, lookup=lookup_tokens, match=lookup_match)
        if self.model is not None and self.costs.target_cost(1) is not None:
            bk = self.model.best_k(limit)
            info.update(best_k=bk, loss=self.costs.loss_if_rejected(max(bk, 1), catchup_tokens),
                        realized=self.realized_rate(), plain_rate=self.model.rate(0),
                        pred_rate=self.model.rate(bk) if bk else None,
                        alpha=[round(a, 2) for a in self.model.alpha[:4]])
        plan = super().choose(limit, catchup_tokens=catchup_tokens, expected_remaining=expected_remaining,
                              lookup_tokens=lookup_tokens, lookup_match=lookup_match)
        info.update(k=plan.k, source=plan.source)
        LOG.append(info)
        return plan

    def observe(self, step):
        LOG[-1]["acc"] = step.accepted
        LOG[-1]["drafted"] = step.drafted
        LOG[-1]["lk"] = step.lookup
        super().observe(step)

POLICIES[DEFAULT_POLICY] = TracedK  # the registry entry the Generator builds the default policy from

from specedge.bench.suite import load_suite  # noqa
bundle = sys.argv[1]; category = sys.argv[2] if len(sys.argv) > 2 else "chat"
rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 2
gen = G.Generator.from_bundle(bundle, threads=2)
gen.warmup()
from specedge.runtime.options import GenerationConfig
suite = load_suite()
ws = suite.select([category], int(sys.argv[4]) if len(sys.argv) > 4 else 2)
from specedge.runtime.suffix import ReplyMemory
from specedge.runtime.suffix_drafter import DEFAULT_DEPTH, DEFAULT_MEMORY_TOKENS
for r in range(rounds):
    gen.memory.replies = ReplyMemory(DEFAULT_DEPTH, DEFAULT_MEMORY_TOKENS)
    for w in ws:
        ids, used_chat = w.encode(gen)
        start = len(LOG)
        res = gen.generate(input_ids=ids, config=GenerationConfig(max_new_tokens=64, chat=used_chat, reuse_prefix=False))
        steps = LOG[start:]
        kinds = collections.Counter((s["source"], s["k"] > 0) for s in steps)
        print(f"== round {r} {w.id}: {len(res.token_ids)} tokens, {len(steps)} steps, {dict(kinds)}")
        model_steps = [i for i, s in enumerate(steps) if s["source"] == "model" and s["k"] > 0]
        print("   budget at start", round(steps[0]["budget"], 3), "first model step", model_steps[:1],
              "its catch-up", [steps[i]["catchup"] for i in model_steps[:1]], "model steps", len(model_steps),
              "budget at end", round(steps[-1]["budget"], 3))
        if len(sys.argv) > 5 and sys.argv[5] == "summary":
            continue
        for i, s in enumerate(steps):
            def f(x): return round(x, 4) if isinstance(x, float) else x
            print(i, {k: f(v) for k, v in s.items()})
