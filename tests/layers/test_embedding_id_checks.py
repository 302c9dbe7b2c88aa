"""Token ids an embedding cannot look up are refused by name in eager calls.

Out-of-range ids (eager, concrete values): a ValueError naming the layer, the
id and the vocabulary size instead of the backend's gather error (TensorFlow
on CPU) or a silently clamped row (GPU, JAX). Float ids: a TypeError. Traced
calls are left as they were (an exported signature checks ids as its
`check_ids` says: tests/runtimes/test_serving_validation.py).
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_attn.layers import ReversibleEmbedding, TokenAndPositionEmbedding

VOCAB = 1000


@pytest.fixture(scope="module")
def layers():
    token = TokenAndPositionEmbedding(VOCAB, 16, 8, type_vocabulary_size=2, name="embed")
    token(np.array([[1, 2]]))
    reversible = ReversibleEmbedding(VOCAB, 8, name="tied")
    reversible(np.array([[1, 2]]))
    return {"TokenAndPositionEmbedding 'embed'": (token, "vocabulary_size=1000"),
            "ReversibleEmbedding 'tied'": (reversible, r"vocabulary_size \(input_dim\)=1000")}


@pytest.mark.parametrize("ids, bad, where", [
    (np.array([[1, 5000]]), 5000, r"inputs\[0, 1\]=5000"),
    (np.array([[3, 2], [-1, 4]], "int32"), -1, r"inputs\[1, 0\]=-1"),
    (np.array([[1, VOCAB]]), VOCAB, r"inputs\[0, 1\]=1000"),
])
@pytest.mark.parametrize("convert", [np.asarray, keras.ops.convert_to_tensor], ids=["numpy", "tensor"])
def test_out_of_range_id_names_layer_id_and_vocabulary(layers, ids, bad, where, convert):
    for name, (layer, size) in layers.items():
        with pytest.raises(ValueError, match=rf"{name}.*{size}.*{where}"):
            layer(convert(ids))


def test_out_of_range_token_type_id(layers):
    layer = layers["TokenAndPositionEmbedding 'embed'"][0]
    with pytest.raises(ValueError, match=r"type_vocabulary_size=2.*token_type_ids\[0, 1\]=2"):
        layer(np.array([[1, 2]]), token_type_ids=np.array([[0, 2]]))


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_float_ids_are_refused(layers, dtype):
    for name, (layer, _) in layers.items():
        with pytest.raises(TypeError, match=rf"{name} expects integer token ids.*dtype=float"):
            layer(np.array([[1.0, 2.7]], dtype))


def test_in_range_ids_read_the_table(layers):
    """The last id of the vocabulary is accepted and looked up (NumPy indexing)."""
    layer = layers["ReversibleEmbedding 'tied'"][0]
    ids = np.array([[0, VOCAB - 1, 7]])
    table = keras.ops.convert_to_numpy(layer.embeddings)
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(layer(ids)), table[ids])


def test_traced_calls_are_not_checked_in_python(layers):
    """In a traced function the ids have no values: the lookup is what it was
    (TensorFlow's gather, whose own error names neither layer nor vocabulary)."""
    layer = layers["ReversibleEmbedding 'tied'"][0]
    traced = tf.function(lambda ids: layer(ids), autograph=False)
    with pytest.raises(tf.errors.InvalidArgumentError, match="5000 is not in"):
        traced(tf.constant([[1, 5000]]))
    ok = traced(tf.constant([[1, 2]]))
    assert tuple(ok.shape) == (1, 2, 8)
