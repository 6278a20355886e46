"""Which thread split wins for verify-while-draft on this machine?

    specedge bench threads BUNDLE [--prompts 3] [--max-new-tokens 64] [--repeats 3]

Runs the same greedy prompts, interleaved, through: the baseline; sequential
speculation with both sessions on all cores; pipelined speculation with the cores
split between draft and target (1 + 1 on two cores); and pipelined with both
sessions on all cores and intra-op spinning off (so an idle session does not burn
the other's core). Prints tok/s medians and the median pairwise ratio to the
baseline, and checks every output against the baseline's.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np


def run(bundle: Path, *, prompts: int, max_new_tokens: int, repeats: int, draft_tokens: int) -> int:
    """Run the comparison (defaults live in ``specedge bench threads``); print the table and a JSON
    line; return 1 when a speculative output differs from the baseline's, else 0."""
    from ..engines.base import EngineOptions
    from ..runtime.generator import GenerationConfig, Generator
    from .suite import load_suite

    cores = os.cpu_count() or 2
    half = max(1, cores // 2)
    setups = {
        # name: (target threads, draft threads, spinning, mode, speculation)
        "baseline": (cores, cores, True, "sequential", False),
        f"sequential {cores}+{cores}": (cores, cores, True, "sequential", True),
        f"pipelined {half}+{cores - half}": (half, cores - half, True, "pipelined", True),
        f"pipelined {cores}+{cores} no-spin": (cores, cores, False, "pipelined", True),
    }
    generators = {}
    for name, (t_threads, d_threads, spin, _, _) in setups.items():
        key = (t_threads, d_threads, spin)
        if key not in generators:
            options = EngineOptions(intra_op_threads=t_threads, allow_spinning=spin)
            generators[key] = Generator.from_bundle(bundle, engine_options=options, draft_threads=d_threads,
                                                    verify_checksums=False)
            generators[key].warmup(tune=False)
    texts = [w.prompt for w in load_suite().select(["code", "chat", "grounded"], per_category=1)
             if isinstance(w.prompt, str)][:prompts]
    rates: dict[str, list[float]] = {name: [] for name in setups}
    ratios: dict[str, list[float]] = {name: [] for name in setups}
    failures = []
    for _ in range(repeats):
        for prompt in texts:
            base_tokens, base_rate = None, None
            for name, (t_threads, d_threads, spin, mode, speculation) in setups.items():
                gen = generators[(t_threads, d_threads, spin)]
                config = GenerationConfig(max_new_tokens=max_new_tokens, speculation=speculation,
                                          drafter="model", draft_tokens=draft_tokens, mode=mode)
                result = gen.generate(prompt, config=config)
                rate = result.stats.tokens_per_s
                if not speculation:
                    base_tokens, base_rate = result.token_ids, rate
                elif result.token_ids != base_tokens:
                    failures.append(name)
                rates[name].append(rate)
                ratios[name].append(rate / base_rate if base_rate else 0.0)
    out = {name: {"tok_s_median": float(np.median(rates[name])), "speedup_median": float(np.median(ratios[name]))}
           for name in setups}
    for name, row in out.items():
        print(f"{name:28s} {row['tok_s_median']:7.2f} tok/s   {row['speedup_median']:.2f}x")
    print(json.dumps({"results": out, "output_mismatches": failures}))
    return 1 if failures else 0
