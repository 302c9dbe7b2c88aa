"""Feed-forward activations: numerics against PyTorch / Hugging Face, block
resolution of the HF names, serialization, and the export matrix (every
activation through SavedModel, TFLite builtins and ONNX)."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_attn import export as kx
from keras_attn.layers import TransformerDecoderBlock, TransformerEncoderBlock
from keras_attn.layers import activations
from tests import tolerance

torch = pytest.importorskip("torch")
hf_activations = pytest.importorskip("transformers.activations")

# Every name the blocks resolve specially, plus a few plain Keras ones.
MATRIX = [
    "relu",
    "gelu",
    "gelu_python",
    "gelu_tanh",
    "gelu_new",
    "gelu_pytorch_tanh",
    "gelu_fast",
    "gelu_accurate",
    "quick_gelu",
    "silu",
    "swish",
]
HF_NAMES = [n for n in MATRIX if n != "gelu_tanh"]
# An elementwise function (erf, tanh, exp inside) in float32: a few ulps of
# the largest value (tests/tolerance.py).
ELEMENTWISE_ULPS = 16
X = np.concatenate(
    [np.linspace(-12, 12, 2001), np.random.default_rng(0).standard_normal(500) * 3]
).astype("float32")


@pytest.mark.parametrize("name", HF_NAMES)
def test_matches_hugging_face_activation(name):
    want = hf_activations.ACT2FN[name](torch.from_numpy(X)).numpy()
    got = np.asarray(activations.get(name)(X))
    tolerance.assert_close(got, want, ulps=ELEMENTWISE_ULPS, err_msg=name)


def test_exact_gelu_matches_keras_and_torch_to_1e6():
    got = np.asarray(activations.gelu(X))
    tolerance.assert_close(got, np.asarray(keras.activations.gelu(X, approximate=False)), ulps=ELEMENTWISE_ULPS)
    want = torch.nn.functional.gelu(torch.from_numpy(X).double()).numpy()
    tolerance.assert_close(got, want, ulps=ELEMENTWISE_ULPS)


def test_tanh_gelu_matches_torch():
    got = np.asarray(activations.gelu_tanh(X))
    want = torch.nn.functional.gelu(torch.from_numpy(X).double(), approximate="tanh").numpy()
    tolerance.assert_close(got, want, ulps=ELEMENTWISE_ULPS)


def test_no_nan_in_low_precision():
    for fn in (activations.gelu, activations.gelu_tanh, activations.quick_gelu, activations.silu):
        for dtype in ("float16", "bfloat16"):
            y = np.asarray(keras.ops.cast(fn(keras.ops.cast(X, dtype)), "float32"))
            assert np.all(np.isfinite(y)), (fn.__name__, dtype)


def test_unknown_activation_names_the_argument():
    with pytest.raises(ValueError, match="activation.*gelu_newest"):
        TransformerEncoderBlock(num_heads=2, intermediate_dim=8, activation="gelu_newest")


def _ffn_reference(block, x, fn):
    dense_in = block.feedforward_intermediate_dense
    h = x @ np.asarray(dense_in.kernel) + np.asarray(dense_in.bias)
    return fn(h)


@pytest.mark.parametrize("name", ["gelu", "gelu_new", "quick_gelu", "silu"])
def test_block_resolves_hugging_face_names(name):
    x = np.random.default_rng(1).standard_normal((2, 3, 8)).astype("float32")
    block = TransformerEncoderBlock(num_heads=2, intermediate_dim=16, activation=name)
    block(x)
    got = np.asarray(block.feedforward_intermediate_dense(x))
    torch_fn = hf_activations.ACT2FN[name]
    dense_in = block.feedforward_intermediate_dense
    pre = x @ np.asarray(dense_in.kernel) + np.asarray(dense_in.bias)
    want = torch_fn(torch.from_numpy(pre)).numpy()
    tolerance.assert_close(got, want, terms=tolerance.LAYER_TERMS)


@pytest.mark.parametrize("activation", ["gelu_new", activations.quick_gelu, keras.activations.gelu])
def test_block_activation_serializes(activation, tmp_path):
    x = np.random.default_rng(2).standard_normal((2, 4, 8)).astype("float32")
    inputs = keras.Input((None, 8))
    block = TransformerDecoderBlock(num_heads=2, intermediate_dim=16, activation=activation)
    model = keras.Model(inputs, block(inputs))
    config = block.get_config()
    clone = TransformerDecoderBlock.from_config(config)
    assert clone.get_config() == config
    path = tmp_path / "m.keras"
    model.save(path)
    loaded = keras.saving.load_model(path)
    np.testing.assert_array_equal(np.asarray(loaded(x)), np.asarray(model(x)))


# ---------------------------------------------------------------------------
# Export matrix: one small model, one encoder block per activation.


def _run_artifacts(reports, feed):
    import onnxruntime as ort
    from ai_edge_litert.interpreter import Interpreter

    fn = tf.saved_model.load(reports["saved_model"].path).signatures["serving_default"]
    out = {"saved_model": {k: v.numpy() for k, v in fn(**{k: tf.constant(v) for k, v in feed.items()}).items()}}
    interpreter = Interpreter(model_path=reports["tflite"].path)
    details = {d["name"]: d for d in interpreter.get_input_details()}
    for name, value in feed.items():
        interpreter.resize_tensor_input(details[f"serving_default_{name}:0"]["index"], value.shape)
    interpreter.allocate_tensors()
    runner = interpreter.get_signature_runner("serving_default")
    out["tflite"] = runner(**feed)
    session = ort.InferenceSession(reports["onnx"].path, providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    out["onnx"] = dict(zip(names, session.run(names, feed)))
    return out


@pytest.fixture(scope="module")
def activation_matrix(tmp_path_factory):
    keras.utils.set_random_seed(3)
    x = keras.Input((None, 8), name="x")
    outputs = []
    for name in MATRIX + ["keras_gelu"]:
        act = keras.activations.gelu if name == "keras_gelu" else name
        block = TransformerEncoderBlock(
            num_heads=2,
            intermediate_dim=16,
            activation=act,
            kernel_initializer=keras.initializers.RandomNormal(stddev=1.0),
            name=f"block_{name}",
        )
        outputs.append(keras.layers.Identity(name=f"out_{name}")(block(x)))
    model = keras.Model(x, outputs)
    out = tmp_path_factory.mktemp("activation_matrix")
    reports = {
        "saved_model": kx.export_saved_model(model, out / "serving"),
        "tflite": kx.export_tflite(model, out / "m.tflite"),
        "onnx": kx.export_onnx(model, out / "m.onnx"),
    }
    return model, reports


def test_check_exportable_over_the_activation_matrix(activation_matrix):
    model, _ = activation_matrix
    report = kx.check_exportable(model)
    assert report.ok, str(report)
    assert "Erfc" not in report.tf_ops


def test_every_activation_exports_with_parity(activation_matrix):
    model, reports = activation_matrix
    assert not [op for op in reports["tflite"].ops if "FLEX" in op.upper() or op == "CUSTOM"]
    for batch, length in [(1, 3), (2, 6)]:
        feed = {"x": (np.random.default_rng(batch).standard_normal((batch, length, 8)) * 3).astype("float32")}
        want = dict(zip(model.output_names, (np.asarray(y) for y in model(feed["x"]))))
        for fmt, got in _run_artifacts(reports, feed).items():
            assert set(got) == set(want), fmt
            for name in want:
                err = np.max(np.abs(got[name] - want[name]))
                assert err <= 1e-4, f"{fmt} {name} ({batch}x{length}): {err}"


def test_dense_with_block_gelu_converts_to_onnx():
    """Keras' own exact GELU lowers to Erfc on TensorFlow, which tf2onnx cannot convert."""
    x = keras.Input((None, 8), name="x")
    ours = keras.Model(x, keras.layers.Dense(4, activation=activations.get("gelu"))(x))
    report = kx.check_exportable(ours, formats=("onnx",))
    assert report.ok, str(report)
    assert "Erfc" not in report.tf_ops and "Erf" in report.tf_ops
    # The TFLite converter fuses the erf form into its builtin GELU.
    from keras_attn.export import tflite as tflite_lib

    flatbuffer, _ = tflite_lib.convert(ours)
    assert "GELU" in tflite_lib.tflite_op_names(flatbuffer)
