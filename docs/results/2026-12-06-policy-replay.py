"""Replay the default policy (DefaultK) deterministically over recorded greedy replies, with recorded step costs.

The bench's order: per workload a fresh policy memory, 2 prompts x 2 rounds, a reply memory per round. At each
position the real SuffixDrafter offers its lookup and the real DefaultK chooses; a lookup's or the draft model's
proposal is accepted up to its first token that differs from the recorded 1-row greedy reply; the draft model's
proposals are its recorded greedy 8 tokens at that position (read through its 64-token window, caught up one
position at a time: a bridge placed later in a real run can change them a little). Costs come from a bench's
results JSON (its step_costs: 1-row and k+1-row target steps, the draft token) and a catch-up share (a catch-up
token over a draft step; `specedge tune` measures 0.27-0.35 on these drafts). No timing: the same inputs give the
same numbers on any box. Left out: TTFT, per-step bookkeeping, pipelining. Not a test.

  python docs/results/2026-12-06-policy-replay.py record BUNDLE OUT.json [DRAFT_WORKLOADS=all, comma list]
  python docs/results/2026-12-06-policy-replay.py replay REPLIES.json BENCH.json [CATCHUP_SHARE=0.3] [-v]

replay prints, per workload, the median and worst reply speedup (plain decode time / replayed decode time) for
the policy with and without DefaultK.LEND_FIRST_STEP (set any other class constant before simulate() to try it)."""
import json, sys
import numpy as np

def record(bundle, out, draft_categories=("code", "chat", "grounded", "voice", "hostile", "agent", "repeat")):
    """Greedy 1-row replies of the bench prompts (2 per workload) and, for ``draft_categories``, the draft
    model's proposals at every position (the replay runs no draft model on the other workloads)."""
    from pathlib import Path
    from specedge.runtime.generator import Generator
    from specedge.runtime.options import GenerationConfig
    from specedge.bench.suite import load_suite
    gen = Generator.from_bundle(bundle, threads=2, verify_checksums=False)
    suite = load_suite()
    data = []
    for cat in ("code", "chat", "grounded", "voice", "hostile", "agent", "repeat"):
        for w in suite.select([cat], 2):
            ids, chat = w.encode(gen)
            r = gen.generate(input_ids=ids, config=GenerationConfig(max_new_tokens=64, speculation=False, chat=chat,
                                                                   reuse_prefix=False))
            reply = list(map(int, r.token_ids))
            drafts = []
            if gen.draft is not None and cat in draft_categories:
                # The draft model's greedy 8 tokens at every reply position, read as the real drafter reads
                # (its window bridges the prompt at the first propose; later positions are caught up one by one).
                from specedge.runtime.model_drafter import build
                from specedge.runtime.slots import DraftPrefix
                from specedge.runtime.model_drafter import ModelDrafter
                md = ModelDrafter(gen.draft, GenerationConfig(max_new_tokens=64).sampling, window=64)
                md.begin(np.asarray(ids, np.int64))
                for p in range(len(reply)):
                    hist = np.asarray(ids + reply[:p], np.int64)
                    drafts.append([int(t) for t in md.propose(hist, 8).tokens])
                    md.accept(hist, 0)
            data.append(dict(category=cat, id=w.id, prompt=list(map(int, ids)), reply=reply, drafts=drafts,
                             finish=r.finish_reason))
            print(cat, w.id, len(ids), len(r.token_ids), r.finish_reason, flush=True)
    json.dump(data, open(out, "w"))

def simulate(replies, target_s, rounds=2, policy_cls=None, max_k=8, verbose=False, draft=None, window=64):
    """draft: (draft_token_s, catchup_token_s) to run the draft model from the recorded drafts (None: lookups only)."""
    from specedge.runtime.costs import CostModel, StepOutcome
    from specedge.runtime.horizon import ReplyLengths
    from specedge.runtime.policies import POLICIES, PolicySetup
    from specedge.runtime.suffix import ReplyMemory
    from specedge.runtime.suffix_drafter import SuffixDrafter, DEFAULT_DEPTH, DEFAULT_MEMORY_TOKENS, REPLY_CUE_TOKENS
    cls = policy_cls or POLICIES["default"]
    out = {}
    cats = []
    for r in replies:
        if r["category"] not in cats: cats.append(r["category"])
    for cat in cats:
        learned = None; lengths = ReplyLengths(); ratios = []; counters = []
        for rnd in range(rounds):
            mem = ReplyMemory(DEFAULT_DEPTH, DEFAULT_MEMORY_TOKENS)
            for rep in [x for x in replies if x["category"] == cat]:
                prompt, reply = rep["prompt"], rep["reply"]
                costs = CostModel(dict(target_s), *(draft or (None, None)))  # fixed: never observed (the recorded costs)
                has_model = draft is not None and bool(rep.get('drafts'))
                seen = 0
                ctrl = cls.from_snapshot(PolicySetup(max_k, max_k, max_k, costs, has_model), learned)
                drafter = SuffixDrafter(mem, min_match=1)
                drafter.begin(np.asarray(prompt, np.int64))
                p, spent, steps = 0, 0.0, []
                n = len(reply)
                while p < n:
                    hist = np.asarray(prompt + reply[:p], np.int64)
                    limit = min(64 - p - 1, max_k)
                    offer = drafter.lookup_offer(hist, limit) if limit > 0 else None
                    rem = lengths.expected_remaining(p, 64 - p)
                    pending = min(max(len(hist) - seen, 1), window) if has_model else 0
                    plan = ctrl.choose(limit, catchup_tokens=pending, expected_remaining=rem,
                                       lookup_tokens=offer.tokens if offer else 0, lookup_match=offer.match if offer else 0) \
                        if limit > 0 else None
                    k = plan.k if plan else 0
                    drafted = acc = 0
                    model = k > 0 and plan.source == "model"
                    if model:
                        prop = rep["drafts"][p][:k]
                        drafted = len(prop)
                        while acc < drafted and p + acc < n and prop[acc] == reply[p + acc]: acc += 1
                    elif k > 0:
                        prop = [int(t) for t in drafter.propose(hist, k).tokens]
                        drafted = len(prop)
                        while acc < drafted and p + acc < n and prop[acc] == reply[p + acc]: acc += 1
                    cost = costs.target_cost(drafted + 1)
                    catch_s = costs.catchup_cost(pending) if model else 0.0
                    draft_s = costs.draft_cost(drafted) if model else 0.0
                    commit = min(acc + 1, n - p)
                    if model: seen = len(hist) + acc
                    p += commit; spent += cost + catch_s + draft_s
                    if k > 0:
                        drafter.accept(np.asarray(prompt + reply[:p], np.int64), acc)
                    lk = drafted > 0 and not model
                    ctrl.observe(StepOutcome(k, drafted, acc, draft_s, cost, catch_s, pending if model and pending > 2 else 0,
                                             lookup=lk, offered=offer.tokens if (offer and lk) else 0,
                                             match=offer.match if (offer and lk) else 0))
                    steps.append(("M" if model else "L", k, drafted, acc, pending if model else (offer.match if offer else 0)))
                learned = ctrl.snapshot()
                lengths.record(n, finished=rep["finish"] == "stop")
                mem.add(reply, cue=prompt[-REPLY_CUE_TOKENS:])
                plain = n * costs.target_cost(1)
                ratios.append(plain / spent)
                counters.append(learned.counters())
                if verbose:
                    print(cat, rnd, rep["id"], round(plain / spent, 3), [s for s in steps if s[2]])
        out[cat] = (float(np.median(ratios)), min(ratios), ratios)
    return out

def compare(replies, bench, share, verbose=False):
    """Per workload, the median/worst reply speedup with LEND_FIRST_STEP off and on."""
    import math
    from specedge.runtime.policies import DefaultK
    target_s = {int(k): v for k, v in bench["target_s"].items()}
    draft = (bench["draft_token_s"], bench["draft_token_s"] * share)
    cats = None
    saved = DefaultK.LEND_FIRST_STEP
    for lend in (False, True):
        DefaultK.LEND_FIRST_STEP = lend
        res = simulate(replies, target_s, 2, draft=draft, verbose=verbose)
        if cats is None:
            cats = list(res)
            print(f"{'lend first step':<16}" + "".join(f"{c:>15}" for c in cats) + "  geomean")
        gm = math.exp(sum(math.log(res[c][0]) for c in cats) / len(cats))
        print(f"{str(lend):<16}" + "".join(f"{res[c][0]:>8.3f}/{res[c][1]:.3f}"[-15:].rjust(15) for c in cats)
              + f"  {gm:.3f}")
    DefaultK.LEND_FIRST_STEP = saved


if __name__ == "__main__":
    if sys.argv[1] == "record":
        record(sys.argv[2], sys.argv[3], *([sys.argv[4].split(",")] if len(sys.argv) > 4 else []))
    else:
        args = [a for a in sys.argv[2:] if a != "-v"]
        compare(json.load(open(args[0])), json.load(open(args[1]))["step_costs"],
                float(args[2]) if len(args) > 2 else 0.3, verbose="-v" in sys.argv)
