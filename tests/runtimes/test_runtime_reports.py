"""The prefill/decode exports return a report checked against Keras, not a bare
path, and a runner with other input names is refused with the names it takes."""

import os
import re

import numpy as np
import pytest
import tensorflow as tf

from keras_attn.export.report import ExportReport, ParityError
from keras_attn.generation import DecoderOnlyLM
from keras_attn.runtimes import export_onnx, export_saved_model, export_tflite, greedy_loop
from keras_attn.runtimes import signatures
from keras_attn.runtimes.verification import SignatureReport

MAX_LEN = 8


class ShiftedLM(DecoderOnlyLM):
    """Keras's logits moved by exactly 1.0; the cached path (what is exported)
    is untouched, so every exported logit is 1.0 away from Keras's."""

    def call(self, token_ids, padding_mask=None):
        return super().call(token_ids, padding_mask) + 1.0


def _lm(cls=DecoderOnlyLM):
    lm = cls(23, 16, 16, num_layers=1, num_heads=2, intermediate_dim=32)
    lm(np.array([[5, 6]], np.int32))
    return lm


@pytest.fixture(scope="module")
def lm():
    return _lm()


def _shape_report(report, fmt, path):
    assert isinstance(report, SignatureReport) and isinstance(report, ExportReport)
    assert report.format == fmt
    assert report.path == os.path.abspath(path) and os.fspath(report) == report.path
    assert [c["signature"] for c in report.checks] == ["prefill", "decode", "decode_step"]
    assert report.max_abs_error == max(c["max_abs_error"] for c in report.checks)
    assert 0 <= report.max_abs_error <= report.atol
    assert report.size_bytes > 0 and report.ops
    assert fmt in str(report)


def _same_model(a, b):
    """Whether two TFLite models are equal but for where their constant
    buffers lie: the converter appends them past the flatbuffer (by offset)
    in an order that varies from run to run."""
    from ai_edge_litert.tools import flatbuffer_utils

    def canonical(content):
        model = flatbuffer_utils.read_model_from_bytearray(bytearray(content))
        return bytes(flatbuffer_utils.convert_object_to_bytearray(model))

    return canonical(a) == canonical(b)


@pytest.mark.slow
def test_tflite_export_returns_a_report_and_the_same_model(lm, tmp_path):
    kwargs = dict(max_length=MAX_LEN, batch_size=2, prompt_length=3)
    report = export_tflite(lm, tmp_path / "lm.tflite", **kwargs)
    _shape_report(report, "tflite", tmp_path / "lm.tflite")
    assert report.checks[0]["shapes"] == {"token_ids": (2, 3)}
    assert report.checks[1]["calls"] == MAX_LEN - 3
    with open(report, "rb") as f:  # where a path was returned, the report opens
        assert _same_model(f.read(), signatures.tflite_bytes(lm, **kwargs))
    assert report.size_bytes == os.path.getsize(tmp_path / "lm.tflite")
    assert "FULLY_CONNECTED" in report.ops


@pytest.mark.slow
def test_saved_model_and_onnx_exports_return_reports(lm, tmp_path):
    report = export_saved_model(lm, str(tmp_path / "sm"), max_length=MAX_LEN,
                                include_generate=False)
    _shape_report(report, "saved_model", tmp_path / "sm")
    assert set(tf.saved_model.load(report).signatures) == {"prefill", "decode", "decode_step"}

    report = export_onnx(lm, str(tmp_path / "onnx"), max_length=MAX_LEN)
    _shape_report(report, "onnx", tmp_path / "onnx")
    assert report["prefill"] == report.files["prefill"] == str(tmp_path / "onnx" / "prefill.onnx")
    assert os.path.isfile(report["decode"]) and os.path.isfile(report["decode_step"])
    assert report.size_bytes == sum(os.path.getsize(p) for p in report.files.values())


@pytest.mark.slow
def test_an_artifact_that_disagrees_with_keras_is_refused(tmp_path):
    shifted = _lm(ShiftedLM)
    for export, target in ((lambda p: export_tflite(shifted, p, max_length=MAX_LEN,
                                                    batch_size=1, prompt_length=2),
                            tmp_path / "x.tflite"),
                           (lambda p: export_onnx(shifted, p, max_length=MAX_LEN),
                            tmp_path / "x_onnx")):
        with pytest.raises(ParityError, match="nothing was written") as error:
            export(str(target))
        error_value = float(re.search(r"by ([0-9.e+-]+) >", str(error.value)).group(1))
        assert abs(error_value - 1.0) < 1e-3, str(error.value)  # the shift, measured
        assert not target.exists()


def test_greedy_loop_names_the_inputs_a_runner_takes(lm):
    """A LiteRT-LM bundle's model (`tokens`, `input_pos`) handed to greedy_loop:
    LiteRT itself would say only `Invalid Input name (token_ids) for SignatureDef`."""
    from ai_edge_litert import interpreter as litert

    from keras_attn.runtimes import litertlm

    content = litertlm.litertlm_tflite(lm, max_length=MAX_LEN, prefill_lengths=(4,))
    interpreter = litert.Interpreter(model_content=content)
    with pytest.raises(ValueError, match=r"takes inputs \['input_pos', 'kv_cache_k_0', "
                       r"'kv_cache_v_0', 'tokens'\]; greedy_loop feeds \['token_ids'\]"):
        greedy_loop(interpreter.get_signature_runner("prefill_4"),
                    interpreter.get_signature_runner("decode"),
                    np.array([[5, 6, 7, 8]], np.int32), MAX_LEN)


def test_saved_model_is_checked_without_a_second_copy_of_the_weights(lm, tmp_path, monkeypatch):
    """`export_saved_model` never loads the folder back (that restores every
    weight again: 5 GB at 1B); a weight written other than the model holds
    it is still caught, and nothing is left."""
    def no_load(*args, **kwargs):
        raise AssertionError("tf.saved_model.load holds a second copy of the weights")

    monkeypatch.setattr(tf.saved_model, "load", no_load)
    report = export_saved_model(lm, str(tmp_path / "sm"), max_length=MAX_LEN)
    assert report.max_abs_error <= report.atol
    monkeypatch.undo()
    loaded = tf.saved_model.load(os.fspath(report))  # the artifact still loads and runs
    out = loaded.signatures["prefill"](token_ids=tf.constant([[5, 6]], tf.int32))
    want = np.asarray(lm(np.array([[5, 6]], np.int32)))
    np.testing.assert_allclose(out["logits"].numpy(), want, atol=report.atol)

    save = tf.saved_model.save
    variable = lm.weights[0]

    def save_another_value(*args, **kwargs):
        kept = variable.numpy()
        variable.assign(kept + 1.0)  # what reaches the file differs from the model
        try:
            return save(*args, **kwargs)
        finally:
            variable.assign(kept)

    monkeypatch.setattr(tf.saved_model, "save", save_another_value)
    with pytest.raises(ParityError, match="another value"):
        export_saved_model(lm, str(tmp_path / "bad"), max_length=MAX_LEN)
    assert not os.path.exists(tmp_path / "bad")
