"""The exporters' default parity bound (keras_attn/export/bounds.py): derived
from float32 rounding (the magnitude of the Keras outputs and the model's
size), so a deep model with large outputs passes while an export with one
weight matrix off by a relative 1e-3 fails; an explicit `atol=` stays an
absolute bound."""

import math

import keras
import numpy as np
import onnx
import pytest

import keras_attn as ka
from keras_attn.export import bounds, verify
from keras_attn.export import onnx as onnx_lib
from keras_attn.export import report as report_lib
from tests import tolerance


def _encoder(blocks, dim, out_scale, seed):
    keras.utils.set_random_seed(seed)
    ids = keras.Input((None,), dtype="int32", name="tokens")
    h = ka.TokenAndPositionEmbedding(vocabulary_size=50, sequence_length=16, embedding_dim=dim,
                                     position="learned")(ids)
    for _ in range(blocks):
        h = ka.TransformerEncoderBlock(num_heads=2, intermediate_dim=2 * dim)(h)
    out = keras.layers.Dense(4, name="scores")(h)
    model = keras.Model(ids, out)
    kernel = model.get_layer("scores").kernel
    kernel.assign(kernel * out_scale)
    return model


@pytest.fixture(scope="module")
def small():
    return _encoder(blocks=1, dim=16, out_scale=1.0, seed=0)


def _samples():
    rng = np.random.default_rng(0)
    return [{"tokens": rng.integers(0, 50, (2, 9)).astype("int32")},
            {"tokens": rng.integers(0, 50, (1, 16)).astype("int32")}]


def _expected_bound(model, samples):
    return tolerance.export_bound(model, [model.predict(s, verbose=0) for s in samples])


def _perturbing(monkeypatch, relative):
    """`model_proto_of` writing the largest weight matrix off by `relative`
    (random signs): a writer error of that size."""
    original = onnx_lib.model_proto_of

    def wrong(*args, **kwargs):
        proto, details = original(*args, **kwargs)
        init = max((i for i in proto.graph.initializer if len(i.dims) == 2),
                   key=lambda i: math.prod(i.dims))
        w = onnx.numpy_helper.to_array(init)
        signs = np.random.default_rng(1).choice([-1.0, 1.0], w.shape)
        init.CopyFrom(onnx.numpy_helper.from_array((w * (1 + relative * signs)).astype(w.dtype), init.name))
        return proto, details

    monkeypatch.setattr(onnx_lib, "model_proto_of", wrong)


def test_a_weight_off_by_1e_3_fails_the_default_bound(small, monkeypatch, tmp_path):
    _perturbing(monkeypatch, 1e-3)
    with pytest.raises(report_lib.ParityError, match=r"(?s)atol=.*the default bound of float32 "
                                                     r"rounding: 64 ulps x sqrt\(8 roundings x \d+ weight "
                                                     r"matrices\) x the largest \|Keras output\|"):
        onnx_lib.export_onnx(small, str(tmp_path / "m.onnx"), sample_inputs=_samples(), writer="traced")
    assert not (tmp_path / "m.onnx").exists()


def test_an_explicit_atol_is_absolute(small, monkeypatch, tmp_path):
    _perturbing(monkeypatch, 1e-3)
    written = onnx_lib.export_onnx(small, str(tmp_path / "m.onnx"), sample_inputs=_samples(),
                                   writer="traced", atol=1.0)
    assert written.atol == 1.0 and "atol_from" not in written.details
    assert 0 < written.max_abs_error <= 1.0


def test_a_correct_deep_export_with_large_outputs_passes(tmp_path):
    # Outputs ~1e3: float32's spacing there is ~6e-5, so a constant 1e-4
    # would be a couple of roundings; the default bound scales with them.
    model = _encoder(blocks=6, dim=16, out_scale=300.0, seed=1)
    samples = _samples()
    written = onnx_lib.export_onnx(model, str(tmp_path / "deep.onnx"), sample_inputs=samples)
    want = _expected_bound(model, samples)
    assert want > 1e-3
    np.testing.assert_allclose(written.atol, want, rtol=1e-6)
    assert written.max_abs_error <= written.atol
    assert "weight matrices" in written.details["atol_from"]
    assert set(written.checks[0]) == {"shapes", "max_abs_error", "argmax_matches"}


def test_the_bound_scales_with_the_outputs_and_the_depth():
    shallow, deep = _encoder(1, 8, 1.0, 0), _encoder(4, 8, 1.0, 0)
    one, _ = bounds.DEFAULT.resolve(shallow, 1.0)
    assert bounds.DEFAULT.resolve(shallow, 10.0)[0] == pytest.approx(10 * one)
    matrices = [sum(1 for w in m.weights if len(w.shape) >= 2) for m in (shallow, deep)]
    assert bounds.DEFAULT.resolve(deep, 1.0)[0] == pytest.approx(one * math.sqrt(matrices[1] / matrices[0]))


def test_check_parity_names_the_given_bound():
    checks = [{"shapes": {}, "max_abs_error": 2e-4, "argmax_matches": [1, 1]}]
    with pytest.raises(report_lib.ParityError, match=r"0.0002 > atol=0.0001 \(the absolute bound given"):
        verify.check_parity("ONNX", checks, 1e-4, "/x")
