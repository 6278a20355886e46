"""Where a preemptive reply of `bench conversation --preemptive` differs from the cold one: the target's
top-2 logit gap at the first differing reply token (2026-12-07, #40).

    specedge bench conversation /work/bundles/qwen-gptq --preemptive --turns 5 --threads 2 --json > pre-q.json
    python docs/results/2026-12-07-preemptive-near-tie.py pre-q.json /work/bundles/qwen-gptq 1

Rebuilds turn N's prompt from the shipped conversation and turn N-1's cold reply, regenerates the cold
reply (checked equal to the bench's), and prints the logits at the first token where the preemptive reply
differs (a reply that ended early differs by an EOS).
"""
import json
import sys

import numpy as np

from specedge.bench.conversation import load_conversation
from specedge.runtime.generator import Generator

report, bundle, turn = sys.argv[1], sys.argv[2], int(sys.argv[3])
rows = {}
for t in json.load(open(report))["turns"]:
    rows.setdefault(t["turn"], {})[t["config"]] = t
talk = load_conversation()
g = Generator.from_bundle(bundle, threads=2)
msgs = [{"role": "system", "content": talk.system}]
for earlier in range(turn):
    msgs += [{"role": "user", "content": talk.turns[earlier]},
             {"role": "assistant", "content": rows[earlier]["cold"]["reply"]}]
msgs.append({"role": "user", "content": talk.turns[turn]})
out = g.generate(messages=msgs, max_new_tokens=48, temperature=0.0, reuse_prefix=False)
print("the cold reply regenerated equals the bench's:", out.text == rows[turn]["cold"]["reply"])
prompt, cold = g.encode_prompt(messages=msgs), out.token_ids
pre = list(g.codec.encode(rows[turn]["preemptive"]["reply"]))
i = next((j for j in range(min(len(cold), len(pre))) if cold[j] != pre[j]), min(len(cold), len(pre)))
kv = g.target.inner.new_cache()
logits = np.asarray(g.target.inner.forward(np.asarray(prompt + cold[:i], np.int64), kv, 1)[-1], np.float64)
order = np.argsort(-logits)[:3]
print("first difference at reply token", i, "cold token", cold[i], "preemptive",
      pre[i] if i < len(pre) else "end of reply (EOS)", "eos ids", g.eos_token_ids)
print("top-3", [(int(t), round(float(logits[t]), 3)) for t in order],
      "top-2 gap", round(float(logits[order[0]] - logits[order[1]]), 4), "near-tie bound", g.near_tie_gap)
