"""A .keras file with a layer Keras cannot find: the error names the fix."""

import keras
import numpy as np
import pytest

import keras_attn as ka
from keras_attn import saving


@keras.saving.register_keras_serializable(package="test_saving_hint")
class _Scale(keras.layers.Layer):
    def call(self, x):
        return x * 2.0


def test_unregistered_layer_error_names_the_import(tmp_path):
    inputs = keras.Input((4, 8))
    outputs = _Scale()(ka.MultiHeadAttention(2, 4)(inputs, inputs))
    path = tmp_path / "m.keras"
    keras.Model(inputs, outputs).save(path)
    # A fresh process without the registration, simulated by removing it.
    registry = keras.saving.get_custom_objects()
    saved = registry.pop("test_saving_hint>_Scale")
    try:
        with pytest.raises((TypeError, ValueError)) as caught:
            saving.load_model(path)
    finally:
        registry["test_saving_hint>_Scale"] = saved
    assert "import keras_attn" in str(caught.value)
    assert "custom_objects" in str(caught.value)
    loaded = saving.load_model(path)  # registered again: loads
    x = np.random.rand(1, 4, 8).astype("float32")
    assert loaded(x).shape == (1, 4, 8)
