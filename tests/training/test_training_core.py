"""Mixed precision, jit_compile training and a text classifier that learns."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_attn import layers as kal
from tests import model_zoo
from tests import tolerance


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
@pytest.mark.parametrize("name", ["encoder_classifier", "encoder_decoder", "rotary_embedding", "alibi_bias", "additive_attention"])
def test_mixed_precision_matches_float32(policy, name):
    keras.utils.set_random_seed(7)
    ref_model = model_zoo.ALL[name]()
    inputs = model_zoo.sample_inputs(ref_model)
    want = ref_model(inputs)
    keras.mixed_precision.set_global_policy(policy)
    model = model_zoo.ALL[name]()
    model.set_weights(ref_model.get_weights())
    got = model(inputs)
    for a, b in zip(tf.nest.flatten(got), tf.nest.flatten(want)):
        a = np.asarray(keras.ops.cast(a, "float32"))
        assert np.all(np.isfinite(a))
        # A model computed in 16 bits against float32: a few roundings of the
        # activations, which the models' normalisation keeps of order 1.
        dtype = "bfloat16" if policy == "mixed_bfloat16" else "float16"
        tolerance.assert_close(a, np.asarray(b), scale=max(1.0, tolerance.magnitude(b)),
                               ulps=10 if dtype == "float16" else 8, dtype=dtype)


def test_mixed_float16_huge_activations_do_not_overflow():
    keras.mixed_precision.set_global_policy("mixed_float16")
    layer = kal.MultiHeadAttention(2, 32, kernel_initializer="ones", use_bias=False)
    x = np.full((1, 4, 32), 30.0, "float32")  # q.k ~ 30*30*32*32*32 >> float16 max
    out, scores = layer(x, x, return_attention_scores=True, use_causal_mask=True)
    assert np.all(np.isfinite(np.asarray(out, "float32")))
    tolerance.assert_close(np.asarray(scores, "float32").sum(-1), 1.0, ulps=10, terms=4, dtype="float16")


def _copy_task(n, length, rng):
    x = rng.integers(1, model_zoo.VOCAB, size=(n, length)).astype("int32")
    return x, np.roll(x, 1, axis=1)


@pytest.mark.parametrize("jit", [False, True])
def test_fit_with_dynamic_lengths_and_jit(jit):
    model = model_zoo.decoder_only()
    model.compile(
        optimizer=keras.optimizers.Adam(1e-2),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=jit,
    )
    rng = np.random.default_rng(0)
    losses = []
    for length in (6, 9, 6):
        x, y = _copy_task(64, length, rng)
        losses += model.fit(x, y, batch_size=16, epochs=2, verbose=0).history["loss"]
    assert all(np.isfinite(losses))
    assert losses[-1] < losses[0]


def _majority_dataset(n, seed):
    """Label = which of tokens 1, 2, 3 occurs most often; variable lengths, padded with 0."""
    rng = np.random.default_rng(seed)
    seqs, labels = [], []
    while len(seqs) < n:
        length = rng.integers(6, 20)
        counts = rng.multinomial(length, [0.3, 0.3, 0.4] if rng.random() < 0.5 else [0.4, 0.3, 0.3])
        if len(set(counts)) < 3 and counts.max() == sorted(counts)[-2]:
            continue
        seq = np.repeat([1, 2, 3], counts)
        noise = rng.integers(4, model_zoo.VOCAB, size=rng.integers(0, 8))
        seq = rng.permutation(np.concatenate([seq, noise]))
        seqs.append(seq)
        labels.append(int(np.argmax(counts)))

    def gen():
        yield from zip(seqs, labels)

    ds = tf.data.Dataset.from_generator(
        gen, output_signature=(tf.TensorSpec([None], tf.int32), tf.TensorSpec([], tf.int32))
    )
    return ds, np.array(labels)


@pytest.mark.slow
def test_text_classifier_learns_on_tf_data():
    keras.utils.set_random_seed(0)
    train, _ = _majority_dataset(2000, 0)
    test, test_labels = _majority_dataset(400, 1)
    train = train.shuffle(2000, seed=0).padded_batch(32).prefetch(tf.data.AUTOTUNE)
    test = test.padded_batch(64)
    model = model_zoo.encoder_classifier(num_classes=3)
    model.compile(
        optimizer=keras.optimizers.Adam(3e-3),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
    )
    model.fit(train, epochs=6, verbose=0)
    _, accuracy = model.evaluate(test, verbose=0)
    majority = np.bincount(test_labels).max() / len(test_labels)
    assert accuracy > max(0.8, majority + 0.3), (accuracy, majority)
