"""Prefill speed side by side: prompt tokens per second at several prompt lengths, ours vs peers.

    specedge bench prefill BUNDLE --lengths 128,512,2048 --threads 2 --peers genai,llamacpp

For voice agents TTFT is prefill. Each runtime reads the same random prompt (token ids
seeded, identical across runtimes) into an empty cache and computes the logits of its last
position, as a first token needs:

* ``specedge``: the bundle's target engine wrapped as the runtime wraps it
  (engines/invariant.py), one forward of the whole prompt (the runtime prefills in one shot);
* ``genai``: onnxruntime-genai's builder output (built once and cached, as `specedge bench`
  builds it), ``Generator.append_tokens`` on a fresh generator;
* ``llamacpp``: llama-cpp-python on the GGUF the target came from, ``Llama.eval`` after a
  reset, batch 2048 / micro-batch 512 (``llama-bench -p``'s defaults).

Rounds interleave the runtimes and lengths; each cell is the median of ``repeats`` rounds
after one warm-up per (runtime, length). A peer that is not installed is skipped with a note.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from ..errors import InvalidParameterError

PREFILL_PEERS = ("genai", "llamacpp")


@dataclass(frozen=True)
class PrefillRunner:
    """One runtime: ``run(ids)`` prefills int64 ids [n] from an empty cache and returns the seconds it took."""

    name: str
    run: Callable[[np.ndarray], float]
    info: dict


def ours(bundle: Path, threads: int, max_len: int) -> PrefillRunner:
    from ..engines.invariant import BatchInvariantEngine
    from ..runtime.loading import load_bundle

    loaded = load_bundle(bundle, threads=threads, load_draft=False)
    if loaded.target.max_context < max_len:
        raise InvalidParameterError(f"the bundle's max_context {loaded.target.max_context} is below the longest "
                                    f"prompt {max_len}; export with --max-context {max_len} or more")
    engine = BatchInvariantEngine(loaded.target)
    kv = engine.new_cache()

    def run(ids: np.ndarray) -> float:
        kv.reset()
        t0 = time.perf_counter()
        engine.forward(ids, kv, 1)
        return time.perf_counter() - t0

    return PrefillRunner("specedge", run, {"bundle": str(bundle), "precision": loaded.manifest.target.precision})


def genai(bundle: Path, threads: int, max_len: int, log) -> PrefillRunner:
    import onnxruntime_genai as og

    from ..bundle.manifest import load_manifest
    from .peers import build_genai_model, genai_source, set_genai_threads

    manifest = load_manifest(bundle, verify_checksums=False)
    precision = "int4" if manifest.target.precision == "int4" else "fp32"
    hf_dir = genai_source(None, manifest.target.source, (precision,), log)
    folder = build_genai_model(hf_dir, precision, log)
    set_genai_threads(folder, threads)
    model = og.Model(str(folder))

    def run(ids: np.ndarray) -> float:
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=len(ids) + 1, do_sample=False)
        generator = og.Generator(model, params)
        t0 = time.perf_counter()
        generator.append_tokens(np.asarray(ids, np.int32))  # runs the prompt: the logits of its last token
        return time.perf_counter() - t0

    return PrefillRunner("genai", run, {"folder": str(folder), "precision": precision,
                                        "onnxruntime_genai": og.__version__})


def llamacpp(bundle: Path, threads: int, max_len: int) -> PrefillRunner:
    import llama_cpp

    from ..bundle.manifest import load_manifest
    from .peers import PeerSkipped, gguf_file

    manifest = load_manifest(bundle, verify_checksums=False)
    path = gguf_file(None, manifest.target.source)
    if path is None:
        raise PeerSkipped(f"no GGUF file for {manifest.target.source}")
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=max_len + 16, n_threads=threads, n_threads_batch=threads,
                          n_batch=2048, n_ubatch=512, verbose=False)

    def run(ids: np.ndarray) -> float:
        llm.reset()
        t0 = time.perf_counter()
        llm.eval([int(t) for t in ids])
        return time.perf_counter() - t0

    return PrefillRunner("llamacpp", run, {"gguf": str(path), "llama_cpp_python": llama_cpp.__version__})


def run_prefill(bundle: Path, lengths: tuple[int, ...], threads: int, repeats: int, peers: tuple[str, ...],
                log) -> dict:
    """Measure every runtime at every length; return {"lengths", "runtimes", "cells", "notes"}.

    ``cells[runtime][str(n)]`` = {"median_s", "tokens_per_s", "runs_s"}; ``log.note(msg)`` reports progress.
    """
    from .peers import PeerSkipped

    unknown = [p for p in peers if p not in PREFILL_PEERS]
    if unknown:
        raise InvalidParameterError(f"unknown prefill peer(s) {unknown}; known: {', '.join(PREFILL_PEERS)}")
    if not lengths or min(lengths) < 2 or repeats < 1:
        raise InvalidParameterError("prefill lengths must be >= 2 and repeats >= 1")
    max_len = max(lengths)
    runners = [ours(bundle, threads, max_len)]
    notes: list[str] = []
    for peer in peers:
        try:
            runners.append(genai(bundle, threads, max_len, log) if peer == "genai" else
                           llamacpp(bundle, threads, max_len))
        except (ImportError, PeerSkipped) as exc:
            notes.append(f"{peer} skipped: {exc}")
    rng = np.random.default_rng(0)
    prompts = {n: rng.integers(10, 1000, size=n, dtype=np.int64) for n in lengths}  # ids valid in every vocab
    for r in runners:  # warm-up: first runs pay allocation and page faults
        for n in lengths:
            r.run(prompts[n])
    times: dict[str, dict[int, list[float]]] = {r.name: {n: [] for n in lengths} for r in runners}
    for round_ in range(repeats):
        order = runners if round_ % 2 == 0 else runners[::-1]
        for n in lengths:
            for r in order:
                times[r.name][n].append(r.run(prompts[n]))
        log.note(f"prefill round {round_ + 1}/{repeats} done")
    cells = {name: {str(n): {"median_s": statistics.median(ts), "tokens_per_s": n / statistics.median(ts),
                             "runs_s": [round(t, 4) for t in ts]} for n, ts in by_len.items()}
             for name, by_len in times.items()}
    return {"lengths": list(lengths), "threads": threads, "repeats": repeats,
            "runtimes": {r.name: r.info for r in runners}, "cells": cells, "notes": notes}


def render(doc: dict) -> str:
    """Markdown table: tokens/s per runtime and length, and ours over each peer."""
    names = list(doc["runtimes"])
    head = "| prompt tokens | " + " | ".join(f"{n} tok/s" for n in names)
    head += "".join(f" | specedge / {n}" for n in names[1:]) + " |"
    lines = [head, "|---|" + "---|" * (2 * len(names) - 1)]
    for n in doc["lengths"]:
        tps = [doc["cells"][name][str(n)]["tokens_per_s"] for name in names]
        row = f"| {n} | " + " | ".join(f"{t:.0f}" for t in tps)
        row += "".join(f" | {tps[0] / t:.2f}x" for t in tps[1:]) + " |"
        lines.append(row)
    return "\n".join(lines + [f"note: {note}" for note in doc["notes"]])
