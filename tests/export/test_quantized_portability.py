"""int8 answers that do not depend on the CPU's instruction set.

onnxruntime multiplies uint8 activations by int8 weights with VPMADDUBSW on
x86 CPUs with AVX2/AVX-512 and no VNNI: two products are added into a
saturating int16, so full-range int8 weights give other answers there than
on a CPU with VNNI, an SSE-only CPU or ARM. These tests check the exports
(ONNX int8 weights, TFLite dynamic-range int8) against a bound derived from
the quantization arithmetic:

- on the graph: no int8 weight can push a pair of products past int16;
- by running: the artifacts on adversarial inputs (weights at +-1, inputs
  aligned with them) natively and under `qemu-x86_64 -cpu Haswell-noTSX`,
  an AVX2 CPU without VNNI, whatever CPU runs the test (and an SSE4-only
  CPU for ONNX). A control with
  full-range int8 weights must break the bound there, which shows that the
  emulated CPU really ran the saturating kernels.
"""

import os
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")

from tests import tolerance  # noqa: E402
from tests.environments import child_env  # noqa: E402

K, N, M = 256, 48, 8
# An AVX2 CPU without VNNI, whatever this machine is (qemu's user-mode
# emulator; `.ci/run` installs it).
EMULATED_CPU = "Haswell-noTSX"
# SSE4.2 and no AVX: the kernels of older and low-power x86 CPUs.
SSE_ONLY_CPU = "Nehalem"


def _data():
    rng = np.random.default_rng(0)
    w = rng.choice([-1.0, 1.0], (K, N)) * rng.uniform(0.9, 1.0, (K, N))
    inputs = {
        # large positive activations: uint8 codes near 255 everywhere
        "positive": np.abs(rng.standard_normal((M, K))) * 3 + np.tile([5.0, 0.0], K // 2),
        # signs aligned with the first output column: every pair adds up
        "aligned": np.sign(w[:, 0])[None, :] * 5.0 * np.ones((M, K)),
        "random": rng.standard_normal((M, K)),
        # an encoder's first token: outliers 30 times the other rows'
        "first_token_outliers": rng.standard_normal((M, K)) * np.where(np.arange(M) == 0, 30.0, 1.0)[:, None],
    }
    return w.astype(np.float32), {k: v.astype(np.float32) for k, v in inputs.items()}


def _bound(x, w, weight_step, activation_step):
    """|quantized x @ w - x @ w| per output: each weight off by at most
    `weight_step[k, n] / 2` ((K, N), or (N,) for one step per column), each
    activation by at most `activation_step[m]` (a rounding plus the zero
    point's), and the result's float32 rounding."""
    ax, aw = np.abs(x.astype(np.float64)), np.abs(w.astype(np.float64))
    dw = np.broadcast_to(weight_step, w.shape) / 2
    da = activation_step[:, None]
    quantization = ax @ dw + da * aw.sum(0)[None, :] + da * dw.sum(0)[None, :]
    rounding = tolerance.bound(ax @ aw, ulps=8, terms=K)
    return quantization + rounding


def _matmul_proto(w):
    from onnx import TensorProto, helper, numpy_helper

    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])], "matmul",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, K])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, N])],
        [numpy_helper.from_array(w, "w")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _unsafe_int8(proto, path):
    """The scheme this project shipped before: full-range int8 weights."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    quantize_dynamic(proto, path, op_types_to_quantize=["MatMul"], per_channel=True,
                     weight_type=QuantType.QInt8, extra_options={"MatMulConstBOnly": True})


# Runs each artifact on each input and saves the outputs: numpy, onnxruntime
# and LiteRT only, so that it starts quickly under emulation.
RUNNER = textwrap.dedent("""
    import sys, numpy as np
    data = dict(np.load(sys.argv[1]))
    out = {}
    for path in sys.argv[3:]:
        for name, x in data.items():
            if path.endswith(".onnx"):
                import onnxruntime as ort
                s = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
                out[path + "|" + name] = s.run(None, {"x": x})[0]
            else:
                from ai_edge_litert.interpreter import Interpreter, OpResolverType
                for kind, kw in (("xnnpack", {}), ("builtin", {"experimental_op_resolver_type":
                                 OpResolverType.BUILTIN_WITHOUT_DEFAULT_DELEGATES})):
                    it = Interpreter(model_path=path, **kw)
                    index = it.get_input_details()[0]["index"]
                    it.resize_tensor_input(index, x.shape)
                    it.allocate_tensors()
                    it.set_tensor(index, x)
                    it.invoke()
                    out[path + "|" + kind + "|" + name] = it.get_tensor(it.get_output_details()[0]["index"])
    np.savez(sys.argv[2], **out)
""")


def _run(tmp_path, paths, data, cpu=None):
    script = tmp_path / "runner.py"
    script.write_text(RUNNER)
    np.savez(tmp_path / "inputs.npz", **data)
    out = tmp_path / f"outputs_{cpu or 'native'}.npz"
    cmd = [sys.executable, str(script), str(tmp_path / "inputs.npz"), str(out)] + [str(p) for p in paths]
    # On an emulated CPU, none of the host's CPU pinning (an OpenBLAS core
    # type of the host's, say): the libraries pick the emulated CPU's kernels.
    env = child_env(cpu=cpu)
    if cpu:
        # The venv's interpreter is a symlink qemu follows to the base
        # Python: the packages come through PYTHONPATH.
        import onnxruntime

        site = os.path.dirname(os.path.dirname(onnxruntime.__file__))
        env["PYTHONPATH"] = os.pathsep.join([site, env["PYTHONPATH"]])
        cmd = [shutil.which("qemu-x86_64"), "-cpu", cpu] + cmd
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return dict(np.load(out))


def _onnx_activation_step(x):
    # DynamicQuantizeLinear: one uint8 scale per tensor over [min(x, 0), max(x, 0)].
    step = (max(float(x.max()), 0.0) - min(float(x.min()), 0.0)) / 255
    return np.full(len(x), step)


def _first_token_apart_step(x):
    # `quantize_matmul_weights`: row 0 (the first token) with its own scale,
    # the other rows with theirs.
    return np.concatenate([_onnx_activation_step(x[:1]), _onnx_activation_step(x[1:])])


@pytest.fixture(scope="module")
def onnx_artifacts(tmp_path_factory):
    from keras_attn.export.onnx_quantize import matmul_nbits, quantize_matmul_weights

    tmp = tmp_path_factory.mktemp("int8_onnx")
    w, data = _data()
    proto = _matmul_proto(w)
    onnx.save(quantize_matmul_weights(proto), tmp / "ours.onnx")
    _unsafe_int8(proto, str(tmp / "unsafe.onnx"))
    for bits in (8, 4):
        onnx.save(matmul_nbits(_matmul_proto(w), bits=bits, block_size=BLOCK), tmp / f"nbits{bits}.onnx")
    return tmp, w, data


BLOCK = 32


def _per_column_step(w, bits):
    return np.abs(w).max(0) / (2 ** (bits - 1) - 1)


def _per_block_step(w, bits):
    """MatMulNBits: one symmetric scale per block of BLOCK inputs and column."""
    blocks = np.abs(w).reshape(K // BLOCK, BLOCK, N).max(1) / (2 ** (bits - 1) - 1)
    return np.repeat(blocks, BLOCK, axis=0)


def _nbits_activation_step(x):
    # accuracy_level 4: int8 activations, symmetric per block (at most
    # max |x| of the row / 127), or float32 on CPUs without int8 kernels.
    return 2 * np.abs(x).max(1) / 127


# artifact -> (weight step, activation step)
SCHEMES = {
    "ours.onnx": (lambda w: _per_column_step(w, 7), _first_token_apart_step),
    "unsafe.onnx": (lambda w: _per_column_step(w, 8), _onnx_activation_step),
    "nbits8.onnx": (lambda w: _per_block_step(w, 8), _nbits_activation_step),
    "nbits4.onnx": (lambda w: _per_block_step(w, 4), _nbits_activation_step),
}


def _errors_over_bound(outputs, path, w, data):
    ratios = {}
    weight_step, activation_step = SCHEMES[path.name]
    for name, x in data.items():
        y = outputs[f"{path}|{name}"].astype(np.float64)
        err = np.abs(y - x.astype(np.float64) @ w.astype(np.float64))
        ratios[name] = float((err / _bound(x, w, weight_step(w), activation_step(x))).max())
    return ratios


def test_onnx_int8_weights_cannot_saturate_int16_pair_sums(onnx_artifacts):
    """The rule, on the graph: two uint8 x int8 products fit an int16."""
    from onnx import TensorProto, numpy_helper

    tmp, _, _ = onnx_artifacts
    for name, safe in (("ours.onnx", True), ("unsafe.onnx", False)):
        proto = onnx.load(str(tmp / name))
        weights = {t.name: t for t in proto.graph.initializer}
        pair_sums = []
        for node in proto.graph.node:
            if node.op_type in ("MatMulInteger", "DynamicQuantizeMatMul"):
                t = weights[node.input[1]]
                assert t.data_type == TensorProto.INT8
                q = np.abs(numpy_helper.to_array(t).astype(np.int64))
                pair_sums.append(int((255 * (q[0::2] + q[1::2])).max()))
        assert pair_sums, f"{name}: no integer matmul"
        assert (max(pair_sums) <= 32767) == safe, (name, pair_sums)


def _ffn_proto(activation, gated=False):
    """x @ w1, an activation in ONNX arithmetic, @ w2: a feed-forward block;
    `gated`: the activation times x @ w3 (GeGLU, SwiGLU) before w2."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(1)
    w1 = rng.standard_normal((K, 2 * N)).astype(np.float32)
    w2 = rng.standard_normal((2 * N, N)).astype(np.float32)
    consts = [numpy_helper.from_array(np.array(v, np.float32), n)
              for n, v in (("half", 0.5), ("one", 1.0), ("root2", np.sqrt(2.0)))]
    if activation == "gelu":  # x * 0.5 * (1 + erf(x / sqrt 2)), as the direct writer writes it
        nodes = [helper.make_node("Div", ["h", "root2"], ["d"]), helper.make_node("Erf", ["d"], ["e"]),
                 helper.make_node("Add", ["e", "one"], ["e1"]), helper.make_node("Mul", ["h", "half"], ["hh"]),
                 helper.make_node("Mul", ["hh", "e1"], ["a"])]
    else:  # silu: x * sigmoid(x)
        nodes = [helper.make_node("Sigmoid", ["h"], ["s"]), helper.make_node("Mul", ["h", "s"], ["a"])]
    if gated:
        w3 = rng.standard_normal((K, 2 * N)).astype(np.float32)
        consts.append(numpy_helper.from_array(w3, "w3"))
        nodes[-1].output[0] = "g"
        nodes += [helper.make_node("MatMul", ["x", "w3"], ["u"], name="gate_up"),
                  helper.make_node("Mul", ["g", "u"], ["a"])]
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w1"], ["h"], name="up"), *nodes,
         helper.make_node("MatMul", ["a", "w2"], ["y"], name="down")], "ffn",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, None, K])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, None, N])],
        [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(w2, "w2"), *consts])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), w1, w2


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("activation", ["gelu", "silu"])
def test_onnx_int8_float_after_activation(activation, gated):
    """`float_after_activation=True`: the MatMul reading the activation's
    output (times the up projection's, gated) keeps its float32 weight, the
    others' become int8, each first token's row quantized apart. By default
    all are int8."""
    import onnxruntime as ort
    from onnx import numpy_helper

    from keras_attn.export.onnx_quantize import quantize_matmul_weights

    proto, _, w2 = _ffn_proto(activation, gated)
    quantized = quantize_matmul_weights(proto, float_after_activation=True)
    ops = [node.op_type for node in quantized.graph.node]
    # first token and the rest, of each projection before the activation
    assert ops.count("MatMulInteger") + ops.count("DynamicQuantizeMatMul") == (4 if gated else 2)
    (down,) = [node for node in quantized.graph.node if node.op_type == "MatMul"]
    weights = {t.name: numpy_helper.to_array(t) for t in quantized.graph.initializer}
    np.testing.assert_array_equal(weights[down.input[1]], w2)
    default = quantize_matmul_weights(proto)
    assert [node.op_type for node in default.graph.node].count("MatMul") == 0
    # One token: the rows after the first are empty, which onnxruntime runs.
    x = np.random.default_rng(2).standard_normal((2, 1, K)).astype(np.float32)
    y = ort.InferenceSession(default.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    assert y.shape == (2, 1, N) and np.isfinite(y).all()
    with pytest.raises(TypeError, match="first_token_apart"):
        quantize_matmul_weights(proto, first_token_apart="yes")


SAFE = ("ours.onnx", "nbits8.onnx", "nbits4.onnx")


def test_onnx_integer_matmuls_within_the_quantization_bound_natively(onnx_artifacts, tmp_path):
    tmp, w, data = onnx_artifacts
    outputs = _run(tmp_path, [tmp / name for name in SAFE], data)
    for name in SAFE:
        ratios = _errors_over_bound(outputs, tmp / name, w, data)
        assert max(ratios.values()) <= 1.0, (name, ratios)


def _qemu():
    if shutil.which("qemu-x86_64") is None:
        pytest.skip("qemu-x86_64 is not installed (apt-get install qemu-user; .ci/run installs it)")
    import platform

    if platform.machine() != "x86_64":
        pytest.skip(f"the emulated CPU is x86_64; this machine is {platform.machine()}")


# What a host may set for its own CPU (an AVX2 one here): OpenBLAS's core
# type and cache size, and NumPy's SIMD features, which NumPy refuses to start
# with on a CPU that lacks them.
HOST_PINNING = {"OPENBLAS_CORETYPE": "Haswell", "OPENBLAS_L2_SIZE": "512",
                "NPY_ENABLE_CPU_FEATURES": "X86_V3"}  # NumPy 2.4: AVX2, FMA3, BMI2, ...


@pytest.mark.slow
@pytest.mark.parametrize("host", ["as_is", "pinned_to_haswell"])
@pytest.mark.parametrize("cpu", [EMULATED_CPU, SSE_ONLY_CPU])
def test_onnx_integer_matmuls_same_on_other_instruction_sets(onnx_artifacts, tmp_path, cpu, host,
                                                             monkeypatch):
    """Under an emulated AVX2 CPU without VNNI, and an SSE4-only one, our
    weights stay within the bound. On the AVX2 one full-range int8 weights
    (the control) break it: the emulated CPU ran the saturating kernels,
    whatever CPU runs this test. The same when the host pins its libraries
    to an AVX2 CPU: the emulated run must not inherit that."""
    _qemu()
    if host == "pinned_to_haswell":
        for name, value in HOST_PINNING.items():
            monkeypatch.setenv(name, value)
    tmp, w, data = onnx_artifacts
    outputs = _run(tmp_path, [tmp / name for name in SAFE + ("unsafe.onnx",)], data, cpu=cpu)
    for name in SAFE:
        ratios = _errors_over_bound(outputs, tmp / name, w, data)
        assert max(ratios.values()) <= 1.0, (name, ratios)
    if cpu != EMULATED_CPU:
        return
    control = _errors_over_bound(outputs, tmp / "unsafe.onnx", w, data)
    assert control["aligned"] > 4.0, (
        f"full-range int8 weights stayed within the bound on the emulated {EMULATED_CPU} "
        f"({control}): the emulation did not reach onnxruntime's AVX2 kernels, so this test "
        "would not see saturation either")


@pytest.fixture(scope="module")
def tflite_artifact(tmp_path_factory):
    """A Dense layer exported by `export_tflite(quantization="dynamic")`:
    int8 weights per channel, activations quantized per row at run time."""
    keras = pytest.importorskip("keras")
    pytest.importorskip("ai_edge_litert")
    from keras_attn.export import export_tflite

    w, data = _data()
    inputs = keras.Input((K,), name="x")
    dense = keras.layers.Dense(N, use_bias=False, name="dense")
    model = keras.Model(inputs, dense(inputs))
    dense.set_weights([w])
    tmp = tmp_path_factory.mktemp("int8_tflite")
    path = tmp / "dense_dynamic.tflite"
    export_tflite(model, str(path), quantization="dynamic", sample_inputs={"x": data["random"]})
    return path, w, data


def _tflite_errors_over_bound(outputs, path, w, data):
    ratios = {}
    weight_step = np.abs(w).max(0) / 127
    for key, y in outputs.items():
        _, kind, name = key.split("|")
        x = data[name]
        # Asymmetric int8 per row over [min(x, 0), max(x, 0)].
        activation_step = (np.maximum(x.max(1), 0) - np.minimum(x.min(1), 0)) / 255
        err = np.abs(y.astype(np.float64) - x.astype(np.float64) @ w.astype(np.float64))
        ratios[f"{kind}|{name}"] = float((err / _bound(x, w, weight_step, activation_step)).max())
    return ratios


@pytest.mark.slow
@pytest.mark.parametrize("cpu", [None, EMULATED_CPU], ids=["native", "avx2_without_vnni"])
def test_tflite_dynamic_int8_within_the_quantization_bound(tflite_artifact, tmp_path, cpu):
    """LiteRT's hybrid int8 kernels (XNNPACK and the builtin ones) add in
    int32: within the bound natively and on an AVX2 CPU without VNNI."""
    if cpu:
        _qemu()
    path, w, data = tflite_artifact
    outputs = _run(tmp_path, [path], data, cpu=cpu)
    ratios = _tflite_errors_over_bound(outputs, path, w, data)
    assert len(ratios) == 2 * len(data)
    assert max(ratios.values()) <= 1.0, ratios
