"""export_tflite's direct writer of Transformer encoders (`tflite_encoder`),
checked against Keras and against TensorFlow's converter on the same models;
the converter for what it does not cover."""

import warnings

import keras
import numpy as np
import pytest

from keras_attn.export import export_tflite
from keras_attn.export import tflite_encoder
from keras_attn.export.tflite import tflite_op_names
from keras_attn.export.tflite_encoder import NotFusableError
from tests import model_zoo
from tests import tolerance
from tests.model_zoo import BERT_VOCAB as VOCAB
from tests.model_zoo import bert_feed
from tests.model_zoo import bert_like

OUTPUTS = ["last_hidden_state", "pooler_output"]
VARIANTS = {
    # A converted BERT's layout: post-norm, exact GELU, keys masked only.
    "post_norm": dict(normalize_first=False, activation="gelu", layers=2, seed=1),
    # Our blocks' defaults (padded query rows zeroed), causal, tanh GELU.
    "pre_norm": dict(normalize_first=True, activation="gelu_tanh", layers=1, seed=2,
                     mask_padded_queries=True, causal=True),
}


def _runner(path):
    from ai_edge_litert import interpreter as litert

    return litert.Interpreter(model_path=str(path)).get_signature_runner("serving_default")


def _keras(model, feed):
    return [np.asarray(t) for t in model(feed, training=False)]


def _masked_feed():
    # Padded rows, and a last row with no token at all (every key masked).
    feed = bert_feed(batch=3, length=9, seed=11)
    feed["attention_mask"][2] = 0
    return feed


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def exported(request, tmp_path_factory):
    """Each variant exported by both writers: `(model, {writer: (path, report)})`."""
    model = bert_like(**VARIANTS[request.param])
    folder = tmp_path_factory.mktemp(request.param)
    out = {}
    for writer in ("auto", "traced"):
        path = folder / f"{writer}.tflite"
        out[writer] = path, export_tflite(model, path, sample_inputs=bert_feed(seed=5), writer=writer)
    return request.param, model, out


def test_default_writer_is_direct_and_matches_keras(exported):
    which, model, out = exported
    path, report = out["auto"]
    assert report.details["writer"] == "direct"
    assert out["traced"][1].details["writer"] == "converter"
    feed = _masked_feed()
    got = _runner(path)(**feed)
    assert sorted(got) == sorted(OUTPUTS)
    tolerance.assert_all_close([got[n] for n in OUTPUTS], _keras(model, feed),
                               terms=tolerance.LAYER_TERMS, err_msg=which)


def test_same_outputs_as_the_converter(exported):
    which, model, out = exported
    feed = bert_feed(batch=2, length=13, seed=3)
    direct, converted = (_runner(out[w][0])(**feed) for w in ("auto", "traced"))
    want = _keras(model, feed)
    for got in (direct, converted):
        tolerance.assert_all_close([got[n] for n in OUTPUTS], want, terms=tolerance.LAYER_TERMS,
                                   err_msg=which)
    tolerance.assert_all_close([direct[n] for n in OUTPUTS], [converted[n] for n in OUTPUTS],
                               terms=tolerance.LAYER_TERMS, err_msg=f"{which}: direct vs converter")


def test_fully_masked_row_is_finite_and_equals_keras(exported):
    which, model, out = exported
    feed = _masked_feed()
    want = _keras(model, feed)
    assert all(np.isfinite(w).all() for w in want)
    for writer in ("auto", "traced"):
        got = _runner(out[writer][0])(**feed)
        assert all(np.isfinite(got[n]).all() for n in OUTPUTS), writer
        tolerance.assert_all_close([got[n][2] for n in OUTPUTS], [w[2] for w in want],
                                   terms=tolerance.LAYER_TERMS, err_msg=f"{which} {writer}")


def test_signature_is_the_converters(exported):
    """Names, dtypes and dynamic axes of the inputs and outputs, as the
    converter's signature has them (verification, export_all and user code
    read them by these names)."""
    _, _, out = exported
    from ai_edge_litert import interpreter as litert

    def contract(path):
        interpreter = litert.Interpreter(model_path=str(path))
        signature = interpreter.get_signature_list()["serving_default"]
        runner = interpreter.get_signature_runner("serving_default")
        return signature, {
            name: (d["dtype"], list(d["shape_signature"]))
            for details in (runner.get_input_details(), runner.get_output_details())
            for name, d in details.items()
        }, sorted(d["name"] for d in interpreter.get_input_details())

    assert contract(out["auto"][0]) == contract(out["traced"][0])


def test_only_builtin_ops_each_weight_once_after_the_flatbuffer(exported):
    """Builtin ops only (no Flex, no custom op); every weight stored once,
    after the flatbuffer (addressed by offset), none left inline."""
    from ai_edge_litert.tools import flatbuffer_utils
    from tensorflow.lite.python import schema_py_generated as schema

    which, model, out = exported
    path = out["auto"][0]
    builtins = {name for name in vars(schema.BuiltinOperator) if name.isupper()}
    ops = tflite_op_names(model_path=str(path))
    assert set(ops) <= builtins - {"CUSTOM", "DELEGATE"}, ops
    assert {"FULLY_CONNECTED", "BATCH_MATMUL", "SOFTMAX", "GELU", "GATHER", "MEAN", "RSQRT"} <= set(ops)
    flat = flatbuffer_utils.convert_bytearray_to_object(path.read_bytes())
    outside = [b for b in flat.buffers if b.offset > 0]
    assert all(b.data is None for b in outside)
    assert max(int(b.offset + b.size) for b in outside) == path.stat().st_size
    weight_bytes = sum(np.asarray(w).nbytes for w in model.weights)
    assert sum(int(b.size) for b in outside) == weight_bytes, which


def test_ids_out_of_range_are_clamped_or_flagged(tmp_path):
    model = bert_like(**VARIANTS["post_norm"])
    feed = bert_feed(batch=3, length=7, seed=4)
    bad = {k: v.copy() for k, v in feed.items()}
    bad["input_ids"][0, 2] = VOCAB + 5
    bad["input_ids"][1, 0] = -3
    clamped = {k: v.copy() for k, v in bad.items()}
    clamped["input_ids"] = np.clip(bad["input_ids"], 0, VOCAB - 1)
    want = _keras(model, clamped)
    outputs = {}
    # The converter's "clamp" is tested with every model (test_export*); its
    # "flag" here, beside the direct writer's.
    for check_ids, writer in (("clamp", "auto"), ("flag", "auto"), ("flag", "traced")):
        path = tmp_path / f"{check_ids}_{writer}.tflite"
        report = export_tflite(model, path, sample_inputs=feed, check_ids=check_ids, writer=writer)
        assert report.details["check_ids"] == check_ids
        got = _runner(path)(**bad)
        tolerance.assert_all_close([got[n] for n in OUTPUTS], want, terms=tolerance.LAYER_TERMS,
                                   err_msg=f"{check_ids} {writer}")
        outputs[check_ids, writer] = got
    assert "valid" not in outputs["clamp", "auto"]
    for writer in ("auto", "traced"):
        np.testing.assert_array_equal(outputs["flag", writer]["valid"], [False, False, True])


def test_dynamic_int8_weights_per_channel_and_outputs(tmp_path):
    """quantization="dynamic": int8 FULLY_CONNECTED weights, one symmetric
    scale per output channel (max|row| / 127 of the Keras kernel), hybrid
    kernels; the outputs stay as close to Keras as the converter's."""
    from ai_edge_litert import interpreter as litert
    from ai_edge_litert.tools import flatbuffer_utils

    model = bert_like(**VARIANTS["post_norm"])
    reports = {}
    for writer in ("auto", "traced"):
        reports[writer] = export_tflite(model, tmp_path / f"{writer}.tflite",
                                        sample_inputs=bert_feed(seed=5), quantization="dynamic",
                                        writer=writer)
    assert reports["auto"].details["writer"] == "direct"
    path = tmp_path / "auto.tflite"
    flat = flatbuffer_utils.convert_bytearray_to_object(path.read_bytes())
    hybrid = [op.builtinOptions.asymmetricQuantizeInputs for op in flat.subgraphs[0].operators
              if flatbuffer_utils.opcode_to_name(flat, op.opcodeIndex) == "FULLY_CONNECTED"]
    assert hybrid == [True] * (2 * 4 + 1)  # per block qkv, output, two FFN; the pooler
    interpreter = litert.Interpreter(model_path=str(path))
    tensors = {d["name"]: d for d in interpreter.get_tensor_details()}
    for name, dense in (("encoder_0/ffn1", model.get_layer("encoder_0").feedforward_intermediate_dense),
                        ("pooler", model.get_layer("pooler"))):
        detail = tensors[name + "/weight"]
        kernel = np.asarray(dense.kernel).T  # (out, in)
        params = detail["quantization_parameters"]
        assert detail["dtype"] == np.int8 and params["quantized_dimension"] == 0
        assert not np.any(params["zero_points"])
        scale = params["scales"][:, None]
        np.testing.assert_allclose(scale[:, 0], np.abs(kernel).max(1) / 127, rtol=1e-6)
        # Rounded to the nearest code: within half a step of its row's scale.
        codes = interpreter.get_tensor(detail["index"]).astype(np.float64)
        assert np.all(np.abs(codes * scale - kernel) <= scale * (0.5 + 1e-4)), name
    feed = _masked_feed()
    want = _keras(model, feed)
    errors = {}
    for writer in ("auto", "traced"):
        got = _runner(tmp_path / f"{writer}.tflite")(**feed)
        errors[writer] = max(float(np.abs(got[n] - w).max() / np.abs(w).max())
                             for n, w in zip(OUTPUTS, want))
    # int8 weights move each output by a few percent of its size at most,
    # as they move the converter's.
    assert errors["auto"] < 0.05 and errors["traced"] < 0.05, errors


def test_uncovered_encoder_falls_back_with_a_warning_and_direct_refuses(tmp_path, monkeypatch):
    # A mask_zero embedding (the Keras mask as padding) is not covered.
    model = model_zoo.encoder_classifier()
    feed = model_zoo.sample_inputs(model)
    # Below the size the writer is meant for: the converter, quietly.
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        report = export_tflite(model, tmp_path / "small.tflite", sample_inputs=feed)
    assert report.details["writer"] == "converter"
    assert "direct_writer_skipped" not in report.details
    monkeypatch.setattr(tflite_encoder, "MEANT_FOR_PARAMETERS", 1)
    with pytest.warns(UserWarning, match=r"direct TFLite writer does not cover.*mask_zero"):
        report = export_tflite(model, tmp_path / "auto.tflite", sample_inputs=feed)
    assert report.details["writer"] == "converter"
    assert "mask_zero" in report.details["direct_writer_skipped"]
    with pytest.raises(NotFusableError, match=r"writer='direct'.*mask_zero"):
        export_tflite(model, tmp_path / "direct.tflite", sample_inputs=feed, writer="direct")
    assert not (tmp_path / "direct.tflite").exists()


def test_other_models_and_quantizations_go_to_the_converter_quietly(tmp_path, monkeypatch):
    monkeypatch.setattr(tflite_encoder, "MEANT_FOR_PARAMETERS", 1)
    inputs = keras.Input((None, 8), name="x")
    plain = keras.Model(inputs, keras.layers.Dense(3, activation="elu")(inputs))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        report = export_tflite(plain, tmp_path / "plain.tflite",
                               sample_inputs=np.ones((2, 4, 8), "float32"))
    assert report.details["writer"] == "converter"
    model = bert_like(**VARIANTS["post_norm"])
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        report = export_tflite(model, tmp_path / "f16.tflite", sample_inputs=bert_feed(seed=5),
                               quantization="float16")
    assert report.details["writer"] == "converter"
    assert "float16" in report.details["direct_writer_skipped"]
    with pytest.raises(NotFusableError, match="float16"):
        export_tflite(model, tmp_path / "x.tflite", quantization="float16", writer="direct")


def test_bad_writer_is_refused(tmp_path):
    model = bert_like(**VARIANTS["post_norm"])
    with pytest.raises(ValueError, match=r"`writer`.*'direct', 'traced'.*writer='tflite'"):
        export_tflite(model, tmp_path / "m.tflite", writer="tflite")
