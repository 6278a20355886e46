"""Which thread split and spinning policy win for speculation on this machine?

    specedge bench threads BUNDLE [--prompts 3] [--max-new-tokens 64] [--repeats 3]

Runs the same greedy prompts, interleaved, through plain decoding and sequential speculation
under each intra-op spinning policy with both sessions on all cores:

- ``stop``: spinning inside a run, stopped when it returns (the default with a draft loaded);
- ``off``: no spinning (an idle session never burns the other's core, but every parallel
  section inside a run wakes sleeping threads);
- ``on`` (only when asked, ``--spinning stop,off,on``): ONNX Runtime's default, workers keep
  spinning after a run. With a draft that steals the other session's cores (sequential k=4
  speculation ran 0.74x plain decoding on the AVX-512 EPYC, 2 threads, Qwen int4 pair), and in
  this one process an ``on`` session's idle spinning also slows whichever setup runs next,
  so every figure of a run that includes ``on`` is skewed;

and pipelined speculation with the cores split between draft and target (1 + 1 on two
cores, spinning stopped after each run) or shared with spinning off. Prints tok/s medians
and the median pairwise ratio to plain decoding under the first policy, and checks every
output against it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

SPINNING = ("stop", "off", "on")  # every policy; "stop" is the loader's default with a draft
DEFAULT_SPINNING = ("stop", "off")  # compared unless asked: "on" leaves cores busy for the next setup


def _options(threads: int, spinning: str):
    from ..engines.base import EngineOptions

    return EngineOptions(intra_op_threads=threads, allow_spinning=spinning != "off",
                         stop_spinning_after_run=spinning == "stop")


def run(bundle: Path, *, prompts: int, max_new_tokens: int, repeats: int, draft_tokens: int,
        spinning: tuple[str, ...] = DEFAULT_SPINNING, pipelined: bool = True) -> int:
    """Run the comparison (defaults live in ``specedge bench threads``); print the table and a JSON
    line; return 1 when an output differs from the default plain decoding's, else 0."""
    from ..runtime.generator import GenerationConfig, Generator
    from .suite import load_suite

    cores = os.cpu_count() or 2
    half = max(1, cores // 2)
    # name: (target threads, draft threads, spinning, mode, speculation); the first is the reference
    setups = {f"plain, spin {spin}": (cores, cores, spin, "sequential", False) for spin in spinning}
    setups |= {f"sequential {cores}+{cores}, spin {spin}": (cores, cores, spin, "sequential", True)
               for spin in spinning}
    if pipelined:
        setups[f"pipelined {half}+{cores - half}, spin stop"] = (half, cores - half, "stop", "pipelined", True)
        setups[f"pipelined {cores}+{cores}, spin off"] = (cores, cores, "off", "pipelined", True)
    generators = {}
    for t_threads, d_threads, spin, _, _ in setups.values():
        key = (t_threads, d_threads, spin)
        if key not in generators:
            generators[key] = Generator.from_bundle(bundle, engine_options=_options(t_threads, spin),
                                                    draft_threads=d_threads, verify_checksums=False)
            generators[key].warmup(tune=False)
    texts = [w.prompt for w in load_suite().select(["code", "chat", "grounded"], per_category=1)
             if isinstance(w.prompt, str)][:prompts]
    rates: dict[str, list[float]] = {name: [] for name in setups}
    ratios: dict[str, list[float]] = {name: [] for name in setups}
    failures = []
    names = list(setups)
    reference = names[0]
    for round_index in range(repeats):
        for prompt_index, prompt in enumerate(texts):
            # The order rotates every run, so no setup always follows the same one (a session
            # that just ran leaves warm caches and, spinning, busy cores behind).
            shift = (round_index * len(texts) + prompt_index) % len(names)
            runs = {}
            for name in names[shift:] + names[:shift]:
                t_threads, d_threads, spin, mode, speculation = setups[name]
                config = GenerationConfig(max_new_tokens=max_new_tokens, speculation=speculation,
                                          drafter="model", draft_tokens=draft_tokens, mode=mode)
                runs[name] = generators[(t_threads, d_threads, spin)].generate(prompt, config=config)
            base = runs[reference]
            for name, result in runs.items():
                if result.token_ids != base.token_ids:
                    failures.append(name)
                rates[name].append(result.stats.tokens_per_s)
                ratios[name].append(result.stats.tokens_per_s / base.stats.tokens_per_s
                                    if base.stats.tokens_per_s else 0.0)
    out = {name: {"tok_s_median": float(np.median(rates[name])), "speedup_median": float(np.median(ratios[name]))}
           for name in setups}
    for name, row in out.items():
        print(f"{name:32s} {row['tok_s_median']:7.2f} tok/s   {row['speedup_median']:.2f}x")
    print(json.dumps({"results": out, "output_mismatches": failures}))
    return 1 if failures else 0
