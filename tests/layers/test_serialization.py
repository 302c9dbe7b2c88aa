"""Configs, `.keras` files and weights round-trip exactly for every layer."""

import keras
import numpy as np
import pytest

from keras_attn import layers as kal
from tests import model_zoo


def _flat(x):
    return [np.asarray(t) for t in (x if isinstance(x, (list, tuple)) else [x])]


@pytest.mark.parametrize("name", sorted(model_zoo.ALL))
def test_keras_file_round_trip_is_bit_identical(tmp_path, name):
    model = model_zoo.ALL[name]()
    inputs = model_zoo.sample_inputs(model)
    before = _flat(model(inputs))
    path = tmp_path / f"{name}.keras"
    model.save(path)
    loaded = keras.saving.load_model(path, safe_mode=True)
    for a, b in zip(before, _flat(loaded(inputs))):
        np.testing.assert_array_equal(a, b)
    weights = tmp_path / f"{name}.weights.h5"
    model.save_weights(weights)
    fresh = model_zoo.ALL[name]()
    fresh.load_weights(weights)
    for a, b in zip(before, _flat(fresh(inputs))):
        np.testing.assert_array_equal(a, b)


LAYERS = [
    kal.DotProductAttention(scale=0.5, dropout=0.1, seed=3),
    kal.AdditiveAttention(5, dropout=0.2, use_bias=False),
    kal.MultiHeadAttention(4, 8, value_dim=6, num_key_value_heads=2, output_shape=7,
                           rotary_embedding=kal.RotaryEmbedding(max_wavelength=500), sliding_window=4),
    kal.SinusoidalPositionEncoding(max_wavelength=100),
    kal.LearnedPositionEmbedding(9),
    kal.RotaryEmbedding(scaling_factor=2.0),
    kal.AlibiBias(6, max_bias=4.0),
    kal.SentencePooling(("cls", "mean")),
    kal.RelativePositionBias(4, num_buckets=8, max_distance=20, bidirectional=False),
    kal.TokenAndPositionEmbedding(10, 8, 4, position="learned", mask_zero=True),
    kal.TokenAndPositionEmbedding(10, 8, 4, type_vocabulary_size=3, use_layer_norm=True,
                                  layer_norm_epsilon=1e-12),
    kal.ReversibleEmbedding(10, 4, mask_zero=True),
    kal.TransformerEncoderBlock(num_heads=2, intermediate_dim=8, activation="gelu_new",
                                mask_padded_queries=False),
    kal.TransformerEncoderBlock(num_heads=2, intermediate_dim=8, key_dim=3, activation="gelu", normalize_first=True,
                                rotary_embedding=kal.RotaryEmbedding()),
    kal.TransformerDecoderBlock(4, intermediate_dim=8, num_key_value_heads=2, dropout=0.1, layer_norm_epsilon=1e-6),
]


@pytest.mark.parametrize("layer", LAYERS, ids=lambda l: type(l).__name__)
def test_config_round_trip(layer):
    config = layer.get_config()
    clone = type(layer).from_config(config)
    assert clone.get_config() == config
    restored = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(layer))
    assert type(restored) is type(layer)
    assert restored.get_config() == config
    registered = keras.saving.get_registered_name(type(layer))
    assert registered == f"keras_attn>{type(layer).__name__}"
