"""The bad-input table: every public constructor and call fails early and clearly."""

import numpy as np
import pytest

from keras_attn import layers as kal
from tests import tolerance

X = np.zeros((2, 5, 16), "float32")
IDS = np.array([[1, 2, 3]])


def _built_mha(**kwargs):
    layer = kal.MultiHeadAttention(2, 8, **kwargs)
    layer(X, X)
    return layer


def _ops_attention(**kwargs):
    from keras_attn.ops import dot_product_attention

    q = np.zeros((2, 5, 2, 4), "float32")
    return dot_product_attention(q, q, q, **kwargs)


CONSTRUCTORS = [
    # (callable, error type, words the message must contain)
    (lambda: kal.MultiHeadAttention(num_heads=0, key_dim=8), ValueError, ["num_heads", "positive integer", "0"]),
    (lambda: kal.MultiHeadAttention(num_heads=2.5, key_dim=8), ValueError, ["num_heads", "2.5"]),
    (lambda: kal.MultiHeadAttention(num_heads=8, key_dim=0), ValueError, ["key_dim", "key_dim=0"]),
    (lambda: kal.MultiHeadAttention(2, 8, value_dim=-1), ValueError, ["value_dim", "-1"]),
    (lambda: kal.MultiHeadAttention(8, 8, num_key_value_heads=3), ValueError, ["num_key_value_heads", "divisor", "num_heads=8", "3"]),
    (lambda: kal.MultiHeadAttention(2, 8, dropout=1.0), ValueError, ["dropout", "[0, 1)", "1.0"]),
    (lambda: kal.MultiHeadAttention(2, 8, dropout=float("nan")), ValueError, ["dropout", "nan"]),
    (lambda: kal.MultiHeadAttention(2, 8, dropout="0.1"), TypeError, ["dropout", "'0.1'"]),
    (lambda: kal.MultiHeadAttention(2, 8, attention_axes="(1, 2)"), ValueError, ["attention_axes", "(1, 2)"]),
    (lambda: kal.MultiHeadAttention(2, 8, output_shape=0), ValueError, ["output_shape", "0"]),
    (lambda: kal.MultiHeadAttention(2, 8, flash_attention=True, dropout=0.1), ValueError, ["Dropout", "flash attention"]),
    (lambda: kal.MultiHeadAttention(2, 8, rotary_embedding="rope"), TypeError, ["rotary_embedding", "rope"]),
    (lambda: kal.MultiHeadAttention(2, 7, rotary_embedding=kal.RotaryEmbedding()), ValueError, ["rotary_embedding", "key_dim=7"]),
    (lambda: kal.MultiHeadAttention(2, 8, sliding_window=0), ValueError, ["sliding_window", "0"]),
    (lambda: kal.DotProductAttention(scale="log"), ValueError, ["scale", "log"]),
    (lambda: kal.DotProductAttention(scale=-1.0), ValueError, ["scale", "-1.0"]),
    (lambda: kal.DotProductAttention(dropout=-0.1), ValueError, ["dropout", "-0.1"]),
    (lambda: kal.AdditiveAttention(units=0), ValueError, ["units", "0"]),
    (lambda: kal.AdditiveAttention(units=4, use_bias="yes"), TypeError, ["use_bias", "yes"]),
    (lambda: kal.SinusoidalPositionEncoding(max_wavelength=0), ValueError, ["max_wavelength", "0"]),
    (lambda: kal.LearnedPositionEmbedding(sequence_length=0), ValueError, ["sequence_length", "0"]),
    (lambda: kal.RotaryEmbedding(scaling_factor=-2), ValueError, ["scaling_factor", "-2"]),
    (lambda: kal.AlibiBias(num_heads=0), ValueError, ["num_heads", "0"]),
    (lambda: kal.RelativePositionBias(4, num_buckets=7), ValueError, ["num_buckets", "7"]),
    (lambda: kal.RelativePositionBias(4, num_buckets=32, max_distance=4), ValueError, ["max_distance", "4"]),
    (lambda: kal.TokenAndPositionEmbedding(0, 8, 4), ValueError, ["vocabulary_size", "0"]),
    (lambda: kal.TokenAndPositionEmbedding(10, 8, 4, position="rotary"), ValueError, ["position", "sinusoidal", "learned", "rotary"]),
    (lambda: kal.TransformerEncoderBlock(2, intermediate_dim=0), ValueError, ["intermediate_dim", "0"]),
    (lambda: kal.TransformerEncoderBlock(2, intermediate_dim=8, activation="swishy"), ValueError, ["activation", "swishy"]),
    (lambda: kal.TransformerEncoderBlock(2, intermediate_dim=8, normalize_first=1), TypeError, ["normalize_first", "1"]),
    (lambda: kal.TransformerEncoderBlock(4, intermediate_dim=8, num_key_value_heads=3), ValueError, ["num_key_value_heads", "3"]),
    (lambda: kal.TransformerDecoderBlock(2, intermediate_dim=8, layer_norm_epsilon=0), ValueError, ["layer_norm_epsilon", "0"]),
    (lambda: kal.TransformerDecoderBlock(2, intermediate_dim=8, dropout=2), ValueError, ["dropout", "2"]),
    (lambda: kal.DotProductAttention(scale=float("inf")), ValueError, ["scale", "finite", "inf"]),
    (lambda: kal.MultiHeadAttention(2, 8, dropout=0.1, chunk_size=4), ValueError, ["chunk_size=4", "dropout=0.1"]),
    (lambda: kal.DotProductAttention(dropout=0.2, chunk_size=(4, 8)), ValueError, ["chunk_size=(4, 8)", "dropout=0.2"]),
    (lambda: kal.TransformerEncoderBlock(2, intermediate_dim=8, dropout=0.1, chunk_size=16), ValueError, ["chunk_size=16", "dropout=0.1"]),
]

CALLS = [
    (lambda: kal.MultiHeadAttention(2, 8)(X[0], X[0]), ValueError, ["query", "rank 3", "(5, 16)"]),
    (lambda: kal.MultiHeadAttention(2, 8)(X, X, np.zeros((2, 4, 16), "float32")), ValueError, ["value", "key", "sequence length"]),
    (lambda: _built_mha()(np.zeros((2, 5, 9), "float32"), X), ValueError, ["query", "9", "16"]),
    (lambda: _built_mha()(X, np.zeros((3, 5, 16), "float32")), ValueError, ["batch size"]),
    (lambda: _built_mha()(X, X, attention_mask=np.ones((3, 5, 5), bool)), ValueError, ["attention_mask", "(3, 5, 5)"]),
    (lambda: _built_mha()(X, X, attention_mask=np.ones((2, 1, 5, 5, 1), bool)), ValueError, ["attention_mask", "rank"]),
    (lambda: _built_mha()(X, X, attention_mask=np.array([["x"] * 5] * 2)), TypeError, ["attention_mask", "dtype"]),
    (lambda: _built_mha()(X, X, value_mask=np.ones((2, 4), bool)), ValueError, ["value_mask", "(2, 4)"]),
    (lambda: _built_mha()(X, X, query_mask=np.ones((2, 5, 1), bool)), ValueError, ["query_mask"]),
    (lambda: _built_mha()(X, X, attention_bias=np.zeros((1, 3, 5, 5), "float32")), ValueError, ["attention_bias", "(1, 3, 5, 5)", "heads=2"]),
    (lambda: _built_mha(chunk_size=2)(X, X, attention_bias=np.zeros((1, 1, 5, 4), "float32")), ValueError, ["attention_bias", "(1, 1, 5, 4)", "T_k=5"]),
    (lambda: _built_mha(chunk_size=2)(X, X, attention_bias=np.zeros((1, 1, 1, 5, 5), "float32")), ValueError, ["attention_bias", "rank 4"]),
    (lambda: _ops_attention(bias=np.zeros((1, 1, 4, 5), "float32"), chunk_size=2), ValueError, ["`bias`", "(1, 1, 4, 5)", "T_q=5"]),
    (lambda: _ops_attention(attention_mask=np.ones((2, 5, 4), bool), chunk_size=2), ValueError, ["attention_mask", "(2, 5, 4)", "T_k=5"]),
    (lambda: _ops_attention(is_causal=True, start_index=-2), ValueError, ["start_index", "-2"]),
    (lambda: kal.DotProductAttention()(X, np.zeros((2, 5, 8), "float32"), X[..., :8]), ValueError, ["query", "key", "features"]),
    (lambda: kal.AdditiveAttention(4)(X[0], X), ValueError, ["query", "rank 3"]),
    (lambda: kal.LearnedPositionEmbedding(4)(X), ValueError, ["covers 4 positions", "[0, 5)"]),
    (lambda: kal.LearnedPositionEmbedding(8)(X, start_index=4), ValueError, ["start_index=4"]),
    (lambda: kal.SinusoidalPositionEncoding()(X, start_index=-3), ValueError, ["start_index", "-3"]),
    (lambda: kal.RotaryEmbedding()(X[..., :7]), ValueError, ["even", "(2, 5, 7)"]),
    (lambda: kal.TokenAndPositionEmbedding(10, 2, 4, position="learned")(IDS), ValueError, ["covers 2 positions"]),
    (lambda: kal.TokenAndPositionEmbedding(10, 8, 4)(X), ValueError, ["inputs", "rank 2"]),
    (lambda: kal.TransformerEncoderBlock(3, intermediate_dim=8)(X), ValueError, ["16", "num_heads=3", "key_dim"]),
    (lambda: kal.TransformerEncoderBlock(2, intermediate_dim=8)(X[0]), ValueError, ["inputs", "rank 3"]),
    (lambda: kal.TransformerDecoderBlock(2, intermediate_dim=8)(X, X[0]), ValueError, ["encoder_sequence", "rank 3"]),
]


def _export(fn_name, model=None, **kwargs):
    import keras

    from keras_attn import export

    if model is None:
        x = keras.Input((None, 16), name="x")
        model = keras.Model(x, kal.DotProductAttention()(x, x))
    return getattr(export, fn_name)(model, "/nonexistent-dir-for-errors/out", **kwargs)


EXPORTS = [
    (lambda: _export("export_tflite", quantization="int4"), ValueError, ["quantization", "int4", "dynamic"]),
    (lambda: _export("export_onnx", opset=5), ValueError, ["opset", "17", "opset=5"]),
    (lambda: _export("export_saved_model", version=0), ValueError, ["version", "version=0"]),
    (lambda: _export("export_tflite", atol=-1), ValueError, ["atol", "atol=-1"]),
    (
        lambda: _export("export_tflite", model=__import__("keras").Sequential([__import__("keras").layers.Dense(2)])),
        ValueError,
        ["unbuilt model", "keras.Input"],
    ),
]
CALLS += EXPORTS


def _id(case):
    return " ".join(case[2])[:60]


# On JAX and torch, Keras itself converts NumPy call arguments to tensors
# before the layer sees them, so a string mask fails inside Keras there.
_KERAS_CONVERTS_FIRST = {"attention_mask dtype"}


def _param(case):
    marks = [pytest.mark.tensorflow_only] if _id(case) in _KERAS_CONVERTS_FIRST else []
    return pytest.param(*case, id=_id(case), marks=marks)


@pytest.mark.parametrize("make, error, words", [_param(c) for c in CONSTRUCTORS + CALLS])
def test_bad_input_raises_clear_error(make, error, words):
    with pytest.raises(error) as info:
        make()
    message = str(info.value)
    for word in words:
        assert word in message, f"{word!r} not in {message!r}"
    # Raised by our checks, not deep inside TensorFlow.
    assert "tensorflow/python" not in message and "Traceback" not in message


def test_masks_as_python_lists_match_keras(rng):
    """Masks may be nested lists, as keras.layers.MultiHeadAttention accepts them."""
    import keras

    x = rng.normal(size=(2, 3, 8)).astype("float32")
    peer = keras.layers.MultiHeadAttention(num_heads=2, key_dim=4)
    mask = [[[1, 1, 0], [1, 0, 0], [1, 1, 1]], [[1, 0, 0], [1, 1, 0], [0, 1, 1]]]
    expected = peer(x, x, attention_mask=np.array(mask, bool))
    ours = kal.MultiHeadAttention.from_keras(peer)
    tolerance.assert_close(ours(x, x, attention_mask=mask), expected, terms=tolerance.LAYER_TERMS)
    tolerance.assert_close(ours(x, x, value_mask=[[1, 1, 0], [1, 0, 1]]), peer(x, x, attention_mask=np.array([[1, 1, 0], [1, 0, 1]], bool)[:, None, :]), terms=tolerance.LAYER_TERMS)
