"""Export parity for every public layer: SavedModel, TFLite (float, dynamic), ONNX.

One functional model holds every model of `tests/model_zoo.py` (one per public
layer, plus the example architectures) as named outputs, so each format is
converted once. Every artifact is then run here, independently of the
exporters' own verification, at two batch sizes and two sequence lengths and
compared output by output (i.e. layer by layer) with the Keras model.
"""

import os

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_attn import export as kx
from keras_attn.export.samples import make_samples
from tests import model_zoo, tolerance

SHAPES = [(1, 5), (3, 9)]  # (batch, length): two batch sizes, two lengths
FLOAT_ATOL = 1e-4


def build_zoo_model():
    inputs, outputs = {}, []
    for name, build in model_zoo.ALL.items():
        sub = build()
        args = []
        for inp in sub.inputs:
            if inp.name not in inputs:
                inputs[inp.name] = keras.Input(inp.shape[1:], dtype=inp.dtype, name=inp.name)
            args.append(inputs[inp.name])
        ys = keras.tree.flatten(sub(args if len(args) > 1 else args[0]))
        for i, y in enumerate(ys):
            key = f"out_{name}" if len(ys) == 1 else f"out_{name}_{i}"
            outputs.append(keras.layers.Identity(name=key)(y))
    return keras.Model(list(inputs.values()), outputs, name="zoo")


def make_inputs(model, batch, length, seed=0):
    """Key/value-side inputs are 2 longer than the query side (T_q != T_kv)."""
    rng = np.random.default_rng(seed)
    out = {}
    for inp in model.inputs:
        t = length + 2 if inp.name in ("value", "memory", "encoder_tokens") else length
        if "int" in str(inp.dtype):
            x = rng.integers(1, model_zoo.VOCAB, size=(batch, t)).astype("int32")
            x[0, t - 2 :] = 0  # padding
            out[inp.name] = x
        else:
            out[inp.name] = rng.standard_normal((batch, t, inp.shape[-1])).astype("float32")
    return out


def keras_run(model, feed):
    ys = model([feed[i.name] for i in model.inputs], training=False)
    return {n: np.asarray(y) for n, y in zip(model.output_names, ys)}


# An exported graph against Keras: the same float32 math, fused and ordered by
# a converter; a few layers of sums over the feature sizes (tests/tolerance.py).
EXPORT_TERMS = 256


def assert_close(got, want, where):
    assert set(got) == set(want), where
    for name in want:
        tolerance.assert_close(got[name], want[name], terms=EXPORT_TERMS, err_msg=f"{where}: {name}")


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    keras.utils.set_random_seed(7)
    model = build_zoo_model()
    out = tmp_path_factory.mktemp("zoo_export")
    reports = {
        "saved_model": kx.export_saved_model(model, out / "serving", version=3),
        "tflite": kx.export_tflite(model, out / "zoo.tflite"),
        "onnx": kx.export_onnx(model, out / "zoo.onnx", opset=17),
    }
    for report in reports.values():
        print(report)
    return model, reports


def test_reports_describe_the_artifacts(zoo):
    model, reports = zoo
    sm = reports["saved_model"]
    assert sm.path.endswith(os.path.join("serving", "zoo", "3"))
    assert os.path.isfile(os.path.join(sm.path, "saved_model.pb"))
    for report in reports.values():
        assert os.path.exists(report.path)
        assert report.size_bytes > 0
        assert report.max_abs_error <= report.atol
        assert len(report.checks) == 2 and report.ops
    assert reports["tflite"].max_abs_error <= FLOAT_ATOL
    # Nothing but builtins: no Flex delegate, no custom ops.
    assert not [op for op in reports["tflite"].ops if "FLEX" in op.upper() or op == "CUSTOM"]
    assert sorted(sm.details["signature"]["inputs"]) == sorted(i.name for i in model.inputs)
    assert sorted(sm.details["signature"]["outputs"]) == sorted(model.output_names)


def test_saved_model_parity(zoo):
    model, reports = zoo
    fn = tf.saved_model.load(reports["saved_model"].path).signatures["serving_default"]
    for name, spec in fn.structured_input_signature[1].items():
        assert spec.shape[0] is None and spec.shape[1] is None, name  # dynamic batch, seq
    for batch, length in SHAPES:
        feed = make_inputs(model, batch, length)
        got = {k: v.numpy() for k, v in fn(**{k: tf.constant(v) for k, v in feed.items()}).items()}
        assert_close(got, keras_run(model, feed), f"SavedModel {batch}x{length}")


def test_saved_model_holds_each_weight_once(zoo):
    """The checkpoint of the SavedModel stores every weight once (Keras's
    archive alone stores the Keras variables and the endpoint's tf.Variables:
    twice the bytes, in TF Serving and in TFLite's converter), and the loaded
    object lists the variables to fine-tune."""
    model, reports = zoo
    folder = os.path.join(reports["saved_model"].path, "variables")
    stored = sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder))
    weights = sum(np.asarray(keras.ops.convert_to_numpy(w)).nbytes for w in model.weights)
    # The index and per-tensor headers: a few hundred bytes per variable.
    assert weights <= stored <= weights + 512 * len(model.weights), (stored, weights)
    loaded = tf.saved_model.load(reports["saved_model"].path)
    assert len(loaded.trainable_variables) == len(model.trainable_weights)
    assert len(loaded.variables) == len(model.weights)


def run_tflite_resized(path, feed):
    """Raw interpreter API: resize_tensor_input to the feed's shapes, invoke."""
    from ai_edge_litert.interpreter import Interpreter

    interpreter = Interpreter(model_path=path)
    runner_io = interpreter.get_signature_list()["serving_default"]
    details = {d["name"]: d for d in interpreter.get_input_details()}
    by_name = {}
    for name in runner_io["inputs"]:
        detail = details[f"serving_default_{name}:0"]
        assert list(detail["shape_signature"][:2]) == [-1, -1]
        by_name[name] = detail
        interpreter.resize_tensor_input(detail["index"], feed[name].shape)
    interpreter.allocate_tensors()
    for name, detail in by_name.items():
        interpreter.set_tensor(detail["index"], feed[name])
    interpreter.invoke()
    runner = interpreter.get_signature_runner("serving_default")
    out_index = dict(runner._outputs)  # {output name: tensor index}
    return {name: interpreter.get_tensor(idx) for name, idx in out_index.items()}


def test_tflite_parity_after_resize(zoo):
    model, reports = zoo
    for batch, length in SHAPES:
        feed = make_inputs(model, batch, length)
        got = run_tflite_resized(reports["tflite"].path, feed)
        assert_close(got, keras_run(model, feed), f"tflite {batch}x{length}")


def test_onnx_parity_names_and_dynamic_axes(zoo):
    import onnx
    import onnxruntime as ort

    model, reports = zoo
    proto = onnx.load(reports["onnx"].path)
    assert [o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")] == [17]
    assert [i.name for i in proto.graph.input] == [i.name for i in model.inputs]
    assert [o.name for o in proto.graph.output] == list(model.output_names)
    for graph_input in proto.graph.input:
        dims = graph_input.type.tensor_type.shape.dim
        assert dims[0].dim_param == "batch" and dims[1].dim_param, graph_input.name
    session = ort.InferenceSession(reports["onnx"].path, providers=["CPUExecutionProvider"])
    for batch, length in SHAPES:
        feed = make_inputs(model, batch, length)
        got = dict(zip(model.output_names, session.run(list(model.output_names), feed)))
        assert_close(got, keras_run(model, feed), f"ONNX {batch}x{length}")


def test_padding_mask_survives_export(zoo):
    """mask_zero=True: extra trailing padding does not change the masked-pooled output."""
    import onnxruntime as ort

    model, reports = zoo
    short = make_inputs(model, 2, 5, seed=3)
    short["tokens"][:, 3:] = 0
    padded = make_inputs(model, 2, 9, seed=4)
    padded["tokens"][:] = 0
    padded["tokens"][:, :5] = short["tokens"]
    fn = tf.saved_model.load(reports["saved_model"].path).signatures["serving_default"]
    session = ort.InferenceSession(reports["onnx"].path, providers=["CPUExecutionProvider"])
    runners = {
        "saved_model": lambda f: fn(**{k: tf.constant(v) for k, v in f.items()})[
            "out_encoder_classifier"
        ].numpy(),
        "tflite": lambda f: run_tflite_resized(reports["tflite"].path, f)["out_encoder_classifier"],
        "onnx": lambda f: session.run(["out_encoder_classifier"], f)[0],
    }
    want = keras_run(model, short)["out_encoder_classifier"]
    for fmt, run in runners.items():
        tolerance.assert_close(run(short), want, terms=EXPORT_TERMS, err_msg=fmt)
        tolerance.assert_close(run(padded), want, terms=EXPORT_TERMS, err_msg=fmt)


def test_check_exportable_passes_for_causal_mha():
    # Causal MHA with dynamic length: keras.layers.MultiHeadAttention needs Flex here.
    report = kx.check_exportable(model_zoo.multi_head_attention(), formats=("tflite",))
    assert report.ok, str(report)
    assert "Einsum" in report.tf_ops or "BatchMatMulV2" in report.tf_ops


# ---------------------------------------------------------------------------
# Quantisation (a model big enough for the weights to be quantised)


def classifier(dim=64):
    from keras_attn import layers as kal

    ids = keras.Input((None,), dtype="int32", name="tokens")
    h = kal.TokenAndPositionEmbedding(model_zoo.VOCAB, 32, dim, mask_zero=True)(ids)
    h = kal.TransformerEncoderBlock(4, intermediate_dim=2 * dim)(h)
    pooled = keras.layers.GlobalAveragePooling1D()(h)
    return keras.Model(ids, keras.layers.Dense(3, activation="softmax", name="probs")(pooled))


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    keras.utils.set_random_seed(3)
    model = classifier()
    out = tmp_path_factory.mktemp("quant")
    # Untrained: near-uniform probabilities, so int8's argmax agreement is not
    # meaningful here (min_agreement=0; test_quantized_accuracy checks a
    # trained model); its error is bounded in the test below.
    reports = {q: kx.export_tflite(model, out / f"{q}.tflite",
                                   quantization=None if q == "float32" else q,
                                   min_agreement=0.0 if q == "int8" else None)
               for q in ("float32", "float16", "dynamic", "int8")}
    for r in reports.values():
        print(r)
    return model, reports


def test_quantization_size_and_accuracy(quantized):
    model, reports = quantized
    rng = np.random.default_rng(11)
    tokens = rng.integers(1, model_zoo.VOCAB, size=(64, 12)).astype("int32")
    tokens[::2, 8:] = 0
    want = np.asarray(model(tokens))
    sizes = {q: r.size_bytes for q, r in reports.items()}
    errors = {}
    for q, r in reports.items():
        got = run_tflite_resized(r.path, {"tokens": tokens})["probs"]
        errors[q] = float(np.max(np.abs(got - want)))
        agree = float(np.mean(got.argmax(-1) == want.argmax(-1)))
        print(f"{q}: {sizes[q]} bytes, max |probs - keras| {errors[q]:.2g}, top-1 agreement {agree:.2f}")
    assert errors["float32"] <= FLOAT_ATOL
    assert errors["float16"] <= 1e-2 and sizes["float16"] < 0.65 * sizes["float32"]
    assert errors["dynamic"] <= 5e-2 and sizes["dynamic"] < 0.45 * sizes["float32"]
    assert errors["int8"] <= 0.15 and sizes["int8"] < 0.5 * sizes["float32"]
    assert "QUANTIZE" in reports["int8"].ops
    # Quantized reports carry the measured agreement and the threshold checked.
    for q, floor in (("float16", 0.99), ("dynamic", 0.95)):
        assert reports[q].min_agreement == floor and reports[q].agreement >= floor, q
        assert reports[q].atol is None
    assert reports["float32"].agreement is None
    # The default float32 bound: float32 rounding at the magnitude of the
    # outputs on the sample sets it was checked on (the generated ones).
    checked = [model.predict(s, verbose=0) for s in make_samples(model)]
    assert reports["float32"].atol == pytest.approx(tolerance.export_bound(model, checked), rel=1e-4)


def test_quantized_export_fails_on_disagreement(tmp_path):
    """Two classes whose weights differ by far less than an int8 step: Keras
    separates them by the sign of x . delta, the int8 weights cannot, so about
    half the top-1 answers flip and the default threshold (0.95) refuses it."""
    rng = np.random.default_rng(0)
    base = rng.uniform(-1, 1, (512, 1))
    kernel = np.concatenate([base, base + rng.uniform(-1e-4, 1e-4, (512, 1))], axis=1)
    x = keras.Input((512,), name="features")
    dense = keras.layers.Dense(2, use_bias=False, name="scores")
    model = keras.Model(x, dense(x))
    dense.set_weights([kernel.astype("float32")])
    features = rng.standard_normal((64, 512)).astype("float32")
    target = tmp_path / "q.tflite"
    with pytest.raises(kx.ParityError, match=r"argmax agreement 0\.[0-8]"):
        kx.export_tflite(model, target, quantization="dynamic", sample_inputs=features)
    assert not target.exists()
    report = kx.export_tflite(model, target, quantization="dynamic", sample_inputs=features,
                              min_agreement=0.0)
    assert report.agreement < 0.9 and report.min_agreement == 0.0
    with pytest.raises(ValueError, match="min_agreement"):
        kx.export_tflite(model, target, min_agreement=0.9)
    with pytest.raises(ValueError, match="min_agreement"):
        kx.export_tflite(model, target, quantization="dynamic", min_agreement=1.5)


# ---------------------------------------------------------------------------
# Bad inputs: clear errors, nothing left at the target path


def small_model():
    return model_zoo.dot_product_attention()


def test_unbuilt_model(tmp_path):
    class Sub(keras.Model):
        def call(self, x):
            return x

    target = tmp_path / "out" / "m.tflite"
    with pytest.raises(ValueError, match="unbuilt model"):
        kx.export_tflite(Sub(), target)
    with pytest.raises(ValueError, match="unbuilt model"):
        kx.export_saved_model(keras.Sequential([keras.layers.Dense(2)]), tmp_path / "sm")
    assert not (tmp_path / "out").exists() and not (tmp_path / "sm").exists()


class Det(keras.layers.Layer):
    """Uses a TF op (MatrixDeterminant) that TFLite only has as a Flex op."""

    def call(self, x):
        return tf.linalg.det(tf.reshape(x, (-1, 4, 4)))[:, None]


def test_unsupported_layer_is_named(tmp_path):
    x = keras.Input((16,), name="x")
    model = keras.Model(x, Det(name="det_layer")(x))
    report = kx.check_exportable(model, formats=("tflite",))
    assert not report.ok and "MatrixDeterminant" in report.problems["tflite"]
    target = tmp_path / "det.tflite"
    with pytest.raises(kx.UnsupportedOpsError, match="det_layer.*MatrixDeterminant"):
        kx.export_tflite(model, target)
    assert os.listdir(tmp_path) == []


def test_wrong_sample_inputs(tmp_path):
    model = small_model()
    target = tmp_path / "m.onnx"
    with pytest.raises(ValueError, match=r"sample_inputs.*features.*\(None, None, 16\)"):
        kx.export_onnx(model, target, sample_inputs=np.zeros((2, 5, 7), "float32"))
    with pytest.raises(ValueError, match="keys must be the model's input names"):
        kx.export_onnx(model, target, sample_inputs={"tokens": np.zeros((2, 5, 16))})
    with pytest.raises(ValueError, match="quantization"):
        kx.export_tflite(model, target, quantization="int4")
    assert os.listdir(tmp_path) == []


def test_unwritable_path(tmp_path):
    (tmp_path / "a_file").write_text("x")
    with pytest.raises(ValueError, match="unwritable `path`"):
        kx.export_tflite(small_model(), tmp_path / "a_file" / "m.tflite")
    assert (tmp_path / "a_file").read_text() == "x"


def test_parity_failure_leaves_nothing(tmp_path):
    target = tmp_path / "deep" / "m.tflite"
    with pytest.raises(kx.ParityError, match="does not match"):
        kx.export_tflite(small_model(), target, quantization="float16", atol=1e-9)
    assert not (tmp_path / "deep").exists()


def test_existing_artifact_kept_on_failure(tmp_path):
    target = tmp_path / "m.tflite"
    target.write_bytes(b"old")
    with pytest.raises(kx.ParityError):
        kx.export_tflite(small_model(), target, quantization="float16", atol=1e-9)
    assert target.read_bytes() == b"old"
    with pytest.raises(FileExistsError):
        kx.export_tflite(small_model(), target, overwrite=False)


# ---------------------------------------------------------------------------
# Artifacts run independently of the exporters: SavedModel, TFLite, ONNX


def run_artifacts(reports, feed):
    """`{format: {output name: array}}` from each artifact in `reports`."""
    import onnxruntime as ort

    fn = tf.saved_model.load(reports["saved_model"].path).signatures["serving_default"]
    session = ort.InferenceSession(reports["onnx"].path, providers=["CPUExecutionProvider"])
    onnx_names = [o.name for o in session.get_outputs()]
    return {
        "saved_model": {k: v.numpy() for k, v in fn(**{k: tf.constant(v) for k, v in feed.items()}).items()},
        "tflite": run_tflite_resized(reports["tflite"].path, feed),
        "onnx": dict(zip(onnx_names, session.run(onnx_names, feed))),
    }


def test_outputs_of_one_layer_get_unique_names(tmp_path):
    # [output, attention scores] of one layer: both carry the layer's name.
    from keras_attn import layers as kal

    x = keras.Input((None, 16), name="x")
    y, scores = kal.MultiHeadAttention(2, 8, name="mha")(x, x, return_attention_scores=True)
    model = keras.Model(x, [y, scores])
    assert model.output_names == ["mha", "mha"]
    assert kx.check_exportable(model).ok
    reports = kx.export_all(model, tmp_path, verbose=False)
    for report in reports.values():
        assert report.details["outputs"] == ["mha", "mha_1"]
    feed = {"x": np.random.default_rng(2).standard_normal((3, 6, 16)).astype("float32")}
    want_y, want_scores = (np.asarray(t) for t in model(feed["x"]))
    assert want_scores.shape == (3, 2, 6, 6)
    for fmt, got in run_artifacts(reports, feed).items():
        assert sorted(got) == ["mha", "mha_1"], fmt
        tolerance.assert_close(got["mha"], want_y, terms=EXPORT_TERMS, err_msg=fmt)
        tolerance.assert_close(got["mha_1"], want_scores, terms=EXPORT_TERMS, err_msg=fmt)


def test_repeated_output_names_skip_taken_names():
    from keras_attn.export import samples

    x = keras.Input((4,), name="x")
    y = keras.layers.Dense(2, name="d")(x)
    model = keras.Model(x, [y, y, keras.layers.Identity(name="d_1")(y)])
    assert samples.output_names(model) == ["d", "d_2", "d_1"]


# ---------------------------------------------------------------------------
# Mixed precision: exported as a float32 copy


def mixed_classifier(policy):
    """Layers computing in `policy` (a nested Sequential too); float32 logits."""
    from keras_attn import layers as kal

    keras.mixed_precision.set_global_policy(policy)
    try:
        ids = keras.Input((None,), dtype="int32", name="tokens")
        h = kal.TokenAndPositionEmbedding(model_zoo.VOCAB, 16, 16, mask_zero=True)(ids)
        h = kal.TransformerEncoderBlock(2, intermediate_dim=32, dropout=0.1)(h)
        h = keras.Sequential([keras.layers.Dense(16), keras.layers.LayerNormalization()],
                             name="head")(h)
        logits = keras.layers.Dense(3, dtype="float32", name="logits")(h)
        return keras.Model(ids, logits, name="mixed")
    finally:
        keras.mixed_precision.set_global_policy("float32")


@pytest.mark.filterwarnings("ignore:.*does not support masking")
@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_mixed_precision_model_exports_a_float32_copy(policy, tmp_path):
    keras.utils.set_random_seed(4)
    model = mixed_classifier(policy)
    assert model.get_layer("head").layers[0].compute_dtype == policy[6:]
    # Independent reference: the same architecture built in float32, same weights.
    reference = mixed_classifier("float32")
    reference.set_weights(model.get_weights())
    feed = {"tokens": np.random.default_rng(5).integers(1, model_zoo.VOCAB, (3, 9)).astype("int32")}
    feed["tokens"][1, 5:] = 0
    want = np.asarray(reference(feed["tokens"]))
    gap = float(np.max(np.abs(np.asarray(model(feed["tokens"]), "float64") - want)))
    assert gap > 10 * FLOAT_ATOL  # 16-bit compute: no float32 artifact matches it at 1e-4

    report = kx.check_exportable(model)
    assert report.ok, str(report)
    assert any("float32 copy" in w and policy in w for w in report.warnings), report.warnings
    with pytest.warns(UserWarning, match=f"computing in .*{policy}.*float32 copy") as record:
        reports = kx.export_all(model, tmp_path, sample_inputs=feed, verbose=False)
    assert len([w for w in record if "float32 copy" in str(w.message)]) == 1  # once, not per format
    for key, r in reports.items():
        note = r.details["float32_copy"]
        assert policy in note["replaced_policies"], key
        np.testing.assert_allclose(note["max_abs_diff_vs_model"], gap, rtol=1e-3)
        assert r.max_abs_error <= FLOAT_ATOL
    for fmt, got in run_artifacts(reports, feed).items():
        assert got["logits"].dtype == np.float32, fmt
        tolerance.assert_close(got["logits"], want, terms=EXPORT_TERMS, err_msg=fmt)
    # The model itself is untouched.
    assert model.get_layer("head").layers[0].compute_dtype == policy[6:]


class _UnregisteredScale(keras.layers.Layer):
    def call(self, x):
        return x * 2.0


def test_mixed_precision_model_that_cannot_be_rebuilt(tmp_path):
    keras.mixed_precision.set_global_policy("mixed_float16")
    x = keras.Input((None, 4), name="x")
    model = keras.Model(x, keras.layers.Dense(2, dtype="float32")(_UnregisteredScale()(x)))
    keras.mixed_precision.set_global_policy("float32")
    with pytest.raises(kx.ExportError, match="float32 copy yourself"):
        kx.export_onnx(model, tmp_path / "m.onnx")
    report = kx.check_exportable(model, formats=("tflite",))
    assert not report.ok and "float32 copy yourself" in report.problems["tflite"]
    # export_all refuses it once for every format, by the same error.
    with pytest.raises(kx.ExportError, match="float32 copy yourself"):
        kx.export_all(model, tmp_path / "all", verbose=False)
    assert kx.export_all(model, tmp_path / "all", verbose=False, on_error="continue") == {}
    assert not os.path.exists(tmp_path / "all") or os.listdir(tmp_path / "all") == []


@pytest.mark.parametrize("names", [("input_ids", "token_type_ids", "attention_mask"),
                                   ("Input_Ids", "Token_Type_Ids", "Attention_Mask")])
def test_make_samples_draws_ids_from_the_table_that_reads_them(names):
    """A BERT-shaped model (token ids into a 1000-row table, token types into
    a 3-row one, an attention mask): the generated ids span the token table,
    not the smallest table's ids 0-1 (which gave a sequence of one repeated
    token), types stay within their table, and the mask is ones with the
    padding zeros of every other row; input names read in any case, as the
    quality measures read them."""
    ids_name, types_name, mask_name = names
    ids = keras.Input((None,), dtype="int32", name=ids_name)
    types = keras.Input((None,), dtype="int32", name=types_name)
    mask = keras.Input((None,), dtype="int32", name=mask_name)
    x = keras.layers.Embedding(1000, 8)(ids) + keras.layers.Embedding(3, 8)(types)
    x = x * keras.ops.expand_dims(keras.ops.cast(mask, "float32"), -1)
    model = keras.Model([ids, types, mask], x)
    sample = make_samples(model, shapes=((4, 64),), seed=0)[0]
    assert sample[ids_name].max() > 100 and sample[ids_name].max() < 1000
    assert set(np.unique(sample[types_name])) == {0, 1, 2}
    assert set(np.unique(sample[mask_name])) == {0, 1}
    assert (sample[mask_name][0] == 1).all() and (sample[mask_name][1, -1] == 0)


class _TableWithUnsetVocabulary(keras.layers.Embedding):
    """An embedding whose `vocabulary_size` attribute exists but is None (its
    rows are `input_dim`), as a wrapper layer may carry one."""

    vocabulary_size = None


def test_generated_samples_and_id_checks_read_tables_by_one_rule(tmp_path):
    """Token ids read by a table whose `vocabulary_size` is None (rows in
    `input_dim`) and token types read by a 1-row table: SavedModel's
    `check_ids` checks both inputs against their own tables, and the
    generated samples stay inside them (types all 0)."""
    ids = keras.Input((None,), dtype="int32", name="input_ids")
    types = keras.Input((None,), dtype="int32", name="token_type_ids")
    x = _TableWithUnsetVocabulary(40, 8, name="id_table")(ids) + keras.layers.Embedding(1, 8)(types)
    model = keras.Model([ids, types], keras.layers.Dense(3)(x))
    sample = make_samples(model, shapes=((4, 16),), seed=0)[0]
    assert 0 < sample["input_ids"].max() < 40
    assert (sample["token_type_ids"] == 0).all()
    report = kx.export_saved_model(model, tmp_path / "sm", model_name="m", check_ids="clamp")
    assert report.details["checked_ids"] == {"input_ids": 40, "token_type_ids": 1}
