"""Silent misuse made loud: int features into MultiHeadAttention, float ids into
TokenAndPositionEmbedding raise a TypeError naming the argument."""

import keras
import numpy as np
import pytest

import keras_attn.layers as kal


def test_multi_head_attention_rejects_integer_features():
    layer = kal.MultiHeadAttention(num_heads=2, key_dim=4)
    features = np.ones((2, 3, 8), "float32")
    assert tuple(layer(features, features).shape) == (2, 3, 8)
    ids = np.ones((2, 3, 8), "int32")
    with pytest.raises(TypeError, match=r"floating-point `query`.*dtype=int32.*\(2, 3, 8\)"):
        layer(ids, features)
    with pytest.raises(TypeError, match=r"floating-point `value`.*dtype=int64"):
        layer(features, ids.astype("int64"))
    with pytest.raises(TypeError, match=r"floating-point `key`.*dtype=int32"):
        layer(features, features, ids)
    # Symbolic inputs too (a functional model fails when built, not at serving time).
    with pytest.raises(TypeError, match=r"floating-point `query`"):
        layer(keras.Input((None, 8), dtype="int32"), keras.Input((None, 8)))


def test_token_and_position_embedding_rejects_float_ids():
    layer = kal.TokenAndPositionEmbedding(10, 8, 4)
    ids = np.array([[1, 2, 3]], "int32")
    assert tuple(layer(ids).shape) == (1, 3, 4)
    with pytest.raises(TypeError, match=r"integer token ids in `inputs`.*dtype=float32.*\(1, 3\)"):
        layer(ids.astype("float32"))
    with pytest.raises(TypeError, match=r"dtype='int32'"):
        layer(keras.Input((None,)))  # keras.Input defaults to float32
    # float ids would be truncated: 2.7 would read row 2.
    assert tuple(layer(keras.Input((None,), dtype="int32")).shape) == (None, None, 4)
