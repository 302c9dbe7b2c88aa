"""An exported SavedModel can be reloaded and differentiated (fine-tuning)."""

import numpy as np
import pytest
import tensorflow as tf
import keras

import keras_attn as ka
from keras_attn import export
from tests import tolerance


@pytest.fixture(scope="module")
def classifier():
    keras.utils.set_random_seed(0)
    ids = keras.Input((None,), dtype="int32", name="tokens")
    h = ka.TokenAndPositionEmbedding(50, 16, 16, mask_zero=True)(ids)
    h = ka.TransformerEncoderBlock(num_heads=2, intermediate_dim=32)(h)
    h = keras.layers.GlobalAveragePooling1D()(h)
    return keras.Model(ids, keras.layers.Dense(2, name="logits")(h))


def test_reloaded_saved_model_gradients_match_keras(classifier, tmp_path):
    report = export.export_saved_model(classifier, tmp_path, model_name="clf")
    loaded = tf.saved_model.load(report.path)
    tokens = np.array([[3, 9, 4, 0, 0], [7, 1, 2, 5, 8]], "int32")
    weights = np.array([[1.0, -2.0], [0.5, 3.0]], "float32")

    with tf.GradientTape() as tape:
        got = loaded.signatures["serving_default"](tokens=tf.constant(tokens))["logits"]
        loss = tf.reduce_sum(got * weights)
    grads = tape.gradient(loss, loaded.trainable_variables)
    assert all(g is not None for g in grads)

    # Reference: the same loss differentiated through the Keras model.
    with tf.GradientTape() as tape:
        want = classifier(tokens, training=False)
        ref_loss = tf.reduce_sum(want * weights)
    ref_grads = tape.gradient(ref_loss, classifier.trainable_variables)
    reference = {v.path: np.asarray(tf.convert_to_tensor(g))
                 for v, g in zip(classifier.trainable_variables, ref_grads)}
    got_by_name = {v.name.split(":")[0]: np.asarray(tf.convert_to_tensor(g))
                   for v, g in zip(loaded.trainable_variables, grads)}
    assert sorted(got_by_name) == sorted(reference)
    for name, want_grad in reference.items():
        tolerance.assert_close(got_by_name[name], want_grad, terms=tolerance.LAYER_TERMS, err_msg=name)
