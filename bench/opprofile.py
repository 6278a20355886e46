"""Per-op-type profiles of decoder graphs side by side: ours vs ONNX Runtime GenAI's builder output.

    specedge bench profile --graph ours=bundles/smollm2-int4 --graph genai=~/.cache/.../genai-int4 \\
        --threads 2,1 --context 256 --prefill 512 --out docs/results/<date>-profile

Each graph runs in one ONNX Runtime session with the node profiler on
(``SessionOptions.enable_profiling``), at the same thread count, through IO binding into
preallocated caches (as the runtime and GenAI both do). Scenarios:

* ``step1``: 1 new token on a cache of ``context`` positions (GenAI's plain decoding step);
* ``step2``: 2 new tokens, 2 logit rows (our exact plain step, engines/invariant.py);
* ``verify5``: 5 new tokens, 5 logit rows (a k = 4 speculative verify);
* ``prefill<N>``: N tokens into an empty cache, 1 logit row asked for (GenAI's graph computes
  logits for every row: that is part of what is compared).

The node events of each run are summed per op type; warm-up runs are dropped; the table gives
the median per op type over the kept runs, and the median ``model_run`` time (the session's own
wall time per run, profiler overhead included). Graphs are profiled in rounds, alternating the
order, each graph in a fresh session per round, so one session's spinning worker threads never
overlap another's runs. The memory floor is the bytes a step must read (every initializer except
gathered tables: embeddings and rotary caches) over the measured copy bandwidth (see
:func:`copy_bandwidth`).

A graph is either a specedge bundle (a folder with manifest.json: its target, or ``role``) or a
GenAI model folder (genai_config.json). Nothing here imports torch.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np

from ..errors import InvalidParameterError

WARMUP_RUNS = 3  # first runs pay allocation, page faults of mmapped weights and kernel packing
# Op types that only read the rows they gather: their table is not streamed every step.
_GATHER_OPS = ("Gather", "GatherBlockQuantized")
# GroupQueryAttention inputs 7 and 8 are the cos/sin caches: a step reads n rows of them.
_GQA_TABLE_INPUTS = (7, 8)


@dataclass(frozen=True)
class Scenario:
    """One forward shape: ``new`` tokens at positions ``past .. past+new-1``, ``logits`` rows kept."""

    name: str
    past: int
    new: int
    logits: int


def scenarios(context: int, prefill: tuple[int, ...]) -> list[Scenario]:
    """The profiled shapes (module docstring)."""
    out = [Scenario("step1", context, 1, 1), Scenario("step2", context, 2, 2), Scenario("verify5", context, 5, 5)]
    return out + [Scenario(f"prefill{n}", 0, n, 1) for n in prefill]


class ProfiledGraph(Protocol):
    """One graph in one profiling session."""

    label: str
    kind: str  # "specedge" or "genai"
    graph_path: Path

    def run(self, scenario: Scenario, ids: np.ndarray) -> None:
        """One forward of ``scenario`` with token ids ``ids`` int64 [scenario.new]."""

    def end_profiling(self) -> Path:
        """Stop the profiler; return the JSON trace it wrote."""


def graph_kind(path: Path) -> str:
    """'specedge' for a bundle folder, 'genai' for a GenAI model folder; InvalidParameterError otherwise."""
    path = Path(path)
    if (path / "manifest.json").is_file():
        return "specedge"
    if (path / "genai_config.json").is_file():
        return "genai"
    raise InvalidParameterError(f"{path} is neither a specedge bundle (manifest.json) nor a GenAI model folder "
                                "(genai_config.json)")


class _Ours:
    """A specedge bundle's model through the runtime's own engine (IO binding, head-major GQA cache)."""

    kind = "specedge"

    def __init__(self, label: str, bundle: Path, threads: int, capacity: int, prefix: str | None,
                 role: str = "target", allow_spinning: bool = True) -> None:
        from ..engines import EngineOptions, create_engine
        from ..bundle.manifest import load_manifest

        manifest = load_manifest(bundle, verify_checksums=False)
        entry = manifest.models()[role]
        if entry.max_context < capacity:
            raise InvalidParameterError(f"{label}: the bundle's max_context {entry.max_context} is below the "
                                        f"{capacity} positions the scenarios need; export with --max-context "
                                        f"{capacity} or more")
        self.label, self.graph_path = label, Path(bundle) / entry.graph
        self.engine = create_engine(entry, self.graph_path, EngineOptions(
            intra_op_threads=threads, allow_spinning=allow_spinning, profile_prefix=prefix))
        self.kv = self.engine.new_cache()

    def run(self, scenario: Scenario, ids: np.ndarray) -> None:
        self.kv.length = scenario.past  # contents do not change the cost: attention reads what length says
        self.engine.forward(ids, self.kv, scenario.logits)

    def end_profiling(self) -> Path:
        return Path(self.engine.session.end_profiling())


class _Genai:
    """A GenAI builder's graph in a plain ORT session, fed as GenAI's runtime feeds it (shared KV buffer)."""

    kind = "genai"

    def __init__(self, label: str, folder: Path, threads: int, capacity: int, prefix: str | None,
                 allow_spinning: bool = True) -> None:
        import onnxruntime as ort

        config = json.loads((Path(folder) / "genai_config.json").read_text(encoding="utf-8"))
        decoder = config["model"]["decoder"]
        self.label, self.graph_path = label, Path(folder) / decoder["filename"]
        self.share = bool(config["search"].get("past_present_share_buffer", False))
        so = ort.SessionOptions()
        so.intra_op_num_threads = threads
        so.inter_op_num_threads = 1
        so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        so.log_severity_level = 3
        if not allow_spinning:
            so.add_session_config_entry("session.intra_op.allow_spinning", "0")
        if prefix:
            so.enable_profiling = True
            so.profile_file_prefix = prefix
        self.session = ort.InferenceSession(str(self.graph_path), so, providers=["CPUExecutionProvider"])
        names = decoder["inputs"]
        outs = decoder["outputs"]
        n_layers, kvh, hd = decoder["num_hidden_layers"], decoder["num_key_value_heads"], decoder["head_size"]
        self.inputs = {i.name for i in self.session.get_inputs()}
        self.ids_name, self.mask_name = names["input_ids"], names["attention_mask"]
        self.pos_name = names.get("position_ids", "position_ids")
        self.logits_name = outs["logits"]
        kv_type = next(i.type for i in self.session.get_inputs() if i.name == names["past_key_names"] % 0)
        dtype = np.float16 if "float16" in kv_type else np.float32
        self.cache = [(names[f"past_{kind}_names"] % i, outs[f"present_{kind}_names"] % i,
                       np.zeros((1, kvh, capacity, hd), dtype))
                      for i in range(n_layers) for kind in ("key", "value")]

    def run(self, scenario: Scenario, ids: np.ndarray) -> None:
        past, n = scenario.past, scenario.new
        total = past + n
        binding = self.session.io_binding()
        binding.bind_cpu_input(self.ids_name, np.ascontiguousarray(ids, np.int64).reshape(1, n))
        binding.bind_cpu_input(self.mask_name, np.ones((1, total), np.int64))
        if self.pos_name in self.inputs:
            binding.bind_cpu_input(self.pos_name, np.arange(past, total, dtype=np.int64).reshape(1, n))
        for past_name, present_name, buf in self.cache:
            if self.share:  # GenAI's past_present_share_buffer: one max-length buffer, written in place
                shape = list(buf.shape)
                binding.bind_input(past_name, "cpu", 0, buf.dtype.type, shape, buf.ctypes.data)
                binding.bind_output(present_name, "cpu", 0, buf.dtype.type, shape, buf.ctypes.data)
            else:
                binding.bind_cpu_input(past_name, np.ascontiguousarray(buf[:, :, :past]))
                binding.bind_output(present_name, "cpu")
        binding.bind_output(self.logits_name, "cpu")
        self.session.run_with_iobinding(binding)

    def end_profiling(self) -> Path:
        return Path(self.session.end_profiling())


def open_graph(label: str, path: Path, threads: int, capacity: int, prefix: str | None,
               allow_spinning: bool = True) -> ProfiledGraph:
    """A session on the bundle or GenAI folder at ``path``, profiled into ``prefix`` (None: not profiled)."""
    if graph_kind(path) == "specedge":
        return _Ours(label, path, threads, capacity, prefix, allow_spinning=allow_spinning)
    return _Genai(label, path, threads, capacity, prefix, allow_spinning=allow_spinning)


# ----------------------------------------------------------------------------- trace parsing
def per_run_ops(trace: list[dict]) -> list[dict[str, float]]:
    """Split an ORT profiler trace into runs: one {op type: ms} per ``model_run`` event, in order.

    Node events (cat "Node", name "<node>_kernel_time", args.op_name) are assigned to the
    ``model_run`` whose [ts, ts + dur] holds them; times are in microseconds in the trace.
    """
    runs = sorted((e for e in trace if e.get("cat") == "Session" and e.get("name") == "model_run"),
                  key=lambda e: e["ts"])
    out: list[dict[str, float]] = [{"model_run": r["dur"] / 1e3} for r in runs]
    starts = [r["ts"] for r in runs]
    for e in trace:
        if e.get("cat") != "Node" or not str(e.get("name", "")).endswith("_kernel_time"):
            continue
        i = int(np.searchsorted(starts, e["ts"], side="right")) - 1
        if i < 0 or e["ts"] > runs[i]["ts"] + runs[i]["dur"]:
            continue
        op = e.get("args", {}).get("op_name", "?")
        out[i][op] = out[i].get(op, 0.0) + e["dur"] / 1e3
    return out


@dataclass
class GraphProfile:
    """Medians over the kept runs of one scenario on one graph: ms per op type and per run."""

    op_ms: dict[str, float] = field(default_factory=dict)
    model_run_ms: float = 0.0
    wall_ms: float = 0.0  # Python-side median around the call (IO binding setup included)
    runs: int = 0

    def to_json(self) -> dict:
        return {"op_ms": {k: round(v, 4) for k, v in sorted(self.op_ms.items(), key=lambda kv: -kv[1])},
                "model_run_ms": round(self.model_run_ms, 4), "wall_ms": round(self.wall_ms, 4), "runs": self.runs}


def _summarise(runs: list[dict[str, float]], walls: list[float]) -> GraphProfile:
    ops = sorted({k for r in runs for k in r} - {"model_run"})
    return GraphProfile(op_ms={op: statistics.median(r.get(op, 0.0) for r in runs) for op in ops},
                        model_run_ms=statistics.median(r["model_run"] for r in runs),
                        wall_ms=statistics.median(walls) * 1e3, runs=len(runs))


# ----------------------------------------------------------------------------- memory floor
def copy_bandwidth(nbytes: int = 256 << 20, repeats: int = 5) -> float:
    """Bytes per second a numpy copy of ``nbytes`` (far above any L3) moves, best of ``repeats``.

    Counted as the issue counts it: the array size over the copy time. A copy also writes
    every byte, so a read-only stream can go faster: the floor derived from this is a bound
    that a step can in principle beat, a little.
    """
    src = np.ones(nbytes // 8, np.float64)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best


def streamed_weight_bytes(graph_path: Path) -> int:
    """Bytes of the initializers a forward reads in full: all but gathered tables (see module docstring)."""
    import onnx

    model = onnx.load(str(graph_path), load_external_data=False)
    consumers: dict[str, list[tuple[str, int]]] = {}
    for node in model.graph.node:
        for index, name in enumerate(node.input):
            consumers.setdefault(name, []).append((node.op_type, index))
    # A Reshape of an initializer feeding a gather is still a table (GenAI reshapes its tied int4 head).
    reshaped = {node.input[0] for node in model.graph.node if node.op_type == "Reshape"
                and all(op in _GATHER_OPS for op, _ in consumers.get(node.output[0], []))}
    total = 0
    for init in model.graph.initializer:
        uses = consumers.get(init.name, [])
        gathered = all(op in _GATHER_OPS or (op == "Reshape" and init.name in reshaped) for op, _ in uses)
        table = uses and all(op == "GroupQueryAttention" and i in _GQA_TABLE_INPUTS for op, i in uses)
        if not uses or gathered or table:
            continue
        itemsize = onnx.helper.tensor_dtype_to_np_dtype(init.data_type).itemsize
        total += int(np.prod(init.dims, dtype=np.int64)) * itemsize
    return total


def machine() -> dict:
    """The CPU as the cost profile records it, the load average, and the ORT version."""
    import onnxruntime as ort

    from ..bundle.extra import MachineFingerprint

    info = MachineFingerprint.here(0).to_dict()
    flags = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        pass
    isa = [name for name in ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "amx_tile") if f" {name}" in flags]
    return {"cpu": info["cpu"], "cores": info["cores"], "isa": isa, "load_avg": list(os.getloadavg()),
            "onnxruntime": ort.__version__, "python": platform.python_version()}


# ----------------------------------------------------------------------------- the run
def profile(graphs: dict[str, Path], *, threads: tuple[int, ...] = (2, 1), context: int = 256,
            prefill: tuple[int, ...] = (512,), reps: int = 20, prefill_reps: int = 4, rounds: int = 2,
            capacity: int = 2048, allow_spinning: bool = True, progress=None) -> dict:
    """Profile every graph at every thread count; return the JSON document ``render`` prints.

    ``reps`` runs per step scenario and ``prefill_reps`` per prefill, per round, after
    WARMUP_RUNS unprofiled-in-the-result runs of each. ``graphs``: label -> bundle or GenAI folder.
    """
    if not graphs:
        raise InvalidParameterError("profile needs at least one --graph")
    if min(reps, prefill_reps, rounds) < 1:
        raise InvalidParameterError("reps, prefill_reps and rounds must be >= 1")
    shapes = scenarios(context, prefill)
    need = max(s.past + s.new for s in shapes)
    if need > capacity:
        raise InvalidParameterError(f"the scenarios need {need} positions; capacity is {capacity}")
    rng = np.random.default_rng(0)
    vocab = min(_vocab_size(path) for path in graphs.values())
    ids = {s.name: rng.integers(0, vocab, size=s.new, dtype=np.int64) for s in shapes}  # ids in every vocab
    doc = {"machine": machine(), "settings": {"threads": list(threads), "context": context, "prefill": list(prefill),
                                              "reps": reps, "prefill_reps": prefill_reps, "rounds": rounds,
                                              "allow_spinning": allow_spinning, "capacity": capacity},
           "graphs": {}, "profiles": {}}
    bandwidth = copy_bandwidth()
    doc["copy_bandwidth_gb_s"] = round(bandwidth / 1e9, 2)
    for label, path in graphs.items():
        kind = graph_kind(path)
        graph_file = _graph_file(path, kind)
        weight = streamed_weight_bytes(graph_file)
        doc["graphs"][label] = {"path": str(path), "kind": kind, "streamed_weight_mb": round(weight / 1e6, 2),
                                "floor_ms": round(weight / bandwidth * 1e3, 3)}
    raw: dict[tuple[int, str, str], tuple[list, list]] = {}
    with tempfile.TemporaryDirectory(prefix="specedge-profile-") as tmp:
        for t in threads:
            for r in range(rounds):
                order = list(graphs.items()) if r % 2 == 0 else list(graphs.items())[::-1]
                for label, path in order:
                    if progress:
                        progress(f"threads {t}, round {r + 1}/{rounds}: {label}")
                    g = open_graph(label, path, t, capacity, str(Path(tmp) / f"{label}-t{t}-r{r}"),
                                   allow_spinning=allow_spinning)
                    plan: list[tuple[str, bool]] = []
                    walls: dict[str, list[float]] = {}
                    for s in shapes:
                        n = prefill_reps if s.name.startswith("prefill") else reps
                        for i in range(WARMUP_RUNS + n):
                            t0 = time.perf_counter()
                            g.run(s, ids[s.name])
                            if i >= WARMUP_RUNS:
                                walls.setdefault(s.name, []).append(time.perf_counter() - t0)
                            plan.append((s.name, i >= WARMUP_RUNS))
                    trace = json.loads(g.end_profiling().read_text(encoding="utf-8"))
                    runs = per_run_ops(trace)
                    if len(runs) != len(plan):
                        raise RuntimeError(f"{label}: the profiler recorded {len(runs)} runs, {len(plan)} were made")
                    for (name, kept), ops in zip(plan, runs):
                        if kept:
                            raw.setdefault((t, name, label), ([], []))[0].append(ops)
                    for name, w in walls.items():
                        raw[(t, name, label)][1].extend(w)
                    del g
    for (t, name, label), (runs, walls) in raw.items():
        doc["profiles"].setdefault(str(t), {}).setdefault(name, {})[label] = _summarise(runs, walls).to_json()
    return doc


def paired(graphs: dict[str, Path], *, threads: int, context: int = 256, reps: int = 30,
           capacity: int = 2048) -> dict:
    """Step, 2-row step and verify timings with every graph's session open at once, runs alternated.

    A shared machine's load drifts over seconds; the per-op profile runs each graph in its own
    block, so its cross-graph ratios carry that drift. Here every repetition runs each scenario on
    every graph back to back (the order rotating), with intra-op spinning off so one session's
    idle workers do not steal the next one's cores, and the ratio to the last graph is taken per
    repetition: the medians of those paired ratios are what load drift leaves alone.
    Returns {scenario: {label: {"median_ms", "ratio_to_last"}}}.
    """
    shapes = scenarios(context, ())
    sessions = {label: open_graph(label, path, threads, capacity, None, allow_spinning=False)
                for label, path in graphs.items()}
    labels = list(sessions)
    rng = np.random.default_rng(0)
    vocab = min(_vocab_size(path) for path in graphs.values())
    ids = {sc.name: rng.integers(0, vocab, size=sc.new, dtype=np.int64) for sc in shapes}
    times = {(sc.name, label): [] for sc in shapes for label in labels}
    for rep in range(WARMUP_RUNS + reps):
        for sc in shapes:
            shift = rep % len(labels)
            for label in labels[shift:] + labels[:shift]:
                t0 = time.perf_counter()
                sessions[label].run(sc, ids[sc.name])
                if rep >= WARMUP_RUNS:
                    times[(sc.name, label)].append(time.perf_counter() - t0)
    out: dict = {}
    base = labels[-1]
    for sc in shapes:
        for label in labels:
            ts = times[(sc.name, label)]
            ratios = [a / b for a, b in zip(ts, times[(sc.name, base)])]
            out.setdefault(sc.name, {})[label] = {"median_ms": round(statistics.median(ts) * 1e3, 3),
                                                  "ratio_to_last": round(statistics.median(ratios), 3)}
    return out


def render_paired(result: dict, threads: int, reps: int) -> str:
    """Markdown: median ms per scenario and graph, and the median paired ratio to the last graph."""
    labels = list(next(iter(result.values())))
    lines = [f"**paired timing, {threads} thread(s), spinning off** (medians of {reps} alternated repetitions; "
             f"ratio: median of per-repetition ratios to {labels[-1]})", "",
             "| scenario | " + " | ".join(f"{lb} ms" for lb in labels) + " | "
             + " | ".join(f"{lb} / {labels[-1]}" for lb in labels[:-1]) + " |",
             "|---|" + "---|" * (2 * len(labels) - 1)]
    for name, cells in result.items():
        lines.append(f"| {name} | " + " | ".join(f"{cells[lb]['median_ms']:.2f}" for lb in labels) + " | "
                     + " | ".join(f"{cells[lb]['ratio_to_last']:.2f}x" for lb in labels[:-1]) + " |")
    return "\n".join(lines)


def _vocab_size(path: Path) -> int:
    if graph_kind(path) == "genai":
        return int(json.loads((Path(path) / "genai_config.json").read_text(encoding="utf-8"))["model"]["vocab_size"])
    from ..bundle.manifest import load_manifest

    return load_manifest(path, verify_checksums=False).target.vocab_size


def _graph_file(path: Path, kind: str) -> Path:
    if kind == "genai":
        config = json.loads((Path(path) / "genai_config.json").read_text(encoding="utf-8"))
        return Path(path) / config["model"]["decoder"]["filename"]
    from ..bundle.manifest import load_manifest

    return Path(path) / load_manifest(path, verify_checksums=False).target.graph


def render(doc: dict, top: int = 12) -> str:
    """Markdown: the machine, the floor per graph, then one table per (threads, scenario)."""
    m = doc["machine"]
    labels = list(doc["graphs"])
    lines = [f"CPU: {m['cpu']} ({m['cores']} cores, {', '.join(m['isa'])}), onnxruntime {m['onnxruntime']}, "
             f"load average {', '.join(f'{x:.2f}' for x in m['load_avg'])} at the start",
             f"copy bandwidth {doc['copy_bandwidth_gb_s']} GB/s (numpy copy of 256 MiB, best of 5)", "",
             "| graph | streamed weights MB | memory floor ms |", "|---|---|---|"]
    for label, g in doc["graphs"].items():
        lines.append(f"| {label} | {g['streamed_weight_mb']:.1f} | {g['floor_ms']:.2f} |")
    for t, by_scenario in doc["profiles"].items():
        for name, by_label in by_scenario.items():
            present = [lb for lb in labels if lb in by_label]
            lines += ["", f"**{name}, {t} thread(s)** (medians of {by_label[present[0]]['runs']} runs; ms)", ""]
            head = "| op type | " + " | ".join(f"{lb} ms | {lb} %" for lb in present) + " |"
            lines += [head, "|---|" + "---|---|" * len(present)]
            totals = {lb: sum(by_label[lb]["op_ms"].values()) for lb in present}
            ops = sorted({op for lb in present for op in by_label[lb]["op_ms"]},
                         key=lambda op: -max(by_label[lb]["op_ms"].get(op, 0.0) for lb in present))
            shown, rest = ops[:top], ops[top:]
            for op in shown:
                cells = []
                for lb in present:
                    ms = by_label[lb]["op_ms"].get(op)
                    cells.append("-" if ms is None else f"{ms:.3f}")
                    cells.append("-" if ms is None else f"{100 * ms / totals[lb]:.0f}")
                lines.append(f"| {op} | " + " | ".join(cells) + " |")
            if rest:
                cells = []
                for lb in present:
                    ms = sum(by_label[lb]["op_ms"].get(op, 0.0) for op in rest)
                    cells += [f"{ms:.3f}", f"{100 * ms / totals[lb]:.0f}"]
                lines.append(f"| {len(rest)} other op types | " + " | ".join(cells) + " |")
            lines.append("| **sum of kernels** | " + " | ".join(f"{totals[lb]:.3f} | 100" for lb in present) + " |")
            lines.append("| model_run | " + " | ".join(f"{by_label[lb]['model_run_ms']:.3f} | " for lb in present)
                         + " |")
            lines.append("| wall (Python call) | " + " | ".join(f"{by_label[lb]['wall_ms']:.3f} | "
                                                               for lb in present) + " |")
            if len(present) > 1:
                base = present[-1]
                ratios = ", ".join(f"{lb} / {base} {by_label[lb]['model_run_ms'] / by_label[base]['model_run_ms']:.2f}x"
                                   for lb in present[:-1])
                floor = ", ".join(f"{lb} {by_label[lb]['model_run_ms'] / doc['graphs'][lb]['floor_ms']:.2f}x"
                                  for lb in present)
                lines.append("")
                lines.append(f"model_run ratio: {ratios}; model_run over the memory floor: {floor}")
    return "\n".join(lines)
