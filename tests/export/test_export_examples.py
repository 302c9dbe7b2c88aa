"""Every example model exports to SavedModel, TFLite (float32, dynamic-range) and ONNX.

Untrained, small builds of the models the examples train (same builders),
exported with `keras_attn.export.export_all`; then each artifact is run again
here (tf.saved_model / LiteRT / onnxruntime) on sample inputs at two batch
sizes and two sequence lengths, with padded rows (the models use
`mask_zero=True`), and compared with the Keras model. For the dynamic-length
models a padded row must give the same outputs as the same row with its
padding cut off, in the exported artifacts too.

The Bahdanau GRU model has fixed lengths: TFLite builtins need its GRUs
unrolled (`unroll=True`, the example's default); the while-loop GRU
(`unroll=False`) is refused with an UnsupportedOpsError, tested here.
"""

import argparse
import importlib.util
from pathlib import Path

import keras
import numpy as np
import pytest

from keras_attn import export
from keras_attn.export import samples as model_io
from tests import tolerance

ROOT = Path(__file__).resolve().parents[2]
DYNAMIC_ATOL = 0.25  # dynamic-range int8 weights, float activations


def _example(name):
    path = ROOT / "examples" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"_example_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _translate_dates():
    from keras_attn.data.pipelines import dates_tokenizers
    from keras_attn.training import quickstart

    args = argparse.Namespace(embedding_dim=32, num_heads=2, intermediate_dim=64, num_layers=1,
                              epochs=1, num_train=64, batch_size=32, learning_rate=1e-3)
    source, target = dates_tokenizers()
    model, _ = quickstart.build_dates_model(args, source, target, dynamic_length=True)
    return model, ((2, 9), (3, 5)), True


def _bahdanau(unroll=True):
    module = _example("bahdanau_seq2seq")
    model, _ = module.build_model(40, 16, 12, 6, 8, 32, unroll=unroll)
    return model, ((2, 12), (3, 12)), False  # fixed lengths: only the batch varies


def _text_classification():
    from keras_attn.training import transformer_classifier

    model = transformer_classifier(60, 16, embedding_dim=32, num_heads=2, intermediate_dim=64,
                                   num_layers=1, dropout=0.1, dynamic_length=True)
    return model, ((2, 16), (3, 7)), True


def _distributed_training():
    import tensorflow as tf

    module = _example("distributed_training")
    args = argparse.Namespace(sequence_length=16, embedding_dim=32, num_heads=2,
                              intermediate_dim=64, dropout=0.1)
    from keras_attn.training import transformer_classifier

    with tf.distribute.MirroredStrategy(devices=["/cpu:0"]).scope():
        trained = transformer_classifier(60, 16, embedding_dim=32, num_heads=2,
                                         intermediate_dim=64, dropout=0.1)
    model = module.export_model(trained, 60, args)
    ids = model_io.make_samples(trained, shapes=[(4, 16)], seed=5)[0]["token_ids"]
    gap = np.max(np.abs(np.asarray(model(ids)) - np.asarray(trained(ids))))
    assert gap <= 1e-6, f"the float32 export copy differs from the trained model by {gap}"
    return model, ((2, 16), (3, 7)), True


BUILDERS = {
    "translate_dates": _translate_dates,
    "bahdanau_seq2seq": _bahdanau,
    "text_classification": _text_classification,
    "distributed_training": _distributed_training,
}


@pytest.fixture(scope="module", params=list(BUILDERS))
def exported(request, tmp_path_factory):
    keras.utils.set_random_seed(0)
    model, shapes, dynamic = BUILDERS[request.param]()
    samples = model_io.make_samples(model, shapes=shapes, seed=1)
    out = tmp_path_factory.mktemp(request.param)
    reports = export.export_all(model, out, sample_inputs=samples, name=request.param,
                                tflite_quantizations=(None, "dynamic"))
    return request.param, model, samples, dynamic, reports


def _keras(model, sample):
    return model_io.keras_outputs(model, sample)


def _run_saved_model(report, sample):
    import tensorflow as tf

    fn = tf.saved_model.load(report.path).signatures["serving_default"]
    got = fn(**{k: tf.constant(v) for k, v in sample.items()})
    return [np.asarray(got[n]) for n in report.details["outputs"]]


def _run_tflite(report, sample):
    from ai_edge_litert.interpreter import Interpreter

    runner = Interpreter(model_path=report.path).get_signature_runner("serving_default")
    got = runner(**sample)
    return [np.asarray(got[n]) for n in report.details["outputs"]]


def _run_onnx(report, sample):
    import onnxruntime as ort

    session = ort.InferenceSession(report.path, providers=["CPUExecutionProvider"])
    return session.run(report.details["outputs"], sample)


RUNNERS = {"saved_model": _run_saved_model, "tflite": _run_tflite,
           "tflite_dynamic": _run_tflite, "onnx": _run_onnx}


def _max_err(a, b):
    return max(float(np.max(np.abs(np.asarray(x, "float64") - np.asarray(y, "float64"))))
               for x, y in zip(a, b))


def test_every_format_is_written_and_verified(exported):
    name, model, samples, dynamic, reports = exported
    assert list(reports) == ["saved_model", "tflite", "tflite_dynamic", "onnx"]
    shapes = [tuple(s.shape) for sample in samples for s in sample.values()]
    batches = {next(iter(s.values())).shape[0] for s in samples}
    lengths = {next(iter(s.values())).shape[1] for s in samples}
    assert len(batches) == 2
    assert len(lengths) == (2 if dynamic else 1), shapes
    for key, report in reports.items():
        assert Path(report.path).exists(), key
        assert len(report.checks) == 2, key
        if key == "tflite_dynamic":
            # Quantized: checked by argmax agreement; the logit error is reported.
            assert report.atol is None and report.min_agreement == 0.95, report
            assert report.agreement >= 0.95, report
        else:
            assert report.agreement is None
            # The default float32 bound, at the magnitude of the outputs checked.
            checked = [model.predict(s, verbose=0) for s in samples]
            assert report.atol == pytest.approx(tolerance.export_bound(model, checked), rel=1e-4)
    # Dynamic-range quantisation really quantised something (int8 weights).
    assert reports["tflite_dynamic"].size_bytes < 0.9 * reports["tflite"].size_bytes
    print(name, {k: f"{r.max_abs_error:.2e}" for k, r in reports.items()})


@pytest.mark.parametrize("key", list(RUNNERS))
def test_artifact_matches_keras_on_padded_inputs(exported, key):
    name, model, samples, _, reports = exported
    for sample in samples:
        assert any((x == 0).any() for x in sample.values()), "samples must contain padding"
        got, want = RUNNERS[key](reports[key], sample), _keras(model, sample)
        where = (name, key, {k: v.shape for k, v in sample.items()})
        if key == "tflite_dynamic":  # int8 weights: quantization error, not rounding
            assert _max_err(got, want) <= DYNAMIC_ATOL, where
            continue
        for g, w in zip(got, want):
            # The converter's graph against Keras: the same float32 math, fused
            # and ordered otherwise (tests/tolerance.py).
            tolerance.assert_close(g, w, terms=256, err_msg=str(where))


@pytest.mark.parametrize("key", ["tflite", "onnx"])
def test_padding_is_invisible_after_export(exported, key):
    """A padded row equals the same row with its padding cut (dynamic-length models)."""
    name, model, samples, dynamic, reports = exported
    if not dynamic:
        # Fixed-length model (the unrolled GRUs): there is no shorter input to
        # compare with; its padded rows are covered by the parity test above.
        assert name == "bahdanau_seq2seq"
        return
    first = next(iter(model.inputs)).name
    sample = samples[0]
    row = 1  # make_samples pads every other row
    n = int(np.flatnonzero(sample[first][row]).max()) + 1
    assert n < sample[first].shape[1]
    padded = {k: v[row:row + 1] for k, v in sample.items()}
    trimmed = dict(padded, **{first: padded[first][:, :n]})
    a = RUNNERS[key](reports[key], padded)
    b = RUNNERS[key](reports[key], trimmed)
    for x, y in zip(a, b):
        tolerance.assert_close(x, y, terms=256, err_msg=name)


def test_while_loop_gru_is_refused_by_tflite_with_a_clear_error(tmp_path):
    model, shapes, _ = _bahdanau(unroll=False)
    with pytest.raises(export.UnsupportedOpsError, match="unroll=True"):
        export.export_tflite(model, tmp_path / "loop.tflite",
                             sample_inputs=model_io.make_samples(model, shapes=shapes))
    assert not (tmp_path / "loop.tflite").exists()


def test_export_all_rejects_bad_arguments(tmp_path):
    model, _, _ = _text_classification()
    with pytest.raises(ValueError, match="formats"):
        export.export_all(model, tmp_path, formats=("pdf",))
    with pytest.raises(ValueError, match="tflite_quantizations"):
        export.export_all(model, tmp_path, tflite_quantizations=("int4",))
    with pytest.raises(ValueError, match="atol"):
        export.export_all(model, tmp_path, atol={"tflite_float16": 1e-2})
    with pytest.raises(ValueError, match="on_error"):
        export.export_all(model, tmp_path, on_error="ignore")
    # Values inside a dict by report key, and the quantized variants' measure
    # and threshold, are refused before the first format is written.
    with pytest.raises(ValueError, match="atol"):
        export.export_all(model, tmp_path, atol={"onnx": -1.0})
    with pytest.raises(ValueError, match="min_agreement"):
        export.export_all(model, tmp_path, tflite_quantizations=(None, "dynamic"),
                          min_agreement={"tflite_dynamic": 1.5})
    with pytest.raises(ValueError, match="measure"):
        export.export_all(model, tmp_path, onnx_quantizations=(None, "dynamic"), measure="l2")
    with pytest.raises(ValueError, match="threshold"):
        export.export_all(model, tmp_path, onnx_quantizations=(None, "dynamic"), threshold=-0.5)
    with pytest.raises(ValueError, match="threshold"):
        export.export_all(model, tmp_path, threshold=0.9)  # no quantized variant to check
    assert not any(tmp_path.iterdir())
