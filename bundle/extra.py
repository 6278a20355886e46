"""The typed parts of a manifest's ``extra``: one frozen dataclass and one parser each.

``extra`` holds what export and later tools record about a bundle beyond the models
themselves. Every key is declared here (:class:`ManifestExtra`), and each value has one
parser (``from_dict``) and one writer (``to_dict``), so no caller reads raw JSON:

==========================  ==========================================  ================================
key                         type                                        written by
==========================  ==========================================  ================================
``validation``              role:label -> :class:`ValidationRecord` or   export (ORT vs PyTorch)
                            :class:`ComparisonRecord`
``batch_variance``          role -> float                                export (the near-tie record)
``exact_steps``             role -> :class:`ExactSteps`                  export (batch-invariant steps)
``context_warnings``        role -> str                                  export (max_context past training)
``unknown_config_fields``   role -> [field name]                         export (config fields not known)
``export_seconds``          float                                        export
``cost_profile``            :class:`CostProfile`                         ``specedge tune`` / ``--tune``
``engines``                 role -> :class:`EngineRecord`                ``export --engine tensorrt``
``quant_tuning``            role -> :class:`QuantTuning`                 ``export --tune`` (block size)
``gguf_import``             role -> weight -> :class:`KeptTensor`        export of a GGUF (file's quantization)
``quality``                 :class:`QualityRecord`                       export (a short ``specedge eval``)
``quantization``            role -> :class:`QuantMix`                    export of a float source at int4/int8
==========================  ==========================================  ================================

An unknown key, or a malformed value, is a :class:`~specedge.errors.ManifestError` (a
``BundleError``) naming the field. Bundles of format 1 and 2 wrote exactly these shapes.

Imports neither torch nor onnxruntime nor numpy (the runtime and the TensorRT engine read this).
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..errors import InvalidParameterError, ManifestError
from .schema import (MAX_DRAFT_TOKENS, ROLES, check_type, dotted, finite, optional_relpath, read_field,
                     refuse_unknown, relpath, show, string_map)

if TYPE_CHECKING:
    from .manifest import ModelIO

ROUTES = ("ort-trt", "native")  # ONNX Runtime's TensorRT EP with its engine cache, or a plan we build ourselves
TRT_PRECISIONS = ("fp32", "fp16", "int8")
# Verify lengths a cost profile may time: 1 (a plain step) .. the largest verify a bundle may declare.
MAX_VERIFY = MAX_DRAFT_TOKENS + 1


def _role_map(obj: Any, name: str) -> dict[str, Any]:
    """A JSON object keyed by model role (target, draft)."""
    if not isinstance(obj, dict):
        raise ManifestError(f"manifest field '{name}' must be an object keyed by model role ({', '.join(ROLES)}), "
                            f"got {show(obj)}")
    for role in obj:
        if role not in ROLES:
            raise ManifestError(f"manifest field '{name}' has key {show(role)}; keys are model roles "
                                f"({', '.join(ROLES)})")
    return obj


def _number(value: Any, name: str) -> float:
    """Any JSON number (NaN included: a non-strict validation may record one), as a float."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ManifestError(f"manifest field '{name}' must be a number, got {show(value)}")
    return float(value)


def _fraction(value: Any, name: str) -> float:
    value = finite(value, name)
    if value > 1:
        raise ManifestError(f"manifest field '{name}' must be a fraction in [0, 1], got {show(value)}")
    return value


# --------------------------------------------------------------------------- cost profile


@dataclass(frozen=True)
class MachineFingerprint:
    """What makes step timings transferable: the CPU model, its vector extensions, its core count,
    the thread setting.

    ``isa``: the CPU flags among :data:`ISA_FLAGS` it has, comma-joined. Why: the same model name
    ("AMD EPYC" in a VM) covered both an AVX2-only box and an AVX-512 one, whose int4 kernels and
    best block sizes differ; a record without it (written before) never matches this machine.
    """

    cpu: str
    cores: int
    threads: int  # intra-op threads the profile was measured with (0 = ORT's default)
    isa: str = ""

    # The extensions ONNX Runtime's CPU kernels (MLAS) dispatch on for the matmuls that dominate a step.
    ISA_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "avx_vnni", "amx_tile", "amx_int8", "amx_bf16",
                 "asimd", "asimddp", "sve", "i8mm")

    @classmethod
    def here(cls, threads: int) -> "MachineFingerprint":
        """This machine, at ``threads`` intra-op threads."""
        name: str | None = None
        flags: set[str] = set()
        try:
            with open("/proc/cpuinfo", encoding="utf-8") as f:
                for line in f:  # the first processor's entries describe them all
                    key, _, value = line.partition(":")
                    key = key.strip()
                    if key == "model name" and name is None:
                        name = value.strip()
                    elif key in ("flags", "Features") and not flags:  # x86 / Arm
                        flags = set(value.split())
        except OSError:
            pass
        cpu = name or platform.processor() or platform.machine()
        isa = ",".join(f for f in cls.ISA_FLAGS if f in flags)
        return cls(cpu=cpu, cores=os.cpu_count() or 0, threads=threads, isa=isa)

    def same_cpu(self, other: "MachineFingerprint") -> bool:
        """Same CPU model, extensions and core count (the thread setting aside)."""
        return (self.cpu, self.isa, self.cores) == (other.cpu, other.isa, other.cores)

    def describe(self) -> str:
        return f"{self.cpu} ({self.isa or 'extensions not recorded'}), {self.cores} cores"

    def to_dict(self) -> dict[str, Any]:
        return {"cpu": self.cpu, "cores": self.cores, "threads": self.threads, "isa": self.isa}

    @classmethod
    def from_dict(cls, obj: Any, where: str) -> "MachineFingerprint":
        check_type(obj, where, dict)
        refuse_unknown(obj, ("cpu", "cores", "threads", "isa"), where)
        ints = {}
        for key in ("cores", "threads"):
            ints[key] = read_field(obj, key, where, int)
            if ints[key] < 0:
                raise ManifestError(f"manifest field '{where}.{key}' must be >= 0, got {ints[key]}")
        return cls(cpu=read_field(obj, "cpu", where, str), isa=read_field(obj, "isa", where, str, optional=True,
                                                                        default=""), **ints)


@dataclass(frozen=True)
class CostProfile:
    """Step costs measured on one machine (``specedge tune``; :func:`specedge.runtime.costs.measure`).

    ``target_s``: verify length n (1 = a plain step, n = k + 1) -> seconds of one target forward.
    ``draft_token_s``: seconds of a 1-token draft step; ``draft_catchup_token_s``: seconds per
    token of a draft catch-up feed. Both None when the bundle has no draft model.
    ``target_s[1]`` is the exact plain step (2 rows, engines/invariant.py); ``target_one_row_s`` the
    bare 1-row step fast mode runs (None in profiles recorded before fast mode: then measured online).
    """

    machine: MachineFingerprint
    target_s: dict[int, float]
    context: int = 0  # cached positions the steps were timed after
    draft_token_s: float | None = None
    draft_catchup_token_s: float | None = None
    target_one_row_s: float | None = None

    OPTIONAL = ("draft_token_s", "draft_catchup_token_s", "target_one_row_s")
    KEYS = ("machine", "context", "target_s") + OPTIONAL

    def usable(self, threads: int) -> bool:
        """Measured on this CPU with the same thread setting (else re-measured)."""
        return self.machine == MachineFingerprint.here(threads)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"machine": self.machine.to_dict(), "context": self.context,
                               "target_s": {str(n): t for n, t in sorted(self.target_s.items())}}
        for key in self.OPTIONAL:
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out

    @classmethod
    def from_dict(cls, obj: Any, where: str = "extra.cost_profile") -> "CostProfile":
        if not isinstance(obj, dict):
            raise ManifestError(f"manifest field '{where}' must be an object, got {show(obj)}")
        refuse_unknown(obj, cls.KEYS, where)
        machine = MachineFingerprint.from_dict(read_field(obj, "machine", where, dict), f"{where}.machine")
        steps = read_field(obj, "target_s", where, dict)
        target_s = {}
        for n, seconds in steps.items():
            if not (isinstance(n, str) and n.isdigit() and 1 <= int(n) <= MAX_VERIFY):
                raise ManifestError(f"manifest field '{where}.target_s' has key {show(n)}; keys are verify "
                                    f"lengths '1'..'{MAX_VERIFY}'")
            target_s[int(n)] = finite(seconds, f"{where}.target_s.{n}", positive=True)
        if 1 not in target_s:
            raise ManifestError(f"manifest field '{where}.target_s' lacks '1' (the plain step every profile has)")
        optional = {key: (finite(obj[key], f"{where}.{key}", positive=True) if obj.get(key) is not None else None)
                    for key in cls.OPTIONAL}
        context = read_field(obj, "context", where, int, optional=True, default=0)
        if context < 0:
            raise ManifestError(f"manifest field '{where}.context' must be >= 0, got {context}")
        return cls(machine=machine, target_s=target_s, context=context, **optional)


# --------------------------------------------------------------------------- export records


@dataclass(frozen=True)
class ValidationRecord:
    """A graph checked against PyTorch at export (export/validate.py ``validate_graph``)."""

    max_abs_diff: dict[str, float]  # segment name ("prefill", "verify across edge 32", ...) -> max |ORT - torch|
    tolerance: float  # the largest difference allowed
    top1_agreement: float  # fraction of compared positions whose argmax equals PyTorch's

    def to_dict(self) -> dict[str, Any]:
        return {"max_abs_diff": dict(self.max_abs_diff), "tolerance": self.tolerance,
                "top1_agreement": self.top1_agreement}

    @classmethod
    def from_dict(cls, obj: Any, where: str) -> "ValidationRecord":
        check_type(obj, where, dict)
        refuse_unknown(obj, ("max_abs_diff", "tolerance", "top1_agreement"), where)
        diffs = read_field(obj, "max_abs_diff", where, dict)
        return cls(max_abs_diff={str(k): _number(v, f"{where}.max_abs_diff.{k}") for k, v in diffs.items()},
                   tolerance=finite(read_field(obj, "tolerance", where, (int, float)), f"{where}.tolerance"),
                   top1_agreement=_fraction(read_field(obj, "top1_agreement", where, (int, float)),
                                            f"{where}.top1_agreement"))


@dataclass(frozen=True)
class ComparisonRecord:
    """Two graphs compared teacher-forced (e.g. int4 vs fp32; export/validate.py ``compare_graphs``)."""

    top1_agreement: float
    max_abs_diff: float

    def to_dict(self) -> dict[str, Any]:
        return {"top1_agreement": self.top1_agreement, "max_abs_diff": self.max_abs_diff}

    @classmethod
    def from_dict(cls, obj: Any, where: str) -> "ComparisonRecord":
        check_type(obj, where, dict)
        refuse_unknown(obj, ("top1_agreement", "max_abs_diff"), where)
        return cls(top1_agreement=_fraction(read_field(obj, "top1_agreement", where, (int, float)),
                                            f"{where}.top1_agreement"),
                   max_abs_diff=_number(read_field(obj, "max_abs_diff", where, (int, float)),
                                        f"{where}.max_abs_diff"))


def _validation_entry(obj: Any, where: str) -> ValidationRecord | ComparisonRecord:
    """A validation (per-segment differences and a tolerance) or a comparison (one difference)."""
    check_type(obj, where, dict)
    return ValidationRecord.from_dict(obj, where) if "tolerance" in obj else ComparisonRecord.from_dict(obj, where)


@dataclass(frozen=True)
class ExactSteps:
    """Batch-invariant plain steps checked on the export machine (export/validate.py ``exact_steps``)."""

    bit_identical: bool  # a plain step's logits and K/V equal a verify row's, bit for bit
    two_row_step_cost: float  # a 2-row step over a bare 1-row step (what exact plain decoding pays)
    one_row_step_ms: float

    def to_dict(self) -> dict[str, Any]:
        return {"bit_identical": self.bit_identical, "two_row_step_cost": self.two_row_step_cost,
                "one_row_step_ms": self.one_row_step_ms}

    @classmethod
    def from_dict(cls, obj: Any, where: str) -> "ExactSteps":
        check_type(obj, where, dict)
        refuse_unknown(obj, ("bit_identical", "two_row_step_cost", "one_row_step_ms"), where)
        return cls(bit_identical=read_field(obj, "bit_identical", where, bool),
                   **{k: finite(read_field(obj, k, where, (int, float)), dotted(where, k))
                      for k in ("two_row_step_cost", "one_row_step_ms")})


@dataclass(frozen=True)
class KeptTensor:
    """How one graph weight (a MatMul's B, or ``embed``) carries a GGUF file's quantization
    (export/gguf_import.py).

    ``sources``: the GGUF tensors, fused along the output axis in this order; ``format``: their
    GGUF type(s) ("Q4_1", "Q4_K+Q6_K"); ``kept``: "int4"/"int8" (MatMulNBits or
    GatherBlockQuantized with the file's integers and scales) or "fp32" (no exact form: the
    dequantized weight, ``reason`` says why); ``block_size``: elements per scale (0 for fp32);
    ``offset``: an affine format's per-block offset is added in fp32 beside the blocks.
    """

    sources: tuple[str, ...]
    format: str
    kept: str
    block_size: int
    offset: bool
    reason: str = ""

    KEPT = ("int4", "int8", "fp32")
    FIELDS = ("sources", "format", "kept", "block_size", "offset", "reason")

    def to_dict(self) -> dict[str, Any]:
        out = {"sources": list(self.sources), "format": self.format, "kept": self.kept,
               "block_size": self.block_size, "offset": self.offset}
        if self.reason:
            out["reason"] = self.reason
        return out

    @classmethod
    def from_dict(cls, obj: Any, where: str) -> "KeptTensor":
        check_type(obj, where, dict)
        refuse_unknown(obj, cls.FIELDS, where)
        sources = read_field(obj, "sources", where, list)
        for i, name in enumerate(sources):
            check_type(name, f"{where}.sources[{i}]", str)
        kept = read_field(obj, "kept", where, str)
        if kept not in cls.KEPT:
            raise ManifestError(f"manifest field '{where}.kept' must be one of {', '.join(cls.KEPT)}, got {show(kept)}")
        block = read_field(obj, "block_size", where, int)
        if block < 0:
            raise ManifestError(f"manifest field '{where}.block_size' must be >= 0, got {block}")
        return cls(sources=tuple(sources), format=read_field(obj, "format", where, str), kept=kept, block_size=block,
                   offset=read_field(obj, "offset", where, bool),
                   reason=read_field(obj, "reason", where, str, optional=True, default=""))


@dataclass(frozen=True)
class QuantizedTensor:
    """How export quantized one graph weight of a float source (export/mixquant.py ``TensorQuant``).

    ``bits``: 4 or 8; ``block_size``: input-axis elements per scale; ``symmetric``: no zero points
    (else uint8 zero points, ``bits`` wide, one per block); ``method``: "rtn" (each block's min/max
    range), "search" (each block's scale and zero point chosen for the least squared error) or
    "imatrix" (that error weighted by the input channels' activation importance, export/importance.py)
    or "gptq" (rounded input channel by channel with error feedback through the inputs' second moment);
    ``elements``: the weight's element count (bits per weight are computed from it); ``shares``: the
    weight whose integers this one reads instead of storing its own ("embed" for a tied output layer,
    export/rtn.py), or "" when it stores them; ``scale_bits``: bits stored per block scale, 32 (float32),
    16 (float16 widened at load, export/scales.py) or 0 (reads the ``shares`` weight's scales too).
    """

    bits: int
    block_size: int
    symmetric: bool
    method: str
    elements: int
    shares: str = ""
    scale_bits: int = 32

    METHODS = ("rtn", "search", "imatrix", "gptq")
    SCALE_BITS = (0, 16, 32)
    FIELDS = ("bits", "block_size", "symmetric", "method", "elements", "shares", "scale_bits")

    def bits_per_weight(self) -> float:
        """Stored bits per element: integers (none when ``shares``), ``scale_bits`` per block, a ``bits``-wide
        zero point per block if asymmetric."""
        zero_point = 0 if self.symmetric else self.bits
        return (0 if self.shares else self.bits) + (self.scale_bits + zero_point) / self.block_size

    def describe(self) -> str:
        shared = f", reads {self.shares}'s integers" if self.shares else ""
        return f"int{self.bits}/{self.block_size} {'sym' if self.symmetric else 'asym'} {self.method}{shared}"

    def to_dict(self) -> dict[str, Any]:
        # "shares" only when set, "scale_bits" only when not 32: a manifest without them stays readable by
        # the specedge before them
        return {k: getattr(self, k) for k in self.FIELDS
                if (k != "shares" or self.shares) and (k != "scale_bits" or self.scale_bits != 32)}

    @classmethod
    def from_dict(cls, obj: Any, where: str) -> "QuantizedTensor":
        check_type(obj, where, dict)
        refuse_unknown(obj, cls.FIELDS, where)
        bits = read_field(obj, "bits", where, int)
        if bits not in (4, 8):
            raise ManifestError(f"manifest field '{where}.bits' must be 4 or 8, got {show(bits)}")
        block = read_field(obj, "block_size", where, int)
        if block < 1:
            raise ManifestError(f"manifest field '{where}.block_size' must be >= 1, got {block}")
        method = read_field(obj, "method", where, str)
        if method not in cls.METHODS:
            raise ManifestError(f"manifest field '{where}.method' must be one of {', '.join(cls.METHODS)}, "
                                f"got {show(method)}")
        elements = read_field(obj, "elements", where, int)
        if elements < 0:
            raise ManifestError(f"manifest field '{where}.elements' must be >= 0, got {elements}")
        scale_bits = read_field(obj, "scale_bits", where, int, optional=True, default=32)
        if scale_bits not in cls.SCALE_BITS:
            raise ManifestError(f"manifest field '{where}.scale_bits' must be one of "
                                f"{', '.join(map(str, cls.SCALE_BITS))}, got {show(scale_bits)}")
        return cls(bits=bits, block_size=block, symmetric=read_field(obj, "symmetric", where, bool), method=method,
                   elements=elements, shares=read_field(obj, "shares", where, str, optional=True, default=""),
                   scale_bits=scale_bits)


@dataclass(frozen=True)
class QuantMix:
    """A float source's per-tensor quantization (``export --quant-mix``): the mix's name (one of the int4
    mixes, or ``rtn-sym8`` for an int8 export: symmetric 8-bit min/max blocks everywhere) and, per graph
    weight (``layers.3.qkv``, ``lm_head``, ``embed``), its :class:`QuantizedTensor`."""

    mix: str
    tensors: dict[str, QuantizedTensor]

    def bits_per_weight(self) -> float:
        """Stored bits per element over every quantized weight (0.0 when none)."""
        total = sum(t.elements for t in self.tensors.values())
        return sum(t.bits_per_weight() * t.elements for t in self.tensors.values()) / total if total else 0.0

    def summary(self) -> str:
        """'mix: N x int4/32 asym search, ...; X.XX bits per weight'."""
        counts: dict[str, int] = {}
        for t in self.tensors.values():
            counts[t.describe()] = counts.get(t.describe(), 0) + 1
        forms = ", ".join(f"{n} x {d}" for d, n in sorted(counts.items(), key=lambda kv: -kv[1]))
        return f"{self.mix}: {forms}; {self.bits_per_weight():.2f} bits per weight"

    def to_dict(self) -> dict[str, Any]:
        return {"mix": self.mix, "tensors": {k: t.to_dict() for k, t in self.tensors.items()}}

    @classmethod
    def from_dict(cls, obj: Any, where: str) -> "QuantMix":
        check_type(obj, where, dict)
        refuse_unknown(obj, ("mix", "tensors"), where)
        tensors = read_field(obj, "tensors", where, dict)
        return cls(mix=read_field(obj, "mix", where, str),
                   tensors={str(k): QuantizedTensor.from_dict(v, f"{where}.tensors.{k}") for k, v in tensors.items()})


# --------------------------------------------------------------------------- quantization tuning


@dataclass(frozen=True)
class BlockCandidate:
    """One block size measured by ``export --tune`` (export/tune.py)."""

    block_size: int
    # median 1-token step as the role runs it: through the batch-invariant engine (2 rows) for a target,
    # 1 row for a draft (QuantTuning.step_rows; the name predates draft tuning)
    exact_step_ms: float
    verify_ms: float  # median 5-token verify
    greedy_agreement: float  # share of fp32 greedy tokens this graph's argmax reproduces, teacher-forced
    bit_identical: bool  # its exact steps equal verify rows bit for bit at every verify length (validate.py)
    # The finest block's step timed in the same rotated rounds as this one's, so that the two compare on
    # equal load even when the candidates were measured minutes or runs apart (a stopped and resumed
    # --tune). None: the finest block itself, or a record whose candidates were all timed in one set of
    # rounds (written before candidates were measured one at a time); its own exact_step_ms is the basis then.
    default_step_ms: float | None = None

    FIELDS = ("block_size", "exact_step_ms", "verify_ms", "greedy_agreement", "bit_identical", "default_step_ms")

    def step_ratio(self, default: "BlockCandidate") -> float:
        """This block's step over the finest block's (``default``), timed side by side where recorded."""
        basis = self.default_step_ms if self.default_step_ms is not None else default.exact_step_ms
        return self.exact_step_ms / basis

    def to_dict(self) -> dict[str, Any]:
        # default_step_ms only when set: a record without it reads as it did before the field existed.
        return {k: getattr(self, k) for k in self.FIELDS if getattr(self, k) is not None}

    @classmethod
    def from_dict(cls, obj: Any, where: str) -> "BlockCandidate":
        check_type(obj, where, dict)
        refuse_unknown(obj, cls.FIELDS, where)
        block = read_field(obj, "block_size", where, int)
        if block < 16 or block & (block - 1):
            raise ManifestError(f"manifest field '{where}.block_size' must be a power of two >= 16, got {block}")
        times = {k: finite(read_field(obj, k, where, (int, float)), dotted(where, k))
                 for k in ("exact_step_ms", "verify_ms")}
        if min(times.values()) <= 0:
            raise ManifestError(f"manifest field '{where}' needs positive step times, got {times}")
        paired = read_field(obj, "default_step_ms", where, (int, float), optional=True)
        return cls(block_size=block, greedy_agreement=_fraction(read_field(obj, "greedy_agreement", where,
                                                                           (int, float)),
                                                                f"{where}.greedy_agreement"),
                   bit_identical=read_field(obj, "bit_identical", where, bool),
                   default_step_ms=None if paired is None else finite(paired, dotted(where, "default_step_ms"),
                                                                      positive=True),
                   **times)


@dataclass(frozen=True)
class QuantTuning:
    """The block-size choice ``export --tune`` made for one quantized model, and what it measured."""

    machine: MachineFingerprint  # where it was measured (threads: the timing sessions' intra-op threads)
    candidates: tuple[BlockCandidate, ...]
    chosen: int  # the block size the bundle's graph was quantized with
    positions: int  # fp32 greedy tokens the agreement was measured on
    context: int  # cached positions of the timed steps
    # Rows of the timed step: 2 for a target (its exact plain step; exactness required), 1 for a draft
    # (drafts run plain 1-row steps and are verified, so exactness is not required). Older records: 2.
    step_rows: int = 2
    # True: the tuning was stopped (Ctrl-C) before every candidate block was measured; ``candidates`` lists
    # those that were, and the choice was made among them. Older records: False (every candidate measured).
    # Written only when True, so a complete tuning's record is what older readers expect.
    stopped: bool = False

    @property
    def exact_required(self) -> bool:
        """Whether the choice had to keep exact steps (a target's record; a draft's tokens are verified)."""
        return self.step_rows == 2

    def candidate(self, block_size: int) -> BlockCandidate:
        return next(c for c in self.candidates if c.block_size == block_size)

    def to_dict(self) -> dict[str, Any]:
        return {"machine": self.machine.to_dict(), "candidates": [c.to_dict() for c in self.candidates],
                "chosen": self.chosen, "positions": self.positions, "context": self.context,
                "step_rows": self.step_rows} | ({"stopped": True} if self.stopped else {})

    @classmethod
    def from_dict(cls, obj: Any, where: str) -> "QuantTuning":
        check_type(obj, where, dict)
        refuse_unknown(obj, ("machine", "candidates", "chosen", "positions", "context", "step_rows", "stopped"), where)
        raw = read_field(obj, "candidates", where, list)
        if not raw:
            raise ManifestError(f"manifest field '{where}.candidates' must list at least one block size")
        candidates = tuple(BlockCandidate.from_dict(c, f"{where}.candidates[{i}]") for i, c in enumerate(raw))
        chosen = read_field(obj, "chosen", where, int)
        if chosen not in {c.block_size for c in candidates}:
            raise ManifestError(f"manifest field '{where}.chosen' is {chosen}, which is not among the measured "
                                f"block sizes {[c.block_size for c in candidates]}")
        counts = {k: read_field(obj, k, where, int) for k in ("positions", "context")}
        for key, value in counts.items():
            if value < 1:
                raise ManifestError(f"manifest field '{where}.{key}' must be >= 1, got {value}")
        step_rows = read_field(obj, "step_rows", where, int, optional=True, default=2)
        if step_rows not in (1, 2):
            raise ManifestError(f"manifest field '{where}.step_rows' must be 1 (a draft) or 2 (a target), "
                                f"got {step_rows}")
        return cls(machine=MachineFingerprint.from_dict(read_field(obj, "machine", where, dict), f"{where}.machine"),
                   candidates=candidates, chosen=chosen, step_rows=step_rows,
                   stopped=read_field(obj, "stopped", where, bool, optional=True, default=False), **counts)


# --------------------------------------------------------------------------- quality (specedge eval)


@dataclass(frozen=True)
class QualityScore:
    """The target graph's perplexity on some text and, when the source was scored on the same
    chunks, the source's perplexity and the top-1 agreement (quality/evaluate.py).

    ``positions``: predicted positions (every chunk's tokens but its first). ``perplexity`` =
    exp(mean negative log-likelihood over them). ``source_perplexity`` and ``top1_agreement``
    (share of positions whose argmax equals the source's) are both None when scored alone;
    ``kl_divergence``: the mean KL(source || bundle) per position in nats (quality/metrics.py), None
    when scored alone or in a manifest written before it was measured.
    """

    positions: int
    perplexity: float
    source_perplexity: float | None = None
    top1_agreement: float | None = None
    kl_divergence: float | None = None

    FIELDS = ("positions", "perplexity", "source_perplexity", "top1_agreement", "kl_divergence")

    def __post_init__(self) -> None:
        if (self.source_perplexity is None) != (self.top1_agreement is None):
            raise InvalidParameterError("a quality score has a source perplexity and a top-1 agreement, or neither")
        if self.kl_divergence is not None and self.source_perplexity is None:
            raise InvalidParameterError("a quality score has a KL divergence only when scored with the source")

    @property
    def perplexity_ratio(self) -> float | None:
        """The bundle's perplexity over the source's (1.0: nothing lost on the way in)."""
        return None if self.source_perplexity is None else self.perplexity / self.source_perplexity

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.FIELDS if getattr(self, k) is not None}

    @classmethod
    def from_dict(cls, obj: Any, where: str) -> "QualityScore":
        check_type(obj, where, dict)
        refuse_unknown(obj, cls.FIELDS, where)
        positions = read_field(obj, "positions", where, int)
        if positions < 1:
            raise ManifestError(f"manifest field '{where}.positions' must be >= 1, got {positions}")
        source = read_field(obj, "source_perplexity", where, (int, float), optional=True)
        agreement = read_field(obj, "top1_agreement", where, (int, float), optional=True)
        kl = read_field(obj, "kl_divergence", where, (int, float), optional=True)
        try:
            return cls(positions=positions,
                       perplexity=finite(read_field(obj, "perplexity", where, (int, float)),
                                         f"{where}.perplexity", positive=True),
                       source_perplexity=(None if source is None
                                          else finite(source, f"{where}.source_perplexity", positive=True)),
                       top1_agreement=None if agreement is None else _fraction(agreement, f"{where}.top1_agreement"),
                       kl_divergence=None if kl is None else finite(kl, f"{where}.kl_divergence"))
        except InvalidParameterError as exc:
            raise ManifestError(f"manifest field '{where}': {exc}") from None


@dataclass(frozen=True)
class QualityRecord:
    """What ``specedge eval`` measured on the target graph (export records a short run).

    ``kinds``: text kind ("prose", "code", or a file's name) -> its score; ``overall``: every
    predicted position of every kind together. ``chunk``: tokens per teacher-forced chunk;
    ``max_tokens``: tokens of each text scored at most (None: whole texts). ``source``: what
    the source scores came from ("" when the bundle was scored alone).
    """

    chunk: int
    kinds: dict[str, QualityScore]
    overall: QualityScore
    max_tokens: int | None = None
    source: str = ""

    KEYS = ("chunk", "max_tokens", "source", "kinds", "overall")

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"chunk": self.chunk}
        if self.max_tokens is not None:
            out["max_tokens"] = self.max_tokens
        if self.source:
            out["source"] = self.source
        out["kinds"] = {k: s.to_dict() for k, s in self.kinds.items()}
        out["overall"] = self.overall.to_dict()
        return out

    @classmethod
    def from_dict(cls, obj: Any, where: str = "extra.quality") -> "QualityRecord":
        check_type(obj, where, dict)
        refuse_unknown(obj, cls.KEYS, where)
        ints = {k: read_field(obj, k, where, int, optional=k == "max_tokens") for k in ("chunk", "max_tokens")}
        if ints["chunk"] < 2:
            raise ManifestError(f"manifest field '{where}.chunk' must be >= 2, got {ints['chunk']}")
        if ints["max_tokens"] is not None and ints["max_tokens"] < 2:
            raise ManifestError(f"manifest field '{where}.max_tokens' must be >= 2, got {ints['max_tokens']}")
        kinds = read_field(obj, "kinds", where, dict)
        if not kinds:
            raise ManifestError(f"manifest field '{where}.kinds' must name at least one text kind")
        return cls(kinds={str(k): QualityScore.from_dict(v, f"{where}.kinds.{k}") for k, v in kinds.items()},
                   overall=QualityScore.from_dict(read_field(obj, "overall", where, dict), f"{where}.overall"),
                   source=read_field(obj, "source", where, str, optional=True, default=""), **ints)


# --------------------------------------------------------------------------- TensorRT engine records


@dataclass(frozen=True)
class ShapeRange:
    """min/opt/max of one input: its dims (execution tensor) or its values (shape tensor)."""

    min: tuple[int, ...]
    opt: tuple[int, ...]
    max: tuple[int, ...]

    def __post_init__(self) -> None:
        for name in ("min", "opt", "max"):
            object.__setattr__(self, name, tuple(int(d) for d in getattr(self, name)))
        if not len(self.min) == len(self.opt) == len(self.max):
            raise InvalidParameterError(f"shape range {self} has min/opt/max of different ranks")
        if any(not 0 <= lo <= mid <= hi for lo, mid, hi in zip(self.min, self.opt, self.max)):
            raise InvalidParameterError(f"shape range {self} needs 0 <= min <= opt <= max in every dimension")

    def contains(self, dims: tuple[int, ...]) -> bool:
        return len(dims) == len(self.min) and all(lo <= d <= hi for lo, d, hi in zip(self.min, dims, self.max))

    def to_dict(self) -> dict[str, list[int]]:
        return {"min": list(self.min), "opt": list(self.opt), "max": list(self.max)}

    @classmethod
    def from_dict(cls, obj: Any, where: str) -> "ShapeRange":
        if not isinstance(obj, dict):
            raise ManifestError(f"manifest field '{where}' must be an object with min, opt and max")
        refuse_unknown(obj, ("min", "opt", "max"), where)
        dims = {}
        for key in ("min", "opt", "max"):
            value = read_field(obj, key, where, list)
            if any(isinstance(d, bool) or not isinstance(d, int) for d in value):
                raise ManifestError(f"manifest field '{where}.{key}' must be a list of integers")
            dims[key] = tuple(check_type(d, f"{where}.{key}", int) for d in value)
        try:
            return cls(**dims)
        except InvalidParameterError as exc:
            raise ManifestError(f"manifest field '{where}': {exc}") from None


@dataclass(frozen=True)
class Profile:
    """One TensorRT optimization profile.

    ``shapes``: input name -> dims range for execution tensors (ids, positions, past K/V).
    ``values``: input name -> *values* range for shape tensors; ``num_logits_to_keep``
    feeds a Slice start, which TensorRT treats as a shape tensor read from host memory.
    """

    name: str
    shapes: dict[str, ShapeRange]
    values: dict[str, ShapeRange] = field(default_factory=dict)

    def new_tokens(self, io: "ModelIO") -> tuple[int, int]:
        r = self._shape(io.input_ids)
        return r.min[1], r.max[1]

    def past_length(self, io: "ModelIO") -> tuple[int, int]:
        r = self._shape(io.past_key % 0)
        return r.min[0], r.max[0]

    def _shape(self, name: str) -> ShapeRange:
        if name not in self.shapes:  # a record is manifest data: say which profile is incomplete
            raise ManifestError(f"TensorRT profile {self.name!r} has no shape range for {name!r}")
        return self.shapes[name]

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "shapes": {k: r.to_dict() for k, r in self.shapes.items()},
                "values": {k: r.to_dict() for k, r in self.values.items()}}

    @classmethod
    def from_dict(cls, obj: Any, where: str) -> "Profile":
        if not isinstance(obj, dict):
            raise ManifestError(f"manifest field '{where}' must be an object")
        refuse_unknown(obj, ("name", "shapes", "values"), where)
        shapes = read_field(obj, "shapes", where, dict)
        values = read_field(obj, "values", where, dict, optional=True, default={})
        return cls(name=read_field(obj, "name", where, str),
                   shapes={k: ShapeRange.from_dict(v, f"{where}.shapes.{k}") for k, v in shapes.items()},
                   values={k: ShapeRange.from_dict(v, f"{where}.values.{k}") for k, v in values.items()})


@dataclass(frozen=True)
class EngineRecord:
    """How one bundle model's TensorRT engine was built; manifest ``extra["engines"][role]``."""

    route: str  # one of ROUTES
    tensorrt_version: str  # "10.3.0"; "" when the builder could not tell (ort-trt without the tensorrt module)
    gpu_name: str  # e.g. "NVIDIA H200": engines are tuned for one device model
    compute_capability: str  # e.g. "9.0"
    precision: str  # one of TRT_PRECISIONS
    profiles: tuple[Profile, ...]
    file: str  # bundle-relative: the plan (native) or the TensorRT EP's cache folder (ort-trt)
    sha256: str  # of the plan, or of the EP's .engine file; "" when the EP wrote none we could identify
    cache_key: str
    provider_options: dict[str, str] = field(default_factory=dict)  # ort-trt: EP options, cache paths relative
    onnxruntime_version: str = ""  # ort-trt: the EP's cache layout follows ONNX Runtime's version
    # ort-trt: the bundle-relative .engine file the EP wrote, whose sha256 is ``sha256``
    # ("" in records written before it was recorded: then exactly one file must match the key).
    engine_file: str = ""
    # The graph the engine was built from, when not the model's own (the TensorRT rewrite; export/trt_graph.py).
    graph: str = ""

    KEYS = ("route", "tensorrt_version", "gpu_name", "compute_capability", "precision", "profiles", "file",
            "sha256", "cache_key", "provider_options", "onnxruntime_version", "engine_file", "graph")

    def __post_init__(self) -> None:
        if self.route not in ROUTES:
            raise InvalidParameterError(f"engine route must be one of {', '.join(ROUTES)}; got {self.route!r}")
        if self.precision not in TRT_PRECISIONS:
            raise InvalidParameterError(f"engine precision must be one of {', '.join(TRT_PRECISIONS)}; "
                                        f"got {self.precision!r}")
        if not self.profiles:
            raise InvalidParameterError("an engine record needs at least one optimization profile")

    def max_new_tokens(self, io: "ModelIO") -> int:
        """The largest n any profile accepts: longer forwards are split into chunks."""
        return max(p.new_tokens(io)[1] for p in self.profiles)

    def to_dict(self) -> dict[str, Any]:
        return {"route": self.route, "tensorrt_version": self.tensorrt_version, "gpu_name": self.gpu_name,
                "compute_capability": self.compute_capability, "precision": self.precision,
                "profiles": [p.to_dict() for p in self.profiles], "file": self.file, "sha256": self.sha256,
                "cache_key": self.cache_key, "provider_options": dict(self.provider_options),
                "onnxruntime_version": self.onnxruntime_version, "engine_file": self.engine_file,
                "graph": self.graph}

    @classmethod
    def from_dict(cls, obj: Any, where: str = "extra.engines") -> "EngineRecord":
        """Validate a decoded record; raises ManifestError naming the bad field."""
        if not isinstance(obj, dict):
            raise ManifestError(f"manifest field '{where}' must be an object")
        refuse_unknown(obj, cls.KEYS, where)
        text = {k: read_field(obj, k, where, str) for k in ("route", "tensorrt_version", "gpu_name",
                                                            "compute_capability", "precision", "sha256",
                                                            "cache_key")}
        options = read_field(obj, "provider_options", where, dict, optional=True, default={})
        if any(not isinstance(v, str) for v in options.values()):
            raise ManifestError(f"manifest field '{where}.provider_options' must map names to strings")
        profiles = read_field(obj, "profiles", where, list)
        try:
            return cls(**text, file=relpath(read_field(obj, "file", where, str), f"{where}.file"),
                       profiles=tuple(Profile.from_dict(p, f"{where}.profiles[{i}]") for i, p in enumerate(profiles)),
                       provider_options=dict(options),
                       onnxruntime_version=read_field(obj, "onnxruntime_version", where, str, optional=True,
                                                      default=""),
                       engine_file=optional_relpath(obj, "engine_file", where),
                       graph=optional_relpath(obj, "graph", where))
        except InvalidParameterError as exc:
            raise ManifestError(f"manifest field '{where}': {exc}") from None


# --------------------------------------------------------------------------- the whole of extra


@dataclass(frozen=True)
class ManifestExtra:
    """Everything a manifest's ``extra`` may hold (see the module docstring for who writes what).

    Empty maps and None are "not recorded"; :meth:`to_dict` leaves them out.
    """

    validation: dict[str, ValidationRecord | ComparisonRecord] = field(default_factory=dict)
    # role -> max |verify - step| logit difference (among each row's top tokens: export/validate.py)
    batch_variance: dict[str, float] = field(default_factory=dict)
    exact_steps: dict[str, ExactSteps] = field(default_factory=dict)
    context_warnings: dict[str, str] = field(default_factory=dict)
    unknown_config_fields: dict[str, tuple[str, ...]] = field(default_factory=dict)
    export_seconds: float | None = None
    cost_profile: CostProfile | None = None
    engines: dict[str, EngineRecord] = field(default_factory=dict)
    quant_tuning: dict[str, QuantTuning] = field(default_factory=dict)
    gguf_import: dict[str, dict[str, KeptTensor]] = field(default_factory=dict)  # role -> graph weight -> record
    quality: QualityRecord | None = None
    quantization: dict[str, QuantMix] = field(default_factory=dict)  # role -> per-tensor forms (float sources)

    KEYS = ("validation", "batch_variance", "exact_steps", "context_warnings", "unknown_config_fields",
            "export_seconds", "cost_profile", "engines", "quant_tuning", "gguf_import", "quality", "quantization")

    def target_batch_variance(self) -> float | None:
        """The target's measured batch variance (the near-tie gap's basis), None when not recorded."""
        return self.batch_variance.get("target")

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.validation:
            out["validation"] = {k: r.to_dict() for k, r in self.validation.items()}
        if self.batch_variance:
            out["batch_variance"] = dict(self.batch_variance)
        if self.exact_steps:
            out["exact_steps"] = {k: r.to_dict() for k, r in self.exact_steps.items()}
        if self.context_warnings:
            out["context_warnings"] = dict(self.context_warnings)
        if self.unknown_config_fields:
            out["unknown_config_fields"] = {k: list(v) for k, v in self.unknown_config_fields.items()}
        if self.export_seconds is not None:
            out["export_seconds"] = self.export_seconds
        if self.cost_profile is not None:
            out["cost_profile"] = self.cost_profile.to_dict()
        if self.engines:
            out["engines"] = {role: r.to_dict() for role, r in self.engines.items()}
        if self.quant_tuning:
            out["quant_tuning"] = {role: r.to_dict() for role, r in self.quant_tuning.items()}
        if self.gguf_import:
            out["gguf_import"] = {role: {k: r.to_dict() for k, r in kept.items()}
                                  for role, kept in self.gguf_import.items()}
        if self.quality is not None:
            out["quality"] = self.quality.to_dict()
        if self.quantization:
            out["quantization"] = {role: r.to_dict() for role, r in self.quantization.items()}
        return out

    @classmethod
    def from_dict(cls, obj: Any, where: str = "extra") -> "ManifestExtra":
        check_type(obj, where, dict)
        refuse_unknown(obj, cls.KEYS, where)

        def sub(key: str) -> Any:
            """The value at ``key``; absent or null is an empty map (a scalar key reads null itself)."""
            value = obj.get(key)
            return {} if value is None else value

        validation = check_type(sub("validation"), f"{where}.validation", dict)
        variance = sub("batch_variance")
        if not isinstance(variance, dict):
            raise ManifestError(f"manifest field '{where}.batch_variance' must be an object of role -> number, "
                                f"got {show(variance)}")
        variance = _role_map(variance, f"{where}.batch_variance")
        exact = _role_map(sub("exact_steps"), f"{where}.exact_steps")
        warnings = _role_map(string_map(sub("context_warnings"), f"{where}.context_warnings"),
                             f"{where}.context_warnings")
        unknown = _role_map(sub("unknown_config_fields"), f"{where}.unknown_config_fields")
        for role, names in unknown.items():
            check_type(names, f"{where}.unknown_config_fields.{role}", list)
            for i, name in enumerate(names):
                check_type(name, f"{where}.unknown_config_fields.{role}[{i}]", str)
        seconds = read_field(obj, "export_seconds", where, (int, float), optional=True)
        engines = _role_map(sub("engines"), f"{where}.engines")
        tuning = _role_map(sub("quant_tuning"), f"{where}.quant_tuning")
        profile = obj.get("cost_profile")
        kept = _role_map(sub("gguf_import"), f"{where}.gguf_import")
        quality = obj.get("quality")
        quantization = _role_map(sub("quantization"), f"{where}.quantization")
        return cls(
            validation={str(k): _validation_entry(v, f"{where}.validation.{k}") for k, v in validation.items()},
            batch_variance={role: finite(v, f"{where}.batch_variance.{role}") for role, v in variance.items()},
            exact_steps={role: ExactSteps.from_dict(v, f"{where}.exact_steps.{role}") for role, v in exact.items()},
            context_warnings=dict(warnings),
            unknown_config_fields={role: tuple(names) for role, names in unknown.items()},
            export_seconds=finite(seconds, f"{where}.export_seconds") if seconds is not None else None,
            cost_profile=CostProfile.from_dict(profile, f"{where}.cost_profile") if profile is not None else None,
            engines={role: EngineRecord.from_dict(v, f"{where}.engines.{role}") for role, v in engines.items()},
            quant_tuning={role: QuantTuning.from_dict(v, f"{where}.quant_tuning.{role}") for role, v in tuning.items()},
            gguf_import={role: {str(k): KeptTensor.from_dict(r, f"{where}.gguf_import.{role}.{k}")
                                for k, r in check_type(v, f"{where}.gguf_import.{role}", dict).items()}
                         for role, v in kept.items()},
            quality=QualityRecord.from_dict(quality, f"{where}.quality") if quality is not None else None,
            quantization={role: QuantMix.from_dict(v, f"{where}.quantization.{role}")
                          for role, v in quantization.items()},
        )
