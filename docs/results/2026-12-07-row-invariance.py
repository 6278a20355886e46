"""Which MatMulNBits layouts compute a row the same whatever the row count (2026-12-07, issue #36).

    python docs/results/2026-12-07-row-invariance.py K N

One MatMulNBits node of K inputs and N outputs (random integers and scales, 2 threads, accuracy_level 4) for
bits 4 and 8 and blocks 32..256. Exact mode pads a plain step to 2 rows (engines/invariant.py), so the
question is whether each row of an M-row verify equals that row computed in a 2-row batch; the script
prints the verify lengths M (3..9) where some row differs. docs/results/2026-12-07-wide-int8-blocks.md has
what ONNX Runtime 1.32.0 answered on the machines measured.
"""
import sys

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

K, N = int(sys.argv[1]), int(sys.argv[2])


def build(bits: int, block: int) -> bytes:
    n_blocks = -(-K // block)
    rng = np.random.default_rng(0)
    weights = rng.integers(0, 255, size=(N, n_blocks, block * bits // 8), dtype=np.uint8)
    scales = rng.random((N * n_blocks,), dtype=np.float32) * 0.01 + 0.001
    node = helper.make_node("MatMulNBits", ["A", "W", "S"], ["Y"], domain="com.microsoft", K=K, N=N, bits=bits,
                            block_size=block, accuracy_level=4)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("A", TensorProto.FLOAT, ["M", K])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["M", N])],
                              [numpy_helper.from_array(weights, "W"), numpy_helper.from_array(scales, "S")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                   helper.make_opsetid("com.microsoft", 1)]).SerializeToString()


options = ort.SessionOptions()
options.intra_op_num_threads = 2
a = np.random.default_rng(1).standard_normal((9, K)).astype(np.float32)
for bits in (4, 8):
    for block in (32, 64, 128, 256):
        session = ort.InferenceSession(build(bits, block), options, providers=["CPUExecutionProvider"])
        two_row = np.stack([session.run(None, {"A": np.stack([row, row])})[0][0] for row in a])
        differ = [m for m in range(3, 10) if not np.array_equal(session.run(None, {"A": a[:m]})[0], two_row[:m])]
        print(f"bits {bits} block {block}: verify lengths whose rows differ from 2-row steps: {differ or 'none'}")
