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
    # keras.Input defaults to float32: the model builds (Keras builds reloaded
    # subclassed models on float placeholders too), its first real call fails.
    float_ids = keras.Input((None,))
    model = keras.Model(float_ids, layer(float_ids))
    with pytest.raises(TypeError, match=r"dtype='int32'"):
        model.predict(ids, verbose=0)
    # float ids would be truncated: 2.7 would read row 2.
    assert tuple(layer(keras.Input((None,), dtype="int32")).shape) == (None, None, 4)


@keras.saving.register_keras_serializable(package="test_dtype_checks")
class _Classifier(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.embedding = kal.TokenAndPositionEmbedding(10, 8, 4)
        self.head = keras.layers.Dense(2)

    def call(self, ids):
        return self.head(self.embedding(ids))


def test_subclassed_model_with_embedding_reloads_its_weights(tmp_path):
    """Keras rebuilds a subclassed model on float placeholders when loading;
    the id check must not stop that (the weights would be lost)."""
    model = _Classifier()
    ids = np.array([[1, 2, 3]], "int32")
    expected = np.asarray(model(ids))
    model.save(tmp_path / "m.keras")
    loaded = keras.saving.load_model(tmp_path / "m.keras")
    np.testing.assert_array_equal(np.asarray(loaded(ids)), expected)
