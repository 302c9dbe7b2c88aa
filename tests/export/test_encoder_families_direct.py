"""The direct encoder writers on the encoders `from_huggingface` converts
from ModernBERT, EuroBERT, NomicBERT and Gemma 3's text model: ONNX
(standard ops and onnxruntime's fused ones) and TFLite, written by the
direct writers with no fallback (`details["writer"] == "direct"`), run by
onnxruntime and LiteRT against transformers (`attn_implementation="eager"`)
on right- and left-padded batches of 24 tokens, longer than the local
windows (8 tokens), with both rotary bases in use
(`tests/convert/test_convert_modernbert.py` shows that the windows and bases
change transformers' outputs at these sizes). What the writers still lack
is refused with the capability table's reason.
"""

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
ort = pytest.importorskip("onnxruntime")

import keras  # noqa: E402

from keras_attn import export as kx  # noqa: E402
from keras_attn.convert import from_huggingface  # noqa: E402
from keras_attn.description import read_encoder  # noqa: E402
from keras_attn.export import capabilities  # noqa: E402
from keras_attn.export.capabilities import NotFusableError  # noqa: E402
from keras_attn.layers.rotary_embedding import RotaryEmbedding  # noqa: E402
from keras_attn.layers.transformer_encoder_block import TransformerEncoderBlock  # noqa: E402
from tests import tolerance  # noqa: E402
from tests.convert.test_convert_modernbert import hf_model  # noqa: E402
from tests.convert.test_convert_modernbert import hf_output  # noqa: E402
from tests.convert.test_convert_modernbert import inputs  # noqa: E402
from tests.convert.test_convert_modernbert import padded_batch  # noqa: E402
from tests.model_zoo import randomize  # noqa: E402

# Every step kind the families add: a masked LM with a SiLU head and its
# norm (ModernBERT), mean pooling and every bias (ModernBERT), grouped
# heads and RMS norms (EuroBERT), token types added to the tokens
# (NomicBERT), QK-norm, sandwich norms and a scaled embedding with
# symmetric windows (Gemma 3, bidirectional; causal: the band within the
# causal triangle).
FAMILIES = ("modernbert_mlm", "modernbert_mean", "eurobert", "nomic_bert", "gemma3_bidirectional",
            "gemma3_causal")


def _litert_run(path, feed):
    from ai_edge_litert.interpreter import Interpreter

    outputs = Interpreter(model_path=str(path)).get_signature_runner("serving_default")(**feed)
    return outputs[sorted(outputs)[0]]


def _compared(got, want, mask):
    """The tokens (hidden states, logits), or every row of a pooled output:
    padded positions are computed by both but used by neither."""
    return (got[mask == 1], want[mask == 1]) if want.ndim == 3 else (got, want)


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    hf = hf_model(request.param)
    ids, mask = padded_batch()
    feed = inputs(request.param, ids, mask)
    return request.param, from_huggingface(hf), feed, mask, hf_output(hf, feed), hf.config.num_hidden_layers


@pytest.mark.parametrize("fused", [False, True])
def test_onnx_direct_equals_transformers(family, tmp_path, fused):
    name, model, feed, mask, want, layers = family
    assert capabilities.support(read_encoder(model), "onnx_encoder") is None
    report = kx.export_onnx(model, tmp_path / "m.onnx", writer="direct", fused=fused)
    assert report.details["writer"] == "direct"
    session = ort.InferenceSession(report.path, providers=["CPUExecutionProvider"])
    got = session.run(None, feed)[0]
    tolerance.assert_close(*_compared(got, want, mask), terms=(layers + 1) * 64, err_msg=name)


def test_standard_onnx_is_fused_by_onnxruntime(family, tmp_path):
    """The standard-op file's GELUs and RMS norms are written in the forms
    onnxruntime fuses at load (one `Gelu`, `FastGelu` or
    `SimplifiedLayerNormalization` kernel each, not five to seven
    elementwise ops): none of their arithmetic is left after its optimizer."""
    name, model, feed, mask, want, layers = family
    report = kx.export_onnx(model, tmp_path / "m.onnx", writer="direct", fused=False)
    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    ort.InferenceSession(report.path, options, providers=["CPUExecutionProvider"])
    import onnx

    ops = [node.op_type for node in onnx.load(str(tmp_path / "optimized.onnx")).graph.node]
    assert not {"Erf", "Tanh", "Pow", "Reciprocal"} & set(ops), (name, sorted(set(ops)))
    assert {"Gelu", "FastGelu", "QuickGelu", "SimplifiedLayerNormalization"} & set(ops), (name, sorted(set(ops)))


def test_tflite_direct_equals_transformers(family, tmp_path):
    name, model, feed, mask, want, layers = family
    assert capabilities.support(read_encoder(model), "tflite_encoder") is None
    report = kx.export_tflite(model, tmp_path / "m.tflite", writer="direct")
    assert report.details["writer"] == "direct"
    assert not [op for op in report.ops if "FLEX" in op.upper() or op == "CUSTOM"]
    got = _litert_run(report.path, feed)
    tolerance.assert_close(*_compared(got, want, mask), terms=(layers + 1) * 64, err_msg=name)


@pytest.mark.parametrize("options", [
    dict(rotary_embedding=RotaryEmbedding(rope_scaling={"rope_type": "linear", "factor": 2.0}),
         sliding_window=3, num_key_value_heads=2),
    dict(normalization="rms_norm", use_qk_norm=True, use_sandwich_norm=True, normalize_first=True,
         use_gated_feedforward=True, activation="silu", sliding_window=4, layer_norm_use_bias=False),
    dict(rotary_embedding=RotaryEmbedding(), sliding_window=2, normalize_first=False,
         layer_norm_use_bias=False, use_gated_feedforward=True, activation="gelu_tanh"),
], ids=["rotary-window-grouped", "gemma-like", "post-norm"])
def test_block_settings_are_written_as_keras_computes_them(options, tmp_path):
    """Blocks of these settings alone, on a left- and right-padded batch
    longer than the window, equal to Keras's (itself checked against
    transformers per family in tests/convert/)."""
    x = keras.Input((None, 32), name="x")
    mask = keras.Input((None,), dtype="int32", name="mask")
    block = TransformerEncoderBlock(num_heads=4, intermediate_dim=40, name="block", **options)
    model = keras.Model([x, mask], block(x, padding_mask=keras.ops.not_equal(mask, 0)))
    randomize(model, seed=3)
    rng = np.random.default_rng(4)
    feed = {"x": rng.normal(size=(2, 9, 32)).astype("float32"), "mask": np.ones((2, 9), "int32")}
    feed["mask"][0, 6:] = 0
    feed["mask"][1, :3] = 0
    want = keras.ops.convert_to_numpy(model(feed))
    onnx = kx.export_onnx(model, tmp_path / "m.onnx", writer="direct")
    tflite = kx.export_tflite(model, tmp_path / "m.tflite", writer="direct")
    assert onnx.details["writer"] == tflite.details["writer"] == "direct"
    session = ort.InferenceSession(onnx.path, providers=["CPUExecutionProvider"])
    for got in (session.run(None, feed)[0], _litert_run(tflite.path, feed)):
        tolerance.assert_close(got, want, terms=2 * 64)


def _windowed_encoder(rotary, mask_zero=False):
    ids = keras.Input((None,), dtype="int32", name="ids")
    x = keras.layers.Embedding(30, 16, mask_zero=mask_zero, name="tokens")(ids)
    block = TransformerEncoderBlock(num_heads=2, intermediate_dim=24, normalize_first=True,
                                    rotary_embedding=rotary, sliding_window=3, name="block")
    return keras.Model(ids, block(x, padding_mask=keras.ops.not_equal(ids, 0)))


@pytest.mark.parametrize("writer", sorted(capabilities.ENCODERS))
def test_what_the_writers_lack_is_refused_with_the_tables_reason(writer):
    label = capabilities.WRITERS[writer]
    masked = read_encoder(_windowed_encoder(RotaryEmbedding(), mask_zero=True))
    assert capabilities.support(masked, writer) == (
        f"tokens: mask_zero=True (id 0 as padding, a Keras mask) is not covered by the {label}")
    dynamic = RotaryEmbedding(rope_scaling={"rope_type": "dynamic", "factor": 2.0,
                                            "original_max_position_embeddings": 8})
    assert capabilities.support(read_encoder(_windowed_encoder(dynamic)), writer).startswith(
        "block: rope_scaling={'rope_type': 'dynamic'")
    with pytest.raises(NotFusableError, match="its frequencies depend on the call's length"):
        capabilities.check(read_encoder(_windowed_encoder(dynamic)), writer)
