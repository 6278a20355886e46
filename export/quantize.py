"""Weight-only quantization to MatMulNBits with ONNX Runtime's own quantizer routines."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from ..errors import InvalidParameterError

if TYPE_CHECKING:
    from .mixquant import Plan, TensorQuant


@dataclass(frozen=True)
class QuantConfig:
    bits: int = 4  # 4 or 8
    block_size: int = 32  # weights sharing one scale; 32 keeps int4 greedy agreement high on small models
    symmetric: bool = True  # symmetric blocks need no zero points: less to read per block
    # 4 = int8 activations in the int4 GEMM (fastest 1-token step on AVX2/AVX512-VNNI);
    # 1 = fp32 compute (flatter multi-token verify cost, slower single step).
    accuracy_level: int = 4
    # Also quantize the embedding table (Gather -> GatherBlockQuantized): a 151936 x 1536 fp32
    # table is 0.9 GB, more than the rest of an int4 1.5B model. A lookup reads n rows, so
    # this saves memory and disk, not step time.
    quantize_embeddings: bool = True

    def __post_init__(self) -> None:
        if self.bits not in (4, 8):
            raise InvalidParameterError(f"bits must be 4 or 8; got {self.bits}")
        if self.block_size < 16 or self.block_size & (self.block_size - 1):
            raise InvalidParameterError(f"block_size must be a power of two >= 16; got {self.block_size}")
        if self.accuracy_level not in (0, 1, 2, 3, 4):
            raise InvalidParameterError(f"accuracy_level must be 0..4; got {self.accuracy_level}")


def quantize_graph(src: Path, dst: Path, config: QuantConfig = QuantConfig(), *, plan: "Plan | None" = None,
                   chosen: "dict[str, tuple[TensorQuant, int, str]] | None" = None, tied: bool = False,
                   importance: "dict | None" = None,
                   progress: "Callable[[int, int], None] | None" = None) -> list[Path]:
    """Rewrite every MatMul with a constant weight in ``src`` as MatMulNBits; write ``dst`` (+ .data).

    ONNX Runtime's quantizer rewrite, one weight at a time (export/rtn.py): the same graph as
    ``MatMulNBitsQuantizer`` over the loaded model, in about one fp32 weight of memory. With
    ``plan`` (export/mixquant.py ``make_plan``), each weight takes its own form instead of
    ``config``'s bits, block and symmetry. ``chosen`` receives weight name -> (form, element count, the
    weight whose integers it reads or "") either way; ``tied``: the source's output layer is its embedding
    (a plan then writes their integers once); ``importance``: weight name -> activation importance for the
    plan's weighted forms (export/importance.py); ``progress(done, total)`` is told after each weight
    (export/progress.py ``Eta``).
    """
    from .rtn import quantize_streaming

    # ORT quantizes Gather to 4 bits only; 8-bit bundles keep fp32 embeddings (a plan may quantize them).
    return quantize_streaming(src, dst, bits=config.bits, block_size=config.block_size, symmetric=config.symmetric,
                              accuracy_level=config.accuracy_level, quantize_embeddings=config.quantize_embeddings,
                              plan=plan, chosen=chosen, tied=tied, importance=importance, progress=progress)
