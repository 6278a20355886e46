"""``specedge export``: source checkpoints in, a validated bundle folder out.

The bundle is assembled in a temporary sibling folder and renamed into place
only after every graph has been validated, so an interrupted or failed export
never leaves a half bundle behind.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

import numpy as np

from .. import __version__
from ..bundle.extra import (ComparisonRecord, KeptTensor, ManifestExtra, QuantizedTensor, QuantMix, QuantTuning,
                            ValidationRecord)
from ..errors import ExportError, InvalidParameterError, VocabMismatchError
from ..bundle.manifest import (ATTENTIONS, MAX_CONTEXT, MAX_DRAFT_TOKENS, PRECISIONS, Manifest, ModelEntry, ModelIO,
                        SpeculationDefaults, TokenizerEntry, file_record, write_manifest)
from ..runtime.drafters import DEFAULT_DRAFTER
from ..runtime.loading import load_codec
from .leftovers import is_stale, pid_after
from .release import release_memory
from .head_screen import SCREEN_ROWS
from .mixquant import DEFAULT_MIX, MIXES
from .tokenizer_parity import added_bos, check_parity, source_tokenizer

SELF_DRAFTS = ("self-int4", "self-int8")
# The smallest max_context an export takes: validation prefills and verifies across positions
# 0..15, and the exact-steps check needs a prefix plus a 5-token verify below max_context.
MIN_CONTEXT = 16
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
VALIDATIONS = ("auto", "whole", "layers")  # ExportConfig.validation
# validation="auto" checks the whole fp32 graph up to this many bytes of fp32 weights (a 270M-parameter
# model) and the first layers above it: an ORT session of the whole fp32 graph holds 4 bytes a parameter
# on top of the export's other memory, more than the bounded-memory export allows past about this size.
WHOLE_VALIDATION_BYTES = 1 << 30
# The layer-limited check's output layer keeps this many vocabulary columns: a 128k x 3072 fp32 head is
# 1.6 GB, as much as the embedding it would sit next to; 8192 evenly spaced columns check the same
# MatMul at 1/16 of that (a draft_vocab head is checked as it is).
CHECK_HEAD_COLUMNS = 8192
QUANTIZED = ("int4", "int8")  # weight-only MatMulNBits precisions: the ones with a block size to tune


@dataclass(frozen=True)
class ExportConfig:
    target: str  # HF folder, .gguf file or catalog name
    out: Path
    draft: str | None = None  # a second source, "self-int4"/"self-int8", or None
    precision: str = "fp32"  # target precision
    draft_precision: str | None = None  # None: same as the target (a self-draft is its own precision)
    max_context: int = 2048
    max_draft_tokens: int = 8
    block_size: int = 32
    accuracy_level: int = 4
    attention: str = "gqa"  # "gqa" = ORT's fused GroupQueryAttention (Llama family); "standard" = plain ops
    draft_layers: int | None = None  # self-drafts: keep only the target's first N layers (early exit)
    draft_vocab: int | None = None  # keep the N most frequent tokens in the draft's output layer (FR-Spec)
    trust_pickle: bool = False
    overwrite: bool = False
    quiet: bool = False
    # Quantized targets and drafts: quantize at every export/tune.py CANDIDATE_BLOCKS size and keep the
    # one that steps fastest on this machine without losing greedy agreement with fp32 (nor, for a
    # target, exact steps); block_size is then unused.
    tune_block_size: bool = False
    # --exact: the target keeps the layout whose plain steps equal verify rows (what GenerationConfig(exact=True)
    # needs): its -more mix's int8 layers and its head screen's int4 copy stay at the int4 block
    # (export/mixquant.py WIDE_INT8_BLOCK), and tuning times exact 2-row steps and keeps only invariant
    # layouts; off, those weights take wider blocks and tuning times 1-row steps, as fast mode runs them.
    exact: bool = False
    tune_threads: int = 0  # intra-op threads of the tuning's timed sessions (0 = ONNX Runtime's default)
    # A GGUF source at int4 keeps the file's own quantization (export/gguf_import.py); True rounds its
    # dequantized weights again, the way an HF checkpoint's are (int4: quant_mix; int8: symmetric blocks).
    requantize: bool = False
    # int4 from a float source (or --requantize): the per-tensor mix (export/mixquant.py MIXES); the
    # default is the best quality per byte measured (docs/results/2026-12-06-float-quantization.md).
    quant_mix: str = DEFAULT_MIX
    # How int4/int8 exports check the fp32 graph they quantize: "whole" loads all of it next to the source;
    # "layers" validates an fp32 graph of the first layers (one of every kind) and compares the quantized
    # graph with the source; "auto" is "layers" above WHOLE_VALIDATION_BYTES of fp32 weights.
    validation: str = "auto"
    # A GGUF source is dequantized to a float32 HF folder (4 bytes a parameter); False deletes it after the
    # export, True keeps it in the cache for later exports (`specedge fetch --list` shows it).
    keep_converted: bool = False
    # int4 graphs whose int8 output head has >= head_screen.MIN_HEAD_ELEMENTS weights: rows each position
    # rescores in fp32 after an int4 copy of the head picks them (export/head_screen.py); 0 keeps the int8 head.
    head_screen_rows: int = SCREEN_ROWS

    def __post_init__(self) -> None:
        for name, value in (("precision", self.precision), ("draft_precision", self.draft_precision)):
            if value is not None and value not in PRECISIONS:
                raise InvalidParameterError(f"{name} must be one of {', '.join(PRECISIONS)}; got {value!r}")
        if not MIN_CONTEXT <= self.max_context <= MAX_CONTEXT:
            raise InvalidParameterError(f"max_context must be in [{MIN_CONTEXT}, {MAX_CONTEXT}]; got {self.max_context}")
        if self.draft_layers is not None and (self.draft_layers < 1 or self.draft not in SELF_DRAFTS):
            raise InvalidParameterError("draft_layers needs a self-draft (--draft self-int4/self-int8) and must be "
                                        f">= 1; got {self.draft_layers} with draft {self.draft!r}")
        if self.draft_vocab is not None and (self.draft_vocab < 16 or self.draft is None):
            raise InvalidParameterError(f"draft_vocab needs a draft and must be >= 16; got {self.draft_vocab}")
        if self.validation not in VALIDATIONS:
            raise InvalidParameterError(f"validation must be one of {', '.join(VALIDATIONS)}; "
                                        f"got {self.validation!r}")
        if self.quant_mix not in MIXES:
            raise InvalidParameterError(f"quant_mix must be one of {', '.join(MIXES)}; got {self.quant_mix!r}")
        if self.head_screen_rows < 0:
            raise InvalidParameterError(f"head_screen_rows must be >= 0 (0 = no screen); got {self.head_screen_rows}")
        if self.attention not in ATTENTIONS:
            raise InvalidParameterError(f"attention must be {' or '.join(ATTENTIONS)}; got {self.attention!r}")
        if not 1 <= self.max_draft_tokens <= MAX_DRAFT_TOKENS:
            raise InvalidParameterError(f"max_draft_tokens must be in [1, {MAX_DRAFT_TOKENS}]; got "
                                        f"{self.max_draft_tokens}")


@dataclass
class _Progress:
    quiet: bool
    total: int
    step: int = 0
    t0: float = field(default_factory=time.perf_counter)

    def __call__(self, msg: str) -> None:
        self.step += 1
        if not self.quiet:
            print(f"[{self.step}/{self.total}] {msg}  (t={time.perf_counter() - self.t0:.0f}s)", file=sys.stderr,
                  flush=True)

    def note(self, msg: str) -> None:
        """A line within the current stage (does not advance the stage count)."""
        if not self.quiet:
            print(f"      {msg}  (t={time.perf_counter() - self.t0:.0f}s)", file=sys.stderr, flush=True)


def _sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _entry(spec, *, graph: str, data_files: list[str], source: str, precision: str, max_context: int,
           eos: tuple[int, ...], kv_dtype: str, tokenizer_sha256: str, attention: str, io: ModelIO) -> ModelEntry:
    return ModelEntry(graph=graph, architecture=spec.architecture, source=source, precision=precision,
                      n_layers=spec.n_layers, n_heads=spec.n_heads, n_kv_heads=spec.n_kv_heads,
                      head_dim=spec.head_dim, hidden_size=spec.hidden_size, vocab_size=spec.vocab_size,
                      max_context=max_context, eos_token_ids=eos, kv_dtype=kv_dtype, data_files=tuple(data_files),
                      tokenizer_sha256=tokenizer_sha256, attention=attention, io=io,
                      attention_windows=(spec.layer_windows[:spec.n_layers]
                                         if any(spec.layer_windows[:spec.n_layers]) else ()))


class _ModelExporter:
    """Exports one loaded model into ``root/<role>/`` at one or more precisions."""

    def __init__(self, root: Path, loaded, config: ExportConfig, tokenizer_sha256: str,
                 progress: Callable[[str], None] = lambda _: None) -> None:
        from .features import check_context, validation_edges
        from .weights import extract

        self.root = root
        self.progress = progress  # lines within the current export stage
        self.loaded = loaded
        self.config = config
        self.tokenizer_sha256 = tokenizer_sha256
        self.spec, self.weights, self.features = extract(loaded.model)
        self.context_warning = check_context(self.features, config.max_context)
        # Validation straddles every window edge and the trained context below max_context.
        self.edges = validation_edges(self.features, config.max_context)
        # The fused GQA graph needs rotary attention: GPT-2 always gets the standard graph.
        self.attention = config.attention if self.spec.architecture != "gpt2" else "standard"
        self.io = ModelIO()  # the tensor names the graphs are built with and the manifest records
        self.reports: dict[str, ValidationRecord | ComparisonRecord] = {}  # "role:label" -> record
        self.batch_variance: dict[str, float] = {}  # role -> max |verify - step| logit difference
        self.quant_tuning: dict[str, QuantTuning] = {}  # role -> the block-size choice (export --tune)
        self.gguf_import: dict[str, dict[str, KeptTensor]] = {}  # role -> what each weight kept of the GGUF
        self.quantization: dict[str, QuantMix] = {}  # role -> each weight's form (float source quantized here)

    def _variant(self, layers: int | None, head_ids: np.ndarray | None):
        """Spec and weights of an early-exit and/or vocabulary-truncated copy of this model."""
        spec, weights = self.spec, self.weights
        if layers is not None:
            if layers > spec.n_layers:
                raise InvalidParameterError(f"draft_layers {layers} exceeds the model's {spec.n_layers} layers")
            spec = replace(spec, n_layers=layers)  # the builder reads layers 0..layers-1 only
        if head_ids is not None:
            lm_head = weights["lm_head"] if "lm_head" in weights else weights["embed"].T
            weights = weights | {"lm_head": np.ascontiguousarray(lm_head[:, head_ids])}
            spec = replace(spec, vocab_size=len(head_ids), tied_embeddings=False)
        return spec, weights

    def _write(self, role: str, precision: str, source: str, *, layers: int | None = None,
               head_ids: np.ndarray | None = None, tune_block_size: bool = False) -> ModelEntry:
        from .graph import build_decoder
        from .quantize import QuantConfig, quantize_graph
        from .validate import (FP16_RELATIVE_TOLERANCE, FP32_RELATIVE_TOLERANCE, batch_variance, compare_graphs,
                               compare_with_source, validate_graph)

        folder = self.root / role
        folder.mkdir(exist_ok=True)
        graph = folder / "model.onnx"
        cfg = self.config
        spec, weights = self._variant(layers, head_ids)
        head_file = None
        if head_ids is not None:
            head_file = folder / "head_tokens.i32"
            np.asarray(head_ids, "<i4").tofile(head_file)
        check = {"head_ids": head_ids, "layers": layers, "edges": self.edges}
        if precision in ("fp32", "fp16"):
            dtype = np.float32 if precision == "fp32" else np.float16
            files = build_decoder(spec, weights, graph, dtype=dtype, attention=self.attention,
                                  max_context=cfg.max_context, io=self.io,
                                  on_layer=self._eta(f"{role}: writing the {precision} graph", spec.n_layers,
                                                     "layers"))
            entry = self._entry(role, files, source, precision, "float32" if precision == "fp32" else "float16",
                                spec=spec, head_file=head_file)
            tol = FP32_RELATIVE_TOLERANCE if precision == "fp32" else FP16_RELATIVE_TOLERANCE
            report = validate_graph(self.loaded.model, entry, graph, relative_tolerance=tol, **check)
            self.reports[f"{role}:{precision}"] = report
            self.batch_variance[role] = batch_variance(entry, graph, max_verify=cfg.max_draft_tokens + 1)
            return entry
        # Weight-only int4/int8: quantize a validated fp32 graph (untied lm_head so the output
        # layer, often the biggest matrix, is quantized too).
        scratch = self.root / f".{role}-fp32-src"
        scratch.mkdir(exist_ok=True)
        src_graph = scratch / "model.onnx"
        self.progress(f"{role}: writing the fp32 graph")
        src_files = build_decoder(spec, weights, src_graph, untie_lm_head=True, attention=self.attention,
                                  max_context=cfg.max_context, io=self.io,
                                  on_layer=self._eta(f"{role}: writing the fp32 graph", spec.n_layers, "layers"))
        src_entry = self._entry(role, src_files, source, "fp32", "float32", spec=spec, head_file=head_file)
        layered = self._layered_validation(spec)
        if layered is None:
            self.progress(f"{role}: validating the fp32 graph against the source")
            self.reports[f"{role}:fp32-untied"] = validate_graph(
                self.loaded.model, src_entry, src_graph, relative_tolerance=FP32_RELATIVE_TOLERANCE, **check)
        else:
            self._validate_first_layers(role, layered, spec, weights, source, head_file, check)
        release_memory()  # the validation's sessions and reference logits, before the quantized graph is built
        bits = 4 if precision == "int4" else 8
        gguf = self._gguf_to_keep(precision)
        if gguf is not None:
            from .gguf_import import import_gguf

            if tune_block_size:
                self.progress("tune: the GGUF's own blocks are kept, so there is no block size to choose")
            self.progress(f"{role}: writing the graph with the GGUF's own quantization")
            files, self.gguf_import[role] = import_gguf(
                src_graph, graph, gguf, self.weights, n_layers=spec.n_layers, n_heads=spec.n_heads,
                n_kv_heads=spec.n_kv_heads, accuracy_level=cfg.accuracy_level, head_ids=head_ids, note=self.progress,
                progress=self._eta(f"{role}: writing the GGUF's blocks", 1, "weights").update)
        elif tune_block_size:
            files = self._tuned_quantization(role, src_entry, src_graph, graph, bits, source, precision, spec,
                                             head_file)
        else:
            mix = self._mix(role) if bits == 4 else "rtn-sym8"
            importance = self._importance(role, bits, spec, src_entry, src_graph)
            self.progress(f"{role}: quantizing to {precision} (block {cfg.block_size}, mix {mix})")
            chosen: dict = {}
            eta = self._eta(f"{role}: quantizing", 1, "weights")
            files = quantize_graph(src_graph, graph, QuantConfig(bits=bits, block_size=cfg.block_size,
                                                                 accuracy_level=cfg.accuracy_level),
                                   plan=self._plan(role, bits, spec.n_layers, cfg.block_size), chosen=chosen,
                                   tied=spec.tied_embeddings, importance=importance, progress=eta.update)
            self.quantization[role] = _quant_record(mix, chosen)
        if precision == "int4" and cfg.head_screen_rows:
            self._screen_head(role, graph, spec.vocab_size)
        entry = self._entry(role, files, source, precision, "float32", spec=spec, head_file=head_file)
        if layered is None:
            self.progress(f"{role}: comparing {precision} with fp32")
            self.reports[f"{role}:{precision}-vs-fp32"] = compare_graphs(src_entry, src_graph, entry, graph)
        else:  # the whole fp32 graph is never loaded: the quantized one is compared with the source itself
            self.progress(f"{role}: comparing {precision} with the source")
            self.reports[f"{role}:{precision}-vs-source"] = compare_with_source(
                self.loaded.model, entry, graph, layers=layers, head_ids=head_ids)
        self.progress(f"{role}: measuring verify rows against single steps (batch variance)")
        release_memory()  # an ORT session is freed by the collector (reference cycles): one session at a time
        self.batch_variance[role] = batch_variance(entry, graph, max_verify=cfg.max_draft_tokens + 1)
        release_memory()
        shutil.rmtree(scratch)
        return entry

    def _screen_head(self, role: str, graph: Path, vocab: int) -> None:
        """An int8 output head becomes an int4 screen plus fp32 rescoring of its top rows
        (export/head_screen.py). The manifest's per-weight record keeps the head's int8 form: the screen is
        a copy read first, not another weight (the graph names it; the bundle's size counts it)."""
        from .head_screen import add_head_screen
        from .mixquant import WIDE_INT8_BLOCK

        screened = add_head_screen(graph, vocab, self.config.head_screen_rows,
                                   copy_block=None if self._exact_layout(role) else WIDE_INT8_BLOCK)
        if screened is not None:
            self.progress(f"{role}: int8 output head screened by an int4 copy (block {screened.copy_block}); "
                          f"each position's top "
                          f"{screened.rows} rows rescored from the int8 integers")

    def _mix(self, role: str) -> str:
        """``--quant-mix`` for ``role``; a draft takes a ``-gptq`` mix without its error feedback
        (export/mixquant.py ``draft_mix``)."""
        from .mixquant import draft_mix

        return self.config.quant_mix if role == "target" else draft_mix(self.config.quant_mix)

    def _plan(self, role: str, bits: int, n_layers: int, block: int):
        """The per-tensor plan of ``role``'s mix at int4 (None: ONNX Runtime's own symmetric rounding, the
        layout of int8 and of mix rtn-sym4)."""
        from .mixquant import make_plan

        if bits != 4 or self._mix(role) == "rtn-sym4":
            return None
        return make_plan(self._mix(role), n_layers, block, int8_layer_block=self._wide_block(role, block))

    def _exact_layout(self, role: str) -> bool:
        """Whether ``role``'s graph keeps the row-invariant layout: the target of an ``export --exact``, whose
        plain steps must equal its verify rows bit for bit. A draft's rows never reach the output."""
        return self.config.exact and role == "target"

    def _wide_block(self, role: str, block: int) -> int:
        """The block of ``role``'s weights whose rounding does not need ``block`` (export/mixquant.py
        ``WIDE_INT8_BLOCK``): wider for fast mode, ``block`` for the exact layout."""
        from .mixquant import WIDE_INT8_BLOCK

        return block if self._exact_layout(role) else max(block, WIDE_INT8_BLOCK)

    def _importance(self, role: str, bits: int, spec, src_entry: ModelEntry, src_graph: Path) -> dict | None:
        """Each weight's activation importance on the calibration texts (export/importance.py), when the mix
        weighs its rounding by it (for a ``-gptq`` mix, each input's whole second moment); else None.

        Measured on the fp32 graph where the export validates it whole (its session fits the same memory);
        above that, on a round-to-nearest int4 copy (about an eighth of the fp32 session's memory), whose
        activations carry int4 rounding: the channels' ranking, which the weighting needs, survives it."""
        from .importance import activation_importance, activation_moments, calibration_ids
        from .mixquant import GPTQ, IMATRIX
        from .quantize import QuantConfig, quantize_graph

        gptq = self._mix(role).endswith(GPTQ)
        if bits != 4 or not (gptq or self._mix(role).endswith(IMATRIX)):
            return None
        ids = calibration_ids(lambda text: list(self.loaded.tokenizer.encode(text)), src_entry.vocab_size,
                              src_entry.max_context)
        if not ids:  # a tokenizer whose ids all fall outside the graph's vocabulary (a test model's)
            self.progress(f"{role}: no calibration token is in the model's vocabulary; its int4 blocks are searched "
                          f"unweighted (recorded as 'search')")
            return None
        probe_dir = src_graph.parent / "importance-probe"
        probe = src_graph
        if self._layered_validation(spec) is not None:
            self.progress(f"{role}: an int4 copy to measure activation importance on (the fp32 graph is too big "
                          "to run whole)")
            shutil.rmtree(probe_dir, ignore_errors=True)
            probe_dir.mkdir()
            probe = quantize_graph(src_graph, probe_dir / src_graph.name, QuantConfig(bits=4, block_size=32),
                                   progress=self._eta(f"{role}: the int4 copy", 1, "weights").update)[0]
        what = "activation second moments" if gptq else "activation importance"
        self.progress(f"{role}: measuring {what} on the calibration texts ({sum(len(i) for i in ids)} tokens)")
        eta = self._eta(f"{role}: {what}", 1, "chunks")
        try:
            if gptq:  # the activations kept whole go to the role's scratch folder, removed with it
                spill = src_graph.parent / "moments"
                spill.mkdir(exist_ok=True)
                importance = activation_moments(src_entry, probe, ids, weights_of=src_graph, spill=spill,
                                                progress=eta.update)
            else:
                importance = activation_importance(src_entry, probe, ids, weights_of=src_graph, progress=eta.update)
        finally:
            shutil.rmtree(probe_dir, ignore_errors=True)
        release_memory()  # the probe's session
        return importance

    def _eta(self, what: str, total: int, unit: str):
        """An export/progress.py ``Eta`` printing to stderr (nothing when quiet)."""
        from .progress import Eta

        quiet = self.config.quiet
        return Eta(what, total, unit, lambda line: None if quiet else print(line, file=sys.stderr, flush=True))

    def _layered_validation(self, spec) -> int | None:
        """The leading layers a layer-limited fp32 check builds (export/validate.py ``validation_layers``),
        or None to validate the whole fp32 graph (``--validation``; auto: whole up to WHOLE_VALIDATION_BYTES)."""
        from .validate import validation_layers

        mode = self.config.validation
        if mode == "auto":
            fp32_bytes = 4 * sum(p.numel() for p in self.loaded.model.parameters())
            mode = "whole" if fp32_bytes <= WHOLE_VALIDATION_BYTES else "layers"
        return None if mode == "whole" else validation_layers(spec)

    def _validate_first_layers(self, role: str, n: int, spec, weights, source: str, head_file: Path | None,
                               check: dict) -> None:
        """Build an fp32 graph of the first ``n`` layers (with the final norm and output layer), validate it
        against the source's first ``n`` layers over the whole validation plan (every edge), delete it."""
        from .graph import build_decoder
        from .validate import FP32_RELATIVE_TOLERANCE, validate_graph

        folder = self.root / f".{role}-fp32-layers"
        folder.mkdir(exist_ok=True)
        part = replace(spec, n_layers=n)
        check = check | {"layers": n}
        if check["head_ids"] is None and spec.vocab_size > CHECK_HEAD_COLUMNS:
            # The output layer keeps evenly spaced columns (the first and last included): the same MatMul
            # over a slice of the vocabulary, compared with the same columns of the source's logits.
            head_ids = np.unique(np.linspace(0, spec.vocab_size - 1, CHECK_HEAD_COLUMNS).astype(np.int64))
            lm_head = weights["lm_head"] if "lm_head" in weights else weights["embed"].T
            weights = weights | {"lm_head": np.ascontiguousarray(lm_head[:, head_ids])}
            del lm_head
            part = replace(part, vocab_size=len(head_ids), tied_embeddings=False)
            head_file = folder / "head_tokens.i32"
            np.asarray(head_ids, "<i4").tofile(head_file)
            check["head_ids"] = head_ids
        columns = "" if check["head_ids"] is None else f", {len(check['head_ids'])} output columns"
        self.progress(f"{role}: validating an fp32 graph of the first {n} of {spec.n_layers} layers{columns} "
                      "against the source's")
        files = build_decoder(part, weights, folder / "model.onnx", untie_lm_head=True, attention=self.attention,
                              max_context=self.config.max_context, io=self.io)
        entry = self._entry(role, files, source, "fp32", "float32", spec=part, head_file=head_file)
        self.reports[f"{role}:fp32-first-{n}-layers"] = validate_graph(
            self.loaded.model, entry, folder / "model.onnx", relative_tolerance=FP32_RELATIVE_TOLERANCE, **check)
        shutil.rmtree(folder)

    def _gguf_to_keep(self, precision: str) -> Path | None:
        """The GGUF file whose quantization an int4 export keeps, or None (an HF source, or --requantize).

        int8 would round a GGUF's already quantized weights again: it is refused unless asked for."""
        origin = self.loaded.origin
        if origin is None or not origin.is_file() or origin.suffix != ".gguf" or self.config.requantize:
            return None
        if precision != "int4":
            raise ExportError(f"{origin.name} is already quantized: --precision int4 keeps the file's own "
                              f"quantization (4- or 8-bit blocks, as the file has them), {precision} would round its "
                              "weights a second time; pass --requantize to do that anyway")
        return origin

    def _tuned_quantization(self, role: str, src_entry: ModelEntry, src_graph: Path, graph: Path, bits: int,
                            source: str, precision: str, spec, head_file: Path | None) -> list[Path]:
        """Quantize ``src_graph`` at the candidate block sizes export/tune.py measures, keep the one it chooses
        (moved to ``graph``), record the measurements in ``self.quant_tuning[role]``.

        Each measurement is saved as it is taken (export/tune_saved.py), so the same export run again after
        a Ctrl-C measures only the blocks still missing; a block measured in an earlier run is quantized only
        if it is chosen. A Ctrl-C before block 32 was measured keeps block 32 untuned (no record)."""
        from ..bundle.extra import MachineFingerprint
        from .quantize import QuantConfig, quantize_graph
        from .tune import (CANDIDATE_BLOCKS, METHOD, Candidate, Measurements, calibration_prompts, timed_rows,
                           tune_block_size)
        from .tune_saved import SavedTuning, TuneKey, digest_of, library_versions, source_identity

        cfg = self.config
        scratch = src_graph.parent
        mix = self._mix(role) if bits == 4 else "rtn-sym8"
        candidates: dict[int, Candidate] = {}
        files: dict[int, list[Path]] = {}
        chosen: dict[int, dict] = {}  # block -> each weight's form, for the manifest's record

        def quantized(block: int) -> Candidate:
            if block not in candidates:
                folder = scratch / f"block{block}"
                shutil.rmtree(folder, ignore_errors=True)  # what a quantization stopped by Ctrl-C left
                folder.mkdir()
                self.progress(f"tune: quantizing {role} at block {block}")
                forms: dict = {}
                eta = self._eta(f"tune: quantizing {role} at block {block}", 1, "weights")
                written = quantize_graph(src_graph, folder / graph.name,
                                         QuantConfig(bits=bits, block_size=block, accuracy_level=cfg.accuracy_level),
                                         plan=self._plan(role, bits, spec.n_layers, block), chosen=forms,
                                         tied=spec.tied_embeddings, importance=importance, progress=eta.update)
                entry = self._entry(role, written, source, precision, "float32", spec=spec, head_file=head_file)
                files[block], chosen[block] = written, forms
                candidates[block] = Candidate(block, entry, written[0])
            return candidates[block]

        importance = self._importance(role, bits, spec, src_entry, src_graph)
        prompts = calibration_prompts(lambda text: list(self.loaded.tokenizer.encode(text)), src_entry.vocab_size,
                                      src_entry.max_context)
        origin = self.loaded.origin
        saved = None
        if origin is not None and origin.exists():
            key = TuneKey(source=source_identity(origin), role=role, bits=bits, mix=mix,
                          accuracy_level=cfg.accuracy_level, max_context=cfg.max_context, attention=self.attention,
                          layers=spec.n_layers, head="" if head_file is None else _sha256_bytes(head_file.read_bytes()),
                          prompts=digest_of([p.tolist() for p in prompts]), max_verify=cfg.max_draft_tokens + 1,
                          step_rows=timed_rows(role, cfg.exact), machine=MachineFingerprint.here(cfg.tune_threads),
                          method=METHOD, versions=library_versions())
            saved = SavedTuning.in_cache(key, origin.stem if origin.is_file() else origin.name)
        else:
            self.progress("tune: the source is not a file or folder to name it by: measurements are not saved")
        tuning = tune_block_size(CANDIDATE_BLOCKS, quantized, src_entry, src_graph, prompts,
                                 max_verify=cfg.max_draft_tokens + 1, threads=cfg.tune_threads, role=role,
                                 exact=cfg.exact, saved=Measurements() if saved is None else saved.load(self.progress),
                                 on_measured=(lambda _: None) if saved is None else
                                 (lambda measured: saved.save(measured, self.progress)),
                                 progress=self.progress)
        if tuning is None:
            block = min(CANDIDATE_BLOCKS)
            self.progress(f"tune: stopped before block {block} was measured: {role} keeps block {block}, untuned "
                          "(no tuning record)")
        else:
            self.quant_tuning[role] = tuning
            block = tuning.chosen
            measured = "; ".join(
                f"block {c.block_size}: {tuning.step_rows}-row step {c.exact_step_ms:.1f} ms, agreement "
                f"{c.greedy_agreement:.3f}{'' if c.bit_identical or not tuning.exact_required else ', NOT exact'}"
                for c in tuning.candidates)
            self.progress(f"tune: {role} keeps block {block} ({measured})")
        if tuning is not None and tuning.stopped and saved is not None:
            self.progress(f"tune: what was measured is saved in {saved.path}: the same export run again measures "
                          "only the block sizes still missing")
        quantized(block)  # a block whose measurement was reused is quantized here, once chosen
        self.quantization[role] = _quant_record(mix, chosen[block])
        out = []
        for path in files[block]:  # the graph keeps its data file's name: moved together, it still loads
            out.append(graph.parent / path.name)
            os.replace(path, out[-1])
        return out

    def _entry(self, role: str, files: list[Path], source: str, precision: str, kv_dtype: str, *, spec=None,
               head_file: Path | None = None) -> ModelEntry:
        rel = [str(p.relative_to(self.root)) for p in files]
        spec = spec or self.spec
        entry = _entry(replace(spec, vocab_size=self.spec.vocab_size), graph=rel[0], data_files=rel[1:],
                       source=source, precision=precision, max_context=self.config.max_context,
                       eos=self.loaded.eos_token_ids, kv_dtype=kv_dtype, tokenizer_sha256=self.tokenizer_sha256,
                       attention=self.attention, io=self.io)
        if head_file is not None:
            entry = replace(entry, head_tokens=str(head_file.relative_to(self.root)), head_size=spec.vocab_size)
        return entry


def _quant_record(mix: str, chosen: dict) -> QuantMix:
    """The manifest's record of a quantized graph: weight name -> (TensorQuant, elements, shares, scale bits)
    as QuantizedTensor (export/rtn.py ``quantize_streaming``'s ``chosen``)."""
    return QuantMix(mix, {name: QuantizedTensor(form.bits, form.block, form.symmetric, form.method, elements, shares,
                                                scale_bits)
                          for name, (form, elements, shares, scale_bits) in chosen.items()})


def draft_head_tokens(tokenizer, vocab_size: int, size: int, eos_ids: tuple[int, ...]) -> np.ndarray:
    """The ``size`` token ids a vocabulary-truncated draft head keeps, sorted.

    Special and EOS tokens always stay (a draft that cannot propose EOS never ends a block
    on it). The rest are ranked by BPE merge order (a lower id was merged earlier, i.e. its
    pair was more frequent in the tokenizer's training corpus), the corpus-frequency ranking
    of FR-Spec without needing a corpus here.
    """
    keep = {i for i in eos_ids} | {i for i in tokenizer.get_added_vocab().values() if i < vocab_size}
    if size < len(keep):
        raise InvalidParameterError(f"draft_vocab {size} is smaller than the {len(keep)} special tokens it must keep")
    for token_id in range(vocab_size):
        if len(keep) >= size:
            break
        keep.add(token_id)
    return np.array(sorted(keep), np.int64)


def _save_tokenizer(tokenizer, root: Path, *, add_bos_token: bool) -> TokenizerEntry:
    """Write the tokenizer files the runtime reads; ``add_bos_token`` is what the source's tokenizer
    does (tokenizer_parity.added_bos), not its possibly unset flag."""
    tokenizer.save_pretrained(str(root))
    for extra in root.iterdir():  # keep the bundle to what the runtime reads
        if extra.is_file() and extra.name not in _TOKENIZER_FILES:
            extra.unlink()
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # multiple named templates: the runtime uses the default one
        template = template.get("default")
    if template and not (root / "chat_template.jinja").exists():
        (root / "chat_template.jinja").write_text(template, encoding="utf-8")
    tok_json = root / "tokenizer.json"
    if not tok_json.exists():
        raise ExportError("the source has no fast tokenizer (tokenizer.json); specedge's runtime needs one")
    return TokenizerEntry(
        file="tokenizer.json",
        config="tokenizer_config.json" if (root / "tokenizer_config.json").exists() else None,
        chat_template="chat_template.jinja" if (root / "chat_template.jinja").exists() else None,
        sha256=_sha256_bytes(tok_json.read_bytes()), bos_token=tokenizer.bos_token,
        eos_token=tokenizer.eos_token, add_bos_token=add_bos_token)


def clean_stale_siblings(out: Path) -> list[Path]:
    """Remove ``.OUT.partial-PID`` / ``.OUT.old-PID`` folders that killed exports left; return them.

    A stale ``.old`` while ``out`` is missing is the bundle a killed export had set aside in
    the middle of its swap, the only complete copy: it is moved back to ``out``, not deleted.
    """
    removed = []
    if not out.parent.is_dir():
        return removed
    for kind in ("old", "partial"):  # old first: a restored bundle must not be mistaken for a leftover
        prefix = f".{out.name}.{kind}-"
        for path in sorted(out.parent.glob(f"{glob_escape(prefix)}*")):
            pid = pid_after(path.name, prefix)
            if pid is None or not is_stale(path, pid):
                continue
            if kind == "old" and not out.exists() and (path / "manifest.json").is_file():
                os.replace(path, out)
                continue
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def glob_escape(text: str) -> str:
    """``text`` with glob metacharacters escaped (a bundle name may contain '[')."""
    import glob

    return glob.escape(text)


def export_bundle(config: ExportConfig) -> Manifest:
    """Run the whole export; return the manifest of the bundle written to ``config.out``."""
    from .loader import load_source

    from .preflight import check_out, check_source

    # Before anything loads: a bad --out or source fails in milliseconds, not after the export.
    # --out comes back resolved: a symlink (dangling or not) is written through (export/preflight.py).
    out = check_out(Path(config.out))
    check_source(config.target, "target")
    if config.draft is not None and config.draft not in SELF_DRAFTS:
        check_source(config.draft, "draft")
    clean_stale_siblings(out)  # first: it may put back a bundle a killed export had set aside
    if out.exists() and not config.overwrite:
        raise ExportError(f"{out} already exists; pass --overwrite to replace it")
    # --overwrite replaces a bundle, never an arbitrary folder (`--out . --overwrite` must not wipe it).
    if out.exists() and not (out / "manifest.json").is_file() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"{out} exists and is not a specedge bundle (no manifest.json): --overwrite only "
                          "replaces a bundle; choose another --out")
    self_draft = config.draft in SELF_DRAFTS
    stages = 4 + (0 if config.draft is None else (1 if self_draft else 2))
    progress = _Progress(config.quiet, stages)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    old = out.parent / f".{out.name}.old-{os.getpid()}"  # the replaced bundle, until the new one is in place
    swapped = False
    started = time.perf_counter()
    try:
        progress(f"loading target {config.target}")
        target_loaded = load_source(config.target, trust_pickle=config.trust_pickle, quiet=config.quiet,
                                    stream=True, convert_into=None if config.keep_converted else tmp / ".target-gguf")
        # The special-token rules come from the source's own tokenizer (a GGUF file's metadata, not its
        # dequantized copy's), and the bundle must then encode every parity text as the source does.
        reference = source_tokenizer(target_loaded)
        tokenizer = _save_tokenizer(target_loaded.tokenizer, tmp, add_bos_token=added_bos(reference))
        parity = check_parity(load_codec(tmp, tokenizer), reference, tokenizer.add_bos_token)
        progress.note(f"tokenizer parity with the source: {parity.texts} texts, {parity.conversations} "
                      f"conversations (add_bos_token={str(parity.add_bos_token).lower()})")
        del reference
        release_memory()  # a GGUF's conversion and the tokenizers' parity run leave freed heap behind
        target_vocab = target_loaded.tokenizer.get_vocab()
        progress(f"building + validating target graph ({config.precision})")
        target_exp = _ModelExporter(tmp, target_loaded, config, tokenizer.sha256, progress.note)
        target = target_exp._write("target", config.precision, target_loaded.source,
                                   tune_block_size=config.tune_block_size and config.precision in QUANTIZED)
        reports = dict(target_exp.reports)
        variance = dict(target_exp.batch_variance)
        quant_tuning = dict(target_exp.quant_tuning)
        gguf_kept = dict(target_exp.gguf_import)
        quantization = dict(target_exp.quantization)
        warned = {"target": target_exp.context_warning} if target_exp.context_warning else {}
        unknown = {"target": tuple(target_exp.features.unknown_fields)} if target_exp.features.unknown_fields else {}
        # The runtime's plain steps run 2 rows so speculation stays exact (engines/invariant.py):
        # record, for this graph on this machine, that it holds and what it costs.
        from .validate import exact_steps

        progress.note("target: checking that plain steps equal verify rows on this machine")
        exact = {"target": exact_steps(target, tmp / target.graph, max_verify=config.max_draft_tokens + 1)}
        release_memory()  # that check's session, before the next one opens
        if not exact["target"].bit_identical and config.exact and not config.quiet:
            print("[specedge export] WARNING: on this machine a 2-row step of the target is not bit-identical to "
                  "a verify row even in the exact layout, so exact mode will refuse this bundle; fast mode runs it "
                  "as usual", file=sys.stderr)
        elif not exact["target"].bit_identical:  # expected of fast mode's wide blocks (export/mixquant.py)
            progress.note("target: its plain steps are not bit-identical to verify rows here, so exact mode "
                          "(generate --exact) will refuse it: fast mode runs it; `export --exact` writes the exact layout")
        draft = None
        head_ids = (draft_head_tokens(target_loaded.tokenizer, target.vocab_size, config.draft_vocab,
                                      target.eos_token_ids) if config.draft_vocab else None)
        if self_draft:
            precision = config.draft.removeprefix("self-")
            layers = f", first {config.draft_layers} layers" if config.draft_layers else ""
            progress(f"building self-draft ({precision} copy of the target{layers})")
            what = f"self-{precision}{layers} of {target_loaded.source}"
            draft = target_exp._write("draft", precision, what, layers=config.draft_layers, head_ids=head_ids,
                                      tune_block_size=config.tune_block_size and precision in QUANTIZED)
            reports.update(target_exp.reports)
            quant_tuning.update(target_exp.quant_tuning)
            gguf_kept.update(target_exp.gguf_import)
            quantization.update(target_exp.quantization)
            variance.update(target_exp.batch_variance)
        # A short `specedge eval` while the source is in memory for validation anyway (export/quality.py).
        from .quality import export_quality

        progress.note("target: scoring built-in text against the source (export quality)")
        quality = export_quality(tmp / target.graph, target, load_codec(tmp, tokenizer), target_loaded.model,
                                 target_loaded.source, progress.note,
                                 progress=target_exp._eta("target: export quality", 1, "chunks").update)
        converted = target_loaded.scratch
        del target_exp, target_loaded
        release_memory()
        if converted is not None:  # the float32 copy of a GGUF (not --keep-converted): done with it
            shutil.rmtree(converted)
        if config.draft is not None and not self_draft:
            progress(f"loading draft {config.draft}")
            draft_loaded = load_source(config.draft, trust_pickle=config.trust_pickle, quiet=config.quiet,
                                       stream=True, convert_into=None if config.keep_converted else tmp / ".draft-gguf")
            if draft_loaded.tokenizer.get_vocab() != target_vocab:
                raise VocabMismatchError(
                    f"draft {config.draft} has a different vocabulary from target {config.target} "
                    f"({len(draft_loaded.tokenizer.get_vocab())} vs {len(target_vocab)} tokens); a draft must "
                    "share the target's tokenizer")
            draft_precision = config.draft_precision or config.precision
            progress(f"building + validating draft graph ({draft_precision})")
            draft_exp = _ModelExporter(tmp, draft_loaded, config, tokenizer.sha256, progress.note)
            draft = draft_exp._write("draft", draft_precision, draft_loaded.source, head_ids=head_ids,
                                     tune_block_size=config.tune_block_size and draft_precision in QUANTIZED)
            reports.update(draft_exp.reports)
            quant_tuning.update(draft_exp.quant_tuning)
            gguf_kept.update(draft_exp.gguf_import)
            quantization.update(draft_exp.quantization)
            variance.update(draft_exp.batch_variance)
            if draft_exp.context_warning:
                warned["draft"] = draft_exp.context_warning
            if draft_exp.features.unknown_fields:
                unknown["draft"] = tuple(draft_exp.features.unknown_fields)
            converted = draft_loaded.scratch
            del draft_exp, draft_loaded
            release_memory()
            if converted is not None:
                shutil.rmtree(converted)
        progress("writing manifest")
        files = {}
        for path in sorted(tmp.rglob("*")):
            if path.is_file():
                path.chmod(0o644)  # onnx writes external data 0600; a bundle is meant to be shared
                files[str(path.relative_to(tmp))] = file_record(path)
        if draft is not None and draft.vocab_size != target.vocab_size:
            raise VocabMismatchError(f"draft vocab_size {draft.vocab_size} != target vocab_size {target.vocab_size}")
        manifest = Manifest(
            target=target, draft=draft, tokenizer=tokenizer,
            speculation=SpeculationDefaults(drafter=DEFAULT_DRAFTER,
                                            draft_tokens=min(4, config.max_draft_tokens),
                                            max_draft_tokens=config.max_draft_tokens),
            files=files, created_by=f"specedge {__version__}",
            extra=ManifestExtra(validation=reports, batch_variance=variance, exact_steps=exact,
                                quant_tuning=quant_tuning, context_warnings=warned, unknown_config_fields=unknown,
                                gguf_import=gguf_kept, quantization=quantization,
                                export_seconds=round(time.perf_counter() - started, 1), quality=quality),
        )
        write_manifest(tmp, manifest)
        # Set the old bundle aside (a rename) rather than deleting it first: an interrupt during the
        # swap then puts it back, so `out` always holds one complete bundle.
        try:
            if out.exists():
                shutil.rmtree(old, ignore_errors=True)
                os.replace(out, old)
            os.replace(tmp, out)
            swapped = True
        except BaseException:
            if old.exists() and not out.exists():
                os.replace(old, out)
            raise
        progress(f"bundle written to {out} ({manifest.total_bytes / 1e6:.0f} MB)")
        return manifest
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if swapped:
            shutil.rmtree(old, ignore_errors=True)
