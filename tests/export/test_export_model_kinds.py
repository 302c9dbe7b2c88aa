"""Every export entry point takes Sequential, functional and subclassed models.

The exporters verify each artifact against the Keras model themselves (a
ParityError otherwise); these tests check that each model kind gets through
every entry point and that the reports name the inputs, outputs and id checks
the signature has.
"""

import keras
import numpy as np
import pytest

import keras_attn_cli
from keras_attn import export

VOCAB = 50


def _sequential():
    return keras.Sequential([
        keras.Input(shape=(None,), dtype="int32", name="tokens"),
        keras.layers.Embedding(VOCAB, 8, name="embed"),
        keras.layers.GlobalAveragePooling1D(name="pool"),
        keras.layers.Dense(3, name="logits"),
    ], name="sequential_classifier")


def _functional():
    tokens = keras.Input(shape=(None,), dtype="int32", name="tokens")
    hidden = keras.layers.Embedding(VOCAB, 8, name="embed")(tokens)
    pooled = keras.layers.GlobalAveragePooling1D(name="pool")(hidden)
    return keras.Model(tokens, keras.layers.Dense(3, name="logits")(pooled),
                       name="functional_classifier")


@keras.saving.register_keras_serializable(package="keras_attn_tests")
class SubclassedClassifier(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.embed = keras.layers.Embedding(VOCAB, 8, name="embed")
        self.logits = keras.layers.Dense(3, name="logits")

    def call(self, tokens):
        return self.logits(keras.ops.mean(self.embed(tokens), axis=1))


def _subclassed():
    model = SubclassedClassifier(name="subclassed_classifier")
    model(np.ones((2, 7), "int32"))  # a subclassed model knows its inputs once called
    return model


BUILDERS = {"sequential": _sequential, "functional": _functional, "subclassed": _subclassed}
OUTPUT = {"sequential": "logits", "functional": "logits", "subclassed": "subclassed_classifier"}


@pytest.fixture(scope="module", params=sorted(BUILDERS))
def kind_and_model(request):
    keras.utils.set_random_seed(0)
    return request.param, BUILDERS[request.param]()


def _check(report, kind, fmt, check_ids):
    assert report.format == fmt
    assert report.max_abs_error <= 1e-4
    assert report.details["inputs"] == ["tokens"]
    assert report.details["outputs"] == [OUTPUT[kind]]
    assert report.details["check_ids"] == check_ids


def test_export_all(kind_and_model, tmp_path):
    kind, model = kind_and_model
    reports = export.export_all(model, tmp_path, name="m", verbose=False)
    assert list(reports) == ["saved_model", "tflite", "onnx"]
    _check(reports["saved_model"], kind, "saved_model", "assert")
    assert reports["saved_model"].details["checked_ids"] == {"tokens": VOCAB}
    _check(reports["tflite"], kind, "tflite", "clamp")
    _check(reports["onnx"], kind, "onnx", "clamp")


def test_export_saved_model(kind_and_model, tmp_path):
    kind, model = kind_and_model
    _check(export.export_saved_model(model, tmp_path, model_name="m"), kind, "saved_model",
           "assert")


def test_export_tflite(kind_and_model, tmp_path):
    kind, model = kind_and_model
    _check(export.export_tflite(model, tmp_path / "m.tflite"), kind, "tflite", "clamp")


def test_export_onnx_fused_falls_back(kind_and_model, tmp_path):
    kind, model = kind_and_model
    with pytest.warns(UserWarning, match="falls back to tf2onnx.*is not covered by the direct ONNX encoder writer"):
        report = export.export_onnx(model, tmp_path / "m.onnx", fused=True)
    _check(report, kind, "onnx", "clamp")


def test_check_exportable(kind_and_model):
    assert export.check_exportable(kind_and_model[1]).ok


def test_cli_export(kind_and_model, tmp_path, capsys):
    kind, model = kind_and_model
    path = tmp_path / "m.keras"
    model.save(path)
    code = keras_attn_cli.main(["export", str(path), "--format", "all", "--out",
                                str(tmp_path / "out")])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert out.out.count("max |export - keras|") == 3, out.out


def test_subclassed_dtype_comes_from_the_samples(tmp_path):
    """A subclassed model's input dtype is that of `sample_inputs` when given."""
    model = _subclassed()
    samples = [{"tokens": np.arange(14, dtype="int64").reshape(2, 7) % VOCAB},
               {"tokens": np.arange(12, dtype="int64").reshape(3, 4) % VOCAB}]
    report = export.export_saved_model(model, tmp_path, sample_inputs=samples)
    assert report.details["signature"]["inputs"]["tokens"] == {"dtype": "int32",
                                                               "shape": [None, None]}


def test_uncalled_subclassed_model_is_refused():
    with pytest.raises(ValueError, match="never called.*sample_inputs"):
        export.export_saved_model(SubclassedClassifier(), "unused")


class DictModel(keras.Model):
    """Dict in, dict out: the signature keeps both sets of keys."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.embed = keras.layers.Embedding(VOCAB, 4)

    def call(self, inputs):
        pooled = keras.ops.mean(self.embed(inputs["tokens"]), axis=1)
        return {"pooled": pooled, "scaled": pooled * inputs["scale"]}


def test_subclassed_dict_inputs_and_outputs(tmp_path):
    model = DictModel(name="dict_model")
    samples = [{"tokens": np.array([[1, 2, 3]], "int32"), "scale": np.ones((1, 4), "float32")},
               {"tokens": np.array([[4, 5], [6, 7]], "int32"),
                "scale": np.full((2, 4), 2.0, "float32")}]
    model(samples[0])
    report = export.export_saved_model(model, tmp_path, sample_inputs=samples)
    assert report.details["inputs"] == ["tokens", "scale"]
    assert report.details["outputs"] == ["pooled", "scaled"]
    assert report.details["signature"]["inputs"]["scale"] == {"dtype": "float32",
                                                              "shape": [None, 4]}
    assert report.details["checked_ids"] == {"tokens": VOCAB}
