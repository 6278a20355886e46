"""Weight-only quantization to MatMulNBits through ONNX Runtime's own quantizer."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from ..errors import InvalidParameterError


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


def quantize_graph(src: Path, dst: Path, config: QuantConfig = QuantConfig()) -> list[Path]:
    """Rewrite every MatMul with a constant weight in ``src`` as MatMulNBits; write ``dst`` (+ .data)."""
    import onnx
    from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantConfig, MatMulNBitsQuantizer

    # The quantizer logs one INFO line per node; users need the result, not the trace.
    logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer").setLevel(logging.ERROR)
    model = onnx.load(str(src))  # loads external data alongside
    # ORT quantizes Gather to 4 bits only; 8-bit bundles keep fp32 embeddings.
    ops = ("MatMul", "Gather") if config.quantize_embeddings and config.bits == 4 else ("MatMul",)
    axes = (("MatMul", 0), ("Gather", 1))  # quantize along the reduction axis / the hidden axis
    algo = DefaultWeightOnlyQuantConfig(block_size=config.block_size, is_symmetric=config.symmetric,
                                        accuracy_level=config.accuracy_level, bits=config.bits,
                                        op_types_to_quantize=ops, quant_axes=axes)
    quantizer = MatMulNBitsQuantizer(model, bits=config.bits, block_size=config.block_size,
                                     is_symmetric=config.symmetric, accuracy_level=config.accuracy_level,
                                     algo_config=algo, op_types_to_quantize=ops, quant_axes=axes)
    quantizer.process()
    data = dst.with_name(dst.name + ".data")
    onnx.save_model(quantizer.model.model, str(dst), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=data.name, size_threshold=1024)
    return [dst] + ([data] if data.exists() else [])
