"""The runtimes a user would pick instead, on the same prompts, token ids and lengths.

- ``hf``: transformers on torch CPU, ``generate`` greedy: plain, ``prompt_lookup_num_tokens``
  (its n-gram speculation) and ``assistant_model`` (assisted generation) when the draft
  has an HF checkpoint. Same weights as the bundle when the bundle came from them.
- ``genai``: onnxruntime-genai on its own model-builder output (cached), plain greedy and
  its n-gram speculative mode where the installed API has one.
- ``llamacpp``: llama-cpp-python on the catalog's GGUF file, plain greedy and
  ``LlamaPromptLookupDecoding``.

Every peer runs in its own worker process (bench/peer_worker.py), in its default
configuration: the bench sets no environment variable for it (an earlier version forced
``OMP_WAIT_POLICY=PASSIVE``, which cost llama.cpp 20-29% on a 2-core Sapphire Rapids VM);
only the thread count is the bench's, passed as the peer's own option. A peer that
crashes (llama.cpp's AMX segfault, see ``LLAMACPP_AMX_NOTE``) is reported with its signal
and last stderr lines, and the bench's own results are still written.

Every peer gets our prompt token ids (so tokenization cannot differ), is asked for as
many tokens as our baseline produced for that prompt, and is timed with the same
definition of tok/s (tokens after the first over the time after the first). A peer
that is not installed, or whose model files cannot be found, is skipped with the
reason; it never fails the bench. A peer's text differing from ours is reported, not
failed: different kernels (and, for GGUF and int4 builds, different weights) may
legitimately pick another token at a near-tie.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from ..runtime.divergence import first_divergence

if TYPE_CHECKING:
    from .runner import BenchSettings
from . import metrics
from .configs import BASELINE

PEERS = ("hf", "genai", "llamacpp")


class PeerSkipped(Exception):
    """The peer cannot run here; the message says why and how to enable it."""


@dataclass
class PeerRun:
    workload: str
    category: str
    config: str
    round: int
    tokens: list[int]
    token_times_s: list[float]  # arrival time of each token from the start of the call

    @property
    def ttft_s(self) -> float:
        return self.token_times_s[0] if self.token_times_s else 0.0

    @property
    def tokens_per_s(self) -> float:
        """Same definition as GenerationStats.tokens_per_s: tokens after the first over the time after it."""
        if len(self.tokens) < 2:
            return 0.0
        decode_s = self.token_times_s[-1] - self.token_times_s[0]
        return (len(self.tokens) - 1) / decode_s if decode_s > 0 else 0.0


@dataclass(frozen=True)
class Job:
    workload: str
    category: str
    prompt_ids: list[int]
    max_new_tokens: int  # = our baseline's output length for this prompt
    reference: list[int]  # our baseline's tokens


@dataclass
class PeerSession:
    """A peer loaded in its worker process: its configuration names and how to run one."""

    configs: list[str]
    generate: Callable[[Job, str, int], PeerRun]  # (job, config, max new tokens) -> the run
    info: dict  # versions, build flags, files, threads: what a reader needs to judge the numbers
    notes: list[str]


@dataclass(frozen=True)
class PeerContext:
    """What a peer's setup reads: the bench's thread count, the peer options, our bundle's manifest."""

    threads: int
    peer_options: dict
    manifest: object  # specedge.bundle.manifest.Manifest


class PeerCrashed(Exception):
    """The peer's worker process died (a signal or an exit) while loading or generating."""

    def __init__(self, message: str, signal_name: str | None, returncode: int | None, stderr_tail: list[str]):
        super().__init__(message)
        self.signal_name = signal_name
        self.returncode = returncode
        self.stderr_tail = stderr_tail


# llama-cpp-python 0.3.x built with GGML_NATIVE=ON segfaults in ggml_backend_amx_mul_mat on
# Sapphire Rapids (a known upstream bug); a build with the ISA flags spelled out and AMX off runs.
LLAMACPP_AMX_NOTE = (
    "if llama.cpp crashes in its AMX matmul (ggml_backend_amx_mul_mat, Sapphire Rapids and later), rebuild it "
    "without AMX: CMAKE_ARGS=\"-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON "
    "-DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AMX_TILE=OFF "
    "-DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF\" pip install --force-reinstall --no-cache-dir llama-cpp-python")


# ----------------------------------------------------------------------------- locating model files
def _cache() -> Path:
    from ..export.fetch import cache_dir

    return cache_dir()


def hf_folder(explicit: str | None, source: str) -> Path | None:
    """The HF checkpoint folder a bundle model came from, or None (a self-draft has none).

    ``gguf:NAME.gguf`` sources map to the exporter's converted folder
    ``<cache>/converted/<stem>-<key>``; a source that is itself a folder is used as is.
    """
    if explicit:
        path = Path(explicit).expanduser()
        if not (path / "config.json").is_file():
            raise PeerSkipped(f"{path} is not an HF model folder (no config.json)")
        return path
    if not source or source.startswith("self-"):
        return None
    if source.startswith("gguf:"):
        stem = Path(source[len("gguf:"):]).stem
        found = [p for p in (_cache() / "converted").glob(f"{stem}-*") if (p / "config.json").is_file()
                 and ".tmp-" not in p.name]
        return max(found, key=lambda p: p.stat().st_mtime) if found else None
    path = Path(source).expanduser()
    if (path / "config.json").is_file():
        return path
    from ..export.catalog import CATALOG

    if source in CATALOG:
        return hf_folder(None, f"gguf:{CATALOG[source].filename}")
    return None


def converted_folder(source: str, log, *, convert: bool = True) -> Path | None:
    """The exporter's converted HF folder for a GGUF ``source`` whose file is at hand, or None.

    ``convert``: a folder not yet in the cache is made now (export/loader.py ``load_gguf``: the file
    dequantized to fp32, about 4 bytes a parameter, kept in the cache like ``export --keep-converted``'s),
    when the export extra is installed; without it, or with ``convert`` False, the path is returned as is
    (it may not exist: a peer built from it earlier is found in the cache by its name)."""
    gguf = gguf_file(None, source)
    if gguf is None:
        return None
    from ..export.loader import converted_cache_dir, load_gguf

    out = converted_cache_dir(gguf)
    if (out / "config.json").is_file() or not convert:
        return out
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        return None
    log.note(f"peers: converting {gguf.name} to an HF folder (fp32, about 4 bytes a parameter; once, kept in "
             f"{out.parent}; `specedge fetch --clean converted` removes it)")
    t0 = time.perf_counter()
    folder, _ = load_gguf(gguf, quiet=True)
    log.note(f"peers: converted in {time.perf_counter() - t0:.0f} s")
    return folder


def gguf_file(explicit: str | None, source: str) -> Path | None:
    """The GGUF file a bundle model came from: ``<cache>/models/*/NAME.gguf``."""
    if explicit:
        path = Path(explicit).expanduser()
        if not path.is_file():
            raise PeerSkipped(f"GGUF file {path} does not exist")
        return path
    if source.startswith("gguf:"):
        name = source[len("gguf:"):]
        found = sorted((_cache() / "models").glob(f"*/{name}"))
        return found[0] if found else None
    if source.endswith(".gguf") and Path(source).is_file():
        return Path(source)
    from ..export.catalog import CATALOG

    if source in CATALOG:
        from ..export.fetch import model_path

        path = model_path(CATALOG[source])
        return path if path.is_file() else None
    return None


def _threads(ctx) -> int:
    return ctx.threads or os.cpu_count() or 1


# The thread count is the one setting the bench shares with its peers. Where the peer's own
# default differs from it, its plain configuration also runs at that default, under this suffix,
# so the report gives our ratio both ways: at the shared setting, and against the peer as its
# users would run it out of the box.
OWN_THREADS = "@own-threads"


def own_threads_config(config: str, default_threads: int | str) -> str:
    """``llamacpp-plain`` -> ``llamacpp-plain@own-threads(1)``: the name says what the default was."""
    return f"{config}{OWN_THREADS}({default_threads})"


def _interleaved(jobs: list[Job], configs: list[str], repeats: int):
    """(job, round, config) in the same A B C / C B A order as the specedge runs."""
    for job in jobs:
        for r in range(repeats):
            for config in (configs if r % 2 == 0 else list(reversed(configs))):
                yield job, r, config


# ----------------------------------------------------------------------------- hf
def setup_hf(ctx: "PeerContext", log) -> PeerSession:
    try:
        import torch
        from transformers import AutoModelForCausalLM
        from transformers import GenerationConfig as HFGenerationConfig
        from transformers.generation.streamers import BaseStreamer
    except ImportError:
        raise PeerSkipped("transformers/torch are not installed (pip install 'specedge[export]')") from None
    opts = ctx.peer_options
    manifest = ctx.manifest
    source = manifest.target.source
    target_dir = hf_folder(opts.get("hf_target"), source) or converted_folder(source, log)
    if target_dir is None:
        raise PeerSkipped(f"no HF checkpoint found for the target ({manifest.target.source}); pass --hf-target")
    draft_dir = None
    notes = []
    if manifest.draft is not None or opts.get("hf_draft"):
        draft_dir = hf_folder(opts.get("hf_draft"), manifest.draft.source if manifest.draft else "")
        if draft_dir is None:
            notes.append(f"assisted generation skipped: the draft ({manifest.draft.source}) has no HF checkpoint "
                         "(a quantized self-draft has none); pass --hf-draft to use one")
    threads = _threads(ctx)
    own_threads = torch.get_num_threads()  # torch's default, before the bench sets its own
    torch.set_num_threads(threads)
    log.note(f"peer hf: loading {target_dir.name}" + (f" + assistant {draft_dir.name}" if draft_dir else ""))
    model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
    assistant = (AutoModelForCausalLM.from_pretrained(str(draft_dir), dtype=torch.float32).eval()
                 if draft_dir else None)
    k = opts.get("lookup_tokens") or manifest.speculation.max_draft_tokens
    configs = {"hf-plain": {}, "hf-prompt-lookup": {"prompt_lookup_num_tokens": k}}
    if assistant is not None:
        configs["hf-assisted"] = {"assistant_model": assistant}
    thread_counts = {name: threads for name in configs}
    if own_threads != threads:
        own = own_threads_config("hf-plain", own_threads)
        configs[own], thread_counts[own] = {}, own_threads
    eos = list(manifest.target.eos_token_ids)

    class Clock(BaseStreamer):
        """Arrival time of every generated token (generate() first puts the prompt)."""

        def __init__(self) -> None:
            self.t0 = time.perf_counter()
            self.times: list[float] = []
            self.seen_prompt = False

        def put(self, value) -> None:
            if not self.seen_prompt:
                self.seen_prompt = True
                return
            now = time.perf_counter() - self.t0
            self.times.extend([now] * int(value.numel()))

        def end(self) -> None:
            pass

    def generate(job: Job, config: str, n: int) -> PeerRun:
        extra = dict(configs[config])
        assistant_model = extra.pop("assistant_model", None)
        gc = HFGenerationConfig(max_new_tokens=n, do_sample=False, eos_token_id=eos, pad_token_id=eos[0],
                                temperature=None, top_p=None, top_k=None, **extra)
        ids = torch.tensor([job.prompt_ids], dtype=torch.long)
        torch.set_num_threads(thread_counts[config])
        clock = Clock()
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=gc,
                                 streamer=clock, assistant_model=assistant_model)
        tokens = out[0, len(job.prompt_ids):].tolist()
        times = clock.times[:len(tokens)] + [clock.times[-1] if clock.times else 0.0] * (len(tokens) - len(clock.times))
        return PeerRun(job.workload, job.category, config, 0, tokens, times)

    info = {"folder": str(target_dir), "draft_folder": str(draft_dir) if draft_dir else None, "threads": threads,
            "default_threads": own_threads,
            "dtype": "float32", "prompt_lookup_num_tokens": k, "configs": list(configs),
            "transformers": __import__("transformers").__version__, "torch": torch.__version__,
            "build": torch.__config__.show().strip().splitlines()[:12]}
    return PeerSession(list(configs), generate, info, notes)


# ----------------------------------------------------------------------------- onnxruntime-genai
def genai_source(explicit: str | None, source: str, precisions, log) -> Path:
    """The HF folder genai's builder reads for the target ``source`` (``explicit``: --hf-target). For a GGUF
    source it is the exporter's converted folder, made now (:func:`converted_folder`) unless a genai model of
    every one of ``precisions`` was already built from it (then only its name is needed)."""
    hf_dir = hf_folder(explicit, source)
    if hf_dir is None:
        named = converted_folder(source, log, convert=False)
        built = named is not None and all((genai_model_dir(named, p) / "genai_config.json").is_file()
                                          for p in precisions)
        hf_dir = named if built else converted_folder(source, log)
    if hf_dir is None:
        raise PeerSkipped(f"no HF checkpoint for the target ({source}) to build a genai model from; pass "
                          "--hf-target (or install the export extra to convert the GGUF file)")
    return hf_dir


def genai_model_dir(hf_dir: Path, precision: str) -> Path:
    """Where :func:`build_genai_model` keeps the genai model of ``hf_dir`` at ``precision``."""
    return _cache() / "bench" / "genai" / f"{hf_dir.name}-{precision}"


def build_genai_model(hf_dir: Path, precision: str, log) -> Path:
    """Run onnxruntime-genai's model builder once per (checkpoint, precision); cached."""
    out = genai_model_dir(hf_dir, precision)
    if (out / "genai_config.json").is_file():
        return out
    tmp = out.with_name(out.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf_dir), "-o", str(tmp),
           "-p", precision, "-e", "cpu", "-c", str(tmp) + "-hfcache"]
    log.note(f"peer genai: building {out.name} with the genai model builder (once; cached in {out.parent})")
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    shutil.rmtree(str(tmp) + "-hfcache", ignore_errors=True)
    if proc.returncode != 0 or not (tmp / "genai_config.json").is_file():
        shutil.rmtree(tmp, ignore_errors=True)
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise PeerSkipped(f"the genai model builder failed on {hf_dir.name} ({precision}): {' | '.join(tail)}")
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    log.note(f"peer genai: built in {time.perf_counter() - t0:.0f} s")
    return out


def set_genai_threads(model_dir: Path, threads: int) -> None:
    """intra_op_num_threads in genai_config.json's decoder session_options (0 = ORT default)."""
    path = model_dir / "genai_config.json"
    cfg = json.loads(path.read_text())
    so = cfg["model"]["decoder"].setdefault("session_options", {})
    if threads:
        so["intra_op_num_threads"] = threads
    else:
        so.pop("intra_op_num_threads", None)
    path.write_text(json.dumps(cfg, indent=4))


def _genai_default_threads_copy(model_dir: Path) -> Path:
    """A sibling folder of ``model_dir`` whose genai_config.json sets no thread count (ORT's default).

    The model files are symlinked, not copied; the folder is rebuilt on every call."""
    out = model_dir.with_name(model_dir.name + "-own-threads")
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir()
    for item in model_dir.iterdir():
        if item.name != "genai_config.json":
            (out / item.name).symlink_to(item.resolve())
    shutil.copyfile(model_dir / "genai_config.json", out / "genai_config.json")
    set_genai_threads(out, 0)
    return out


def setup_genai(ctx: "PeerContext", log) -> PeerSession:
    try:
        import numpy as np
        import onnxruntime_genai as og
    except ImportError:
        raise PeerSkipped("onnxruntime-genai is not installed (pip install onnxruntime-genai)") from None
    opts = ctx.peer_options
    precisions = opts.get("genai_precision") or ("int4",)
    hf_dir = genai_source(opts.get("hf_target"), ctx.manifest.target.source, precisions, log)
    k = opts.get("lookup_tokens") or ctx.manifest.speculation.max_draft_tokens
    notes: list[str] = []
    models = {}
    configs: dict[str, tuple[str, dict | None]] = {}
    for precision in precisions:
        model_dir = build_genai_model(hf_dir, precision, log)
        set_genai_threads(model_dir, ctx.threads)
        models[precision] = og.Model(str(model_dir))
        configs[f"genai-{precision}"] = (precision, None)
        params = og.GeneratorParams(models[precision])
        if hasattr(params, "set_speculative_options"):
            try:
                params.set_speculative_options(ngram_size=3, max_draft_tokens=k)
                configs[f"genai-{precision}-ngram"] = (precision, {"ngram_size": 3, "max_draft_tokens": k})
            except Exception as exc:  # the option names are the installed version's
                notes.append(f"genai n-gram speculation unavailable: {exc}")
        elif precision == precisions[0]:
            notes.append("this onnxruntime-genai has no speculative options; only plain decoding is compared")
    notes.append("genai draft-model speculation is not compared: it needs a drafter exported by its builder's "
                 "speculative options")
    if ctx.threads:  # the bench imposed a thread count: also run plain decoding at ORT's own default
        precision = precisions[0]
        own = own_threads_config(f"genai-{precision}", "ort-default")
        models[own] = og.Model(str(_genai_default_threads_copy(build_genai_model(hf_dir, precision, log))))
        configs[own] = (own, None)

    def generate(job: Job, config: str, n: int) -> PeerRun:
        precision, spec = configs[config]
        params = og.GeneratorParams(models[precision])
        params.set_search_options(max_length=len(job.prompt_ids) + n, do_sample=False)
        if spec:
            params.set_speculative_options(**spec)
        t0 = time.perf_counter()
        g = og.Generator(models[precision], params)
        g.append_tokens(np.asarray(job.prompt_ids, np.int32))
        tokens: list[int] = []
        times: list[float] = []
        while not g.is_done() and len(tokens) < n:
            g.generate_next_token()
            new = [int(t) for t in g.get_next_tokens()]
            now = time.perf_counter() - t0
            tokens += new
            times += [now] * len(new)
        return PeerRun(job.workload, job.category, config, 0, tokens[:n], times[:n])

    info = {"hf_folder": str(hf_dir), "precisions": list(precisions), "threads": ctx.threads,
            "default_threads": "onnxruntime's default (one per physical core)",
            "ngram": {"ngram_size": 3, "max_draft_tokens": k}, "configs": list(configs),
            "onnxruntime_genai": og.__version__}
    return PeerSession(list(configs), generate, info, notes)


# ----------------------------------------------------------------------------- llama.cpp
def _llamacpp_common(ctx: "PeerContext", log):
    """(llama_cpp module, Llama class, GGUF path, Llama kwargs, threads) for the bundle's target GGUF."""
    try:
        import llama_cpp
        from llama_cpp import Llama
    except ImportError:
        raise PeerSkipped("llama-cpp-python is not installed (pip install llama-cpp-python; it compiles "
                          f"llama.cpp, minutes). {LLAMACPP_AMX_NOTE}") from None
    path = gguf_file(ctx.peer_options.get("gguf"), ctx.manifest.target.source)
    if path is None:
        raise PeerSkipped(f"no GGUF file found for the target ({ctx.manifest.target.source}); pass --gguf")
    threads = _threads(ctx)
    common = dict(model_path=str(path), n_ctx=ctx.manifest.target.max_context, n_threads=threads, n_threads_batch=threads,
                  verbose=False, seed=0)
    log.note(f"peer llamacpp: loading {path.name}")
    return llama_cpp, Llama, path, common, threads


def _llamacpp_generate(llm, job: Job, config: str, n: int, eos: set[int]) -> PeerRun:
    """Greedy tokens of ``job.prompt_ids`` with their arrival times. ``generate(reset=True)`` (its
    default) keeps the longest prefix of the tokens the context already holds and evaluates only the
    rest: a caller that wants a cold start calls ``llm.reset()`` first."""
    tokens: list[int] = []
    times: list[float] = []
    t0 = time.perf_counter()
    for token in llm.generate(job.prompt_ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0,
                              reset=True):
        times.append(time.perf_counter() - t0)
        tokens.append(int(token))
        if token in eos or token == llm.token_eos() or len(tokens) >= n:
            break
    return PeerRun(job.workload, job.category, config, 0, tokens, times)


def _llamacpp_info(llama_cpp, path: Path, threads: int, **extra) -> dict:
    system = llama_cpp.llama_print_system_info()
    system = system.decode(errors="replace") if isinstance(system, bytes) else str(system)
    return {"gguf": str(path), "threads": threads, **extra, "llama_cpp_python": llama_cpp.__version__,
            "build": system.strip()}


def setup_llamacpp(ctx: "PeerContext", log) -> PeerSession:
    llama_cpp, Llama, path, common, threads = _llamacpp_common(ctx, log)
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    k = ctx.peer_options.get("lookup_tokens") or ctx.manifest.speculation.max_draft_tokens
    engines = {"llamacpp-plain": Llama(**common),
               "llamacpp-prompt-lookup": Llama(**common, draft_model=LlamaPromptLookupDecoding(num_pred_tokens=k))}
    # llama-cpp-python's own default when n_threads is not given: half the logical CPUs.
    own_threads = max(multiprocessing.cpu_count() // 2, 1)
    if own_threads != threads:
        no_threads = {key: value for key, value in common.items() if key not in ("n_threads", "n_threads_batch")}
        engines[own_threads_config("llamacpp-plain", own_threads)] = Llama(**no_threads)
    eos = set(ctx.manifest.target.eos_token_ids)

    def generate(job: Job, config: str, n: int) -> PeerRun:
        llm = engines[config]
        llm.reset()
        return _llamacpp_generate(llm, job, config, n, eos)

    info = _llamacpp_info(llama_cpp, path, threads, default_threads=own_threads, num_pred_tokens=k,
                          configs=list(engines))
    notes = [f"llama.cpp runs the GGUF's own quantized weights ({path.name}); its text may differ from a "
             "bundle exported at another precision", LLAMACPP_AMX_NOTE]
    return PeerSession(list(engines), generate, info, notes)


LLAMACPP_CONVERSATION_CONFIGS = ("llamacpp-cold", "llamacpp-cache-prompt")


def setup_llamacpp_conversation(ctx: "PeerContext", log) -> PeerSession:
    """llama.cpp for the conversation bench (bench/conversation.py), turn by turn on one context.

    ``llamacpp-cache-prompt``: the context is kept across turns and each turn's generate() reuses the
    longest common token prefix with what it holds, evaluating only the rest: llama.cpp's server
    ``cache_prompt`` (on by default there), one slot. ``llamacpp-cold``: the context is reset
    before every turn. Plain greedy decoding in both (llama.cpp's server does not speculate by default).
    """
    llama_cpp, Llama, path, common, threads = _llamacpp_common(ctx, log)
    engines = {name: Llama(**common) for name in LLAMACPP_CONVERSATION_CONFIGS}
    eos = set(ctx.manifest.target.eos_token_ids)

    def generate(job: Job, config: str, n: int) -> PeerRun:
        llm = engines[config]
        if config == "llamacpp-cold":
            llm.reset()
        return _llamacpp_generate(llm, job, config, n, eos)

    info = _llamacpp_info(llama_cpp, path, threads, configs=list(engines))
    notes = [f"llama.cpp runs the GGUF's own quantized weights ({path.name}): its replies may differ from ours; "
             "each turn's prompt holds our reply, so where llama.cpp's reply differed it re-reads ours"]
    return PeerSession(list(engines), generate, info, notes)


# "llamacpp-conversation" is the conversation bench's peer (bench/conversation.py), not a `bench run --peers` choice.
SETUPS = {"hf": setup_hf, "genai": setup_genai, "llamacpp": setup_llamacpp,
          "llamacpp-conversation": setup_llamacpp_conversation}


# ----------------------------------------------------------------------------- worker process
def _worker_command() -> list[str]:
    """The command that runs one peer in its own process (see bench/peer_worker.py)."""
    return [sys.executable, "-m", "specedge.bench.peer_worker"]


STDERR_TAIL = 12  # lines of a crashed peer's stderr kept in the results


class PeerProcess:
    """One peer in a child process, driven one generation at a time over JSON lines.

    Why a process: a peer library that crashes (llama.cpp's AMX segfault) would otherwise take
    the bench, and every result it measured, down with it. The child loads the peer once
    (``setup``), warms it up, then answers ``generate`` requests, so the parent can still
    interleave our own runs with the peer's. stderr goes to a file: its tail explains a crash.
    """

    def __init__(self, peer: str, ctx_args: dict, warmup: Job, stderr_path: Path) -> None:
        self.peer = peer
        self.stderr_path = stderr_path
        self._stderr = open(stderr_path, "wb")
        self.proc = subprocess.Popen(_worker_command(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._stderr)
        self.ready = self._call({"peer": peer, **ctx_args, "warmup": _job_json(warmup)})

    def _call(self, message: dict) -> dict:
        try:
            self.proc.stdin.write((json.dumps(message) + "\n").encode())
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        except (BrokenPipeError, OSError):
            line = b""
        if not line:
            raise self._crashed()
        return json.loads(line)

    def _crashed(self) -> PeerCrashed:
        import signal

        code = self.proc.wait()
        self._stderr.close()
        tail = self.stderr_path.read_text(errors="replace").splitlines()[-STDERR_TAIL:]
        name = signal.Signals(-code).name if code < 0 and -code in signal.Signals._value2member_map_ else None
        how = f"killed by {name}" if name else f"exited with status {code}"
        return PeerCrashed(f"peer {self.peer} {how}", name, code, tail)

    @property
    def configs(self) -> list[str]:
        """The configurations the loaded peer offers (empty when it was skipped or failed to load)."""
        return list(self.ready.get("configs", []))

    def generate(self, job: Job, config: str, n: int) -> PeerRun:
        reply = self._call({"job": _job_json(job), "config": config, "n": n})
        if "error" in reply:
            raise RuntimeError(reply["error"])
        return PeerRun(job.workload, job.category, config, 0, reply["tokens"], reply["times"])

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait()
        if not self._stderr.closed:
            self._stderr.close()


def _job_json(job: Job) -> dict:
    return {"workload": job.workload, "category": job.category, "prompt_ids": list(job.prompt_ids),
            "max_new_tokens": job.max_new_tokens, "reference": list(job.reference)}


def _run_all(jobs: list[Job], configs: list[str], repeats: int, generate, log, title: str,
             companions: dict, on_run: Callable[[PeerRun], None] | None = None) -> list[PeerRun]:
    """The peer's configurations interleaved with our companion runs (same prompts, same lengths).

    ``on_run`` sees every run as it completes (the bench appends it to its partial results)."""
    from .progress import Progress

    order = list(configs) + list(companions)
    bar = Progress(len(jobs) * repeats * len(order), title=f"peer {title}", enabled=log.enabled)
    runs = []
    try:
        for job, r, config in _interleaved(jobs, order, repeats):
            run = companions[config](job, r) if config in companions else generate(job, config, job.max_new_tokens)
            run.round = r
            runs.append(run)
            if on_run is not None:
                on_run(run)
            bar.advance(f"{job.workload} {config}")
    finally:
        bar.close()
    return runs


# ----------------------------------------------------------------------------- summary
OURS_BASELINE = "specedge-baseline"
OURS_BEST = "specedge-best"


def _median_tps_per_prompt(runs, config: str) -> dict[str, float]:
    by: dict[str, list[float]] = {}
    for r in runs:
        if r.config == config and r.tokens_per_s > 0:
            by.setdefault(r.workload, []).append(r.tokens_per_s)
    return {w: metrics.median(v) for w, v in by.items()}


def _ratio(ours: dict[str, float], theirs: dict[str, float]) -> float | None:
    ratios = [ours[w] / theirs[w] for w in ours if theirs.get(w)]
    return metrics.median(ratios) if ratios else None


def summarise(peer_runs: list[PeerRun], jobs: list[Job], best: dict) -> dict:
    """Per peer configuration and category: tok/s, TTFT, same text as ours, and our tok/s over theirs.

    Ratios come from our companion runs interleaved with the peer's (``specedge-best``:
    the category's best speculative configuration; ``specedge-baseline``: plain
    decoding), so the machine's drift between the bench phases cancels too.
    ``ratio_best``: median over prompts of (our best's median tok/s / the peer's);
    ``ratio_baseline``: the same for our plain decoding (the engines alone).
    """
    out: dict = {}
    by_job = {j.workload: j for j in jobs}
    categories = list(dict.fromkeys(j.category for j in jobs))
    ours_best = _median_tps_per_prompt(peer_runs, OURS_BEST)
    ours_base = _median_tps_per_prompt(peer_runs, OURS_BASELINE)
    for config in dict.fromkeys(r.config for r in peer_runs):
        if config in (OURS_BEST, OURS_BASELINE):
            continue
        cells = {}
        for category in categories:
            runs = [r for r in peer_runs if r.config == config and r.category == category]
            first = {r.workload: r for r in runs if r.round == 0}
            divergence = {w: first_divergence(by_job[w].reference, r.tokens) for w, r in first.items()}
            theirs = _median_tps_per_prompt(runs, config)
            in_cat = {j.workload for j in jobs if j.category == category}
            tps = [r.tokens_per_s for r in runs if r.tokens_per_s > 0]
            cells[category] = {
                "tokens_per_s": {"median": metrics.median(tps), "iqr": metrics.iqr(tps)},
                "ttft_ms": metrics.median(r.ttft_s for r in runs) * 1e3,
                "tokens": metrics.median(len(r.tokens) for r in runs),
                "same_text": sum(1 for d in divergence.values() if d is None) / len(divergence) if divergence else None,
                "first_divergence": divergence,
                "best_config": best.get(category, {}).get("config"),
                "ours_best_tokens_per_s": metrics.median(v for w, v in ours_best.items() if w in in_cat),
                "ours_baseline_tokens_per_s": metrics.median(v for w, v in ours_base.items() if w in in_cat),
                "ratio_best": _ratio({w: v for w, v in ours_best.items() if w in in_cat}, theirs),
                "ratio_baseline": _ratio({w: v for w, v in ours_base.items() if w in in_cat}, theirs),
            }
        out[config] = cells
    return out


def _companions(gen, best: dict) -> dict:
    """Our runs to interleave with a peer's: plain decoding and the category's best configuration.

    Build them once per peer: each (label, category, round) drafts from its own cross-reply memory,
    fresh for this peer, as in the bench's own rounds. A shared memory would replay the identical
    replies the bench's runs (or the previous peer's companions) gave to the same prompts."""
    from ..runtime.suffix import ReplyMemory
    from ..runtime.suffix_drafter import DEFAULT_DEPTH, DEFAULT_MEMORY_TOKENS
    from .configs import BenchConfig, parse_config_name

    memories: dict[tuple[str, str, int], ReplyMemory] = {}

    def run(job: Job, round_: int, config: BenchConfig, label: str) -> PeerRun:
        gen.memory.replies = memories.setdefault((label, job.category, round_),
                                                 ReplyMemory(DEFAULT_DEPTH, DEFAULT_MEMORY_TOKENS))
        result = gen.generate(input_ids=job.prompt_ids, config=config.generation_config(job.max_new_tokens))
        return PeerRun(job.workload, job.category, label, 0, list(result.token_ids), list(result.stats.token_times_s))

    def best_run(job: Job, round_: int) -> PeerRun:
        name = best.get(job.category, {}).get("config")
        return run(job, round_, parse_config_name(name) if name else BenchConfig(BASELINE), OURS_BEST)

    return {OURS_BASELINE: lambda job, round_: run(job, round_, BenchConfig(BASELINE), OURS_BASELINE),
            OURS_BEST: best_run}


def _run_record(r: PeerRun) -> dict:
    return {"workload": r.workload, "config": r.config, "round": r.round, "tokens": len(r.tokens),
            "tokens_per_s": r.tokens_per_s, "ttft_s": r.ttft_s}


def run_peers(settings: "BenchSettings", gen, workloads, our_runs, best: dict, log,
              on_event: Callable[[dict], None] | None = None) -> dict:
    """Run every requested peer, each in its own process and default configuration.

    Returns {peer: {"skipped": why} | {"crashed": {...}, "runs"} | {"info", "notes", "configs", "runs"}}.
    No environment setting is changed for a peer (OpenMP wait policy included): each runs as
    its users would run it; the thread count, where the peer takes one, is the bench's.
    ``on_event`` gets every peer run and every peer outcome as it happens (partial results).
    """
    import tempfile

    emit = on_event or (lambda event: None)
    reference = {r.workload: r.tokens for r in our_runs if r.config == BASELINE and r.round == 0}
    jobs = [Job(w.id, w.category, ids, max(1, len(reference[w.id])), reference[w.id]) for w, ids, _ in workloads]
    ctx_args = {"bundle": str(settings.bundle), "threads": settings.threads, "peer_options": settings.peer_options}
    results: dict = {}
    for peer in settings.peers:
        if peer not in PEERS:
            results[peer] = {"skipped": f"unknown peer {peer!r}; known: {', '.join(PEERS)}"}
            continue
        log.note(f"peer {peer}: starting its worker process")
        companions = _companions(gen, best) if gen is not None else {}
        runs: list[PeerRun] = []
        with tempfile.TemporaryDirectory(prefix=f"specedge-peer-{peer}-") as tmp:
            worker = None
            try:
                worker = PeerProcess(peer, ctx_args, jobs[0], Path(tmp) / "stderr.txt")
                ready = worker.ready
                if "skipped" in ready:
                    raise PeerSkipped(ready["skipped"])
                if "error" in ready:
                    raise RuntimeError(ready["error"])

                def on_run(run: PeerRun) -> None:
                    runs.append(run)
                    emit({"peer": peer, "run": _run_record(run)})

                _run_all(jobs, ready["configs"], settings.peer_repeats, worker.generate, log, peer, companions,
                         on_run)
            except PeerSkipped as exc:
                log.note(f"peer {peer}: skipped: {exc}")
                results[peer] = {"skipped": str(exc)}
            except PeerCrashed as exc:
                log.note(f"peer {peer}: CRASHED ({exc}); our results are kept")
                crash = {"signal": exc.signal_name, "returncode": exc.returncode, "stderr_tail": exc.stderr_tail}
                notes = [LLAMACPP_AMX_NOTE] if peer == "llamacpp" else []
                results[peer] = {"crashed": crash, "notes": notes, "info": worker.ready.get("info", {}) if worker is not None else {},
                                 "configs": summarise(runs, jobs, best) if runs else {},
                                 "runs": [_run_record(r) for r in runs]}
            except Exception as exc:  # a peer's own failure must not lose the specedge results
                log.note(f"peer {peer}: failed: {type(exc).__name__}: {exc}")
                results[peer] = {"skipped": f"failed: {type(exc).__name__}: {str(exc)[:300]}"}
            else:
                results[peer] = {"info": ready["info"], "notes": ready["notes"],
                                 "configs": summarise(runs, jobs, best), "runs": [_run_record(r) for r in runs]}
            finally:
                if worker is not None:
                    worker.close()
        emit({"peer": peer, "outcome": {k: v for k, v in results[peer].items() if k != "runs"}})
    return results
