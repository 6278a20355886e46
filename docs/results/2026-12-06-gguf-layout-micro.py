"""1-row MatMulNBits forms on Qwen2.5-1.5B shapes, 2 threads, interleaved (2026-12-06, #37): what each GGUF-kept layout costs.

    python docs/results/2026-12-06-gguf-layout-micro.py [REPS]

Random weights (the kernel time does not depend on values); "+off" is the fp32 offset path
(Reshape, ReduceSum over blocks of 32, MatMul [1, K/32] @ [K/32, N], Add); "uint zp" passes uint8 zero points.
"""
import time, sys, numpy as np, onnx, onnxruntime as ort
from onnx import helper, numpy_helper, TensorProto
rng = np.random.default_rng(0)
REPS = int(sys.argv[1]) if len(sys.argv) > 1 else 200

def mnb(x, name, K, N, bits, block, offsets=False, zp=False, nodes=None, inits=None, out=None):
    nb = K // block
    q = rng.integers(0, 256, size=(N, nb, block * bits // 8), dtype=np.uint8)
    s = rng.random((N, nb), dtype=np.float32) * 0.01
    inits += [numpy_helper.from_array(q, name + "_q"), numpy_helper.from_array(s, name + "_s")]
    ins = [x, name + "_q", name + "_s"]
    if zp:
        z = rng.integers(0, 256, size=(N, (nb * bits + 7) // 8), dtype=np.uint8)
        inits.append(numpy_helper.from_array(z, name + "_z")); ins.append(name + "_z")
    main = out if not offsets else name + "_main"
    nodes.append(helper.make_node("MatMulNBits", ins, [main], domain="com.microsoft", K=K, N=N, bits=bits,
                                  block_size=block, accuracy_level=4))
    if offsets:
        nbo = K // 32  # offsets per block of 32 (the old export's widened q|k|v wrote K/16 rows: it understates that row)
        inits += [numpy_helper.from_array(np.array([-1, nbo, 32], np.int64), name + "_shape"),
                  numpy_helper.from_array(np.array([-1], np.int64), name + "_axes"),
                  numpy_helper.from_array(rng.random((nbo, N), dtype=np.float32), name + "_off")]
        nodes += [helper.make_node("Reshape", [x, name + "_shape"], [name + "_xb"]),
                  helper.make_node("ReduceSum", [name + "_xb", name + "_axes"], [name + "_xs"], keepdims=0),
                  helper.make_node("MatMul", [name + "_xs", name + "_off"], [name + "_o"]),
                  helper.make_node("Add", [main, name + "_o"], [out])]
    return out

def model(build, K):
    nodes, inits = [], []
    build(nodes, inits)
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, K])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    so = ort.SessionOptions(); so.intra_op_num_threads = 2
    return ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])

def concat_parts(parts):
    def build(nodes, inits):
        outs = []
        for i, (K, N, bits, block, off, zp) in enumerate(parts):
            outs.append(mnb("x", f"p{i}", K, N, bits, block, off, zp, nodes, inits, out=f"y{i}"))
        if len(outs) == 1:
            nodes.append(helper.make_node("Identity", outs, ["y"]))
        else:
            nodes.append(helper.make_node("Concat", outs, ["y"], axis=-1))
    return build

H, I = 1536, 8960
variants = {
  "qkv fused 8b/16 +off (today, Q6_K v)": (H, [(H, 2048, 8, 16, True, False)]),
  "qkv fused 8b/16 +off@32": (H, [(H, 2048, 8, 16, True, False)]),
  "q|k 4b/32 +off, v 8b/16, concat": (H, [(H, 1792, 4, 32, True, False), (H, 256, 8, 16, False, False)]),
  "q|k 4b/32 uint zp, v 8b/16, concat": (H, [(H, 1792, 4, 32, False, True), (H, 256, 8, 16, False, False)]),
  "qkv fused 4b/32 +off (all Q4_K)": (H, [(H, 2048, 4, 32, True, False)]),
  "qkv fused 4b/32 no off (RTN)": (H, [(H, 2048, 4, 32, False, False)]),
  "qkv fused 4b/32 uint zp": (H, [(H, 2048, 4, 32, False, True)]),
  "gate_up 4b/32 +off": (H, [(H, 2 * I, 4, 32, True, False)]),
  "gate_up 4b/32 no off": (H, [(H, 2 * I, 4, 32, False, False)]),
  "gate_up 4b/32 uint zp": (H, [(H, 2 * I, 4, 32, False, True)]),
  "down 4b/32 +off": (I, [(I, H, 4, 32, True, False)]),
  "down 4b/32 no off": (I, [(I, H, 4, 32, False, False)]),
  "down 8b/16 (Q6_K)": (I, [(I, H, 8, 16, False, False)]),
  "o 4b/32 +off": (H, [(H, H, 4, 32, True, False)]),
  "o 4b/32 no off": (H, [(H, H, 4, 32, False, False)]),
}
sess = {k: (model(concat_parts(p), K), K) for k, (K, p) in variants.items()}
times = {k: [] for k in sess}
xs = {K: rng.standard_normal((1, K), dtype=np.float32) for K in (H, I)}
for k, (s, K) in sess.items():
    for _ in range(10): s.run(None, {"x": xs[K]})
for r in range(REPS):
    for k, (s, K) in sess.items():
        t = time.perf_counter(); s.run(None, {"x": xs[K]}); times[k].append(time.perf_counter() - t)
for k, v in times.items():
    print(f"{k:45s} median {np.median(v)*1e6:8.1f} us  p25 {np.percentile(v,25)*1e6:8.1f}")
