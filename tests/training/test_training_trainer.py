"""keras_attn.training.Trainer in this process (default strategy): numbers vs NumPy."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_attn.generation import DecoderOnlyLM
from keras_attn.training import Trainer
from tests import tolerance


def _linear_problem(n=64, d=3, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, d)).astype("float32")
    y = (x @ np.array([[1.5], [-2.0], [0.5]], "float32") + 0.3).astype("float32")
    return x, y


def _input_fn(x, y, batch):
    def input_fn(ctx):
        return tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(batch)

    return input_fn


def test_sgd_steps_match_numpy_gradient_descent(tmp_path):
    x, y = _linear_problem()
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    w0, b0 = [v.copy() for v in model.get_weights()]
    trainer = Trainer(model, keras.optimizers.SGD(0.1), keras.losses.MeanSquaredError(),
                      global_batch_size=16, log_every=2, log_dir=str(tmp_path / "tb"))
    trainer.fit(_input_fn(x, y, 16), steps=8, verbose=False)
    # NumPy reference: full-precision gradient descent on the mean over the batch.
    w, b = w0.astype(np.float64), b0.astype(np.float64)
    losses = []
    for step in range(8):
        xb = x[(step % 4) * 16:(step % 4 + 1) * 16].astype(np.float64)
        yb = y[(step % 4) * 16:(step % 4 + 1) * 16].astype(np.float64)
        err = xb @ w + b - yb
        losses.append(np.mean(err**2))
        w -= 0.1 * 2 * xb.T @ err / 16
        b -= 0.1 * 2 * err.mean(axis=0)
    got_w, got_b = model.get_weights()
    # float32 against float64: a few roundings per step of 8.
    tolerance.assert_close(got_w, w, terms=8)
    tolerance.assert_close(got_b, b, terms=8)
    # Each log line is the mean loss of the steps since the previous one.
    expected = [np.mean(losses[i:i + 2]) for i in range(0, 8, 2)]
    tolerance.assert_close([v for _, v in trainer.history], expected, terms=8)
    assert [s for s, _ in trainer.history] == [2, 4, 6, 8]
    assert int(trainer.step.numpy()) == 8


def test_mixed_precision_wraps_loss_scale_optimizer_and_learns():
    keras.mixed_precision.set_global_policy("mixed_float16")
    x, y = _linear_problem(n=128)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(8, activation="relu"),
                              keras.layers.Dense(1, dtype="float32")])
    trainer = Trainer(model, keras.optimizers.Adam(0.05), "mse", global_batch_size=32,
                      log_every=10)
    assert isinstance(trainer.optimizer, keras.optimizers.LossScaleOptimizer)
    trainer.fit(_input_fn(x, y, 32), steps=60, verbose=False)
    losses = [v for _, v in trainer.history]
    assert losses[-1] < 0.2 * losses[0], losses
    assert model.layers[0].compute_dtype == "float16"
    assert all(w.dtype == np.float32 for w in model.get_weights())


def test_checkpoint_resume_in_process(tmp_path):
    x, y = _linear_problem()

    def make():
        keras.utils.set_random_seed(7)
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        return model, Trainer(model, keras.optimizers.Adam(0.01), "mse", global_batch_size=16,
                              checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_every=5,
                              log_every=5)

    keras.utils.set_random_seed(7)
    full_model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    Trainer(full_model, keras.optimizers.Adam(0.01), "mse", global_batch_size=16,
            log_every=5).fit(_input_fn(x, y, 16), steps=20, verbose=False)

    model, trainer = make()
    trainer.fit(_input_fn(x, y, 16), steps=10, verbose=False)
    model, trainer = make()  # a fresh process would start like this
    assert trainer.restore() == 10
    trainer.fit(_input_fn(x, y, 16), steps=20, verbose=False)
    assert [s for s, _ in trainer.history] == [15, 20]
    for a, b in zip(model.get_weights(), full_model.get_weights()):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"global_batch_size": 0}, "global_batch_size"),
        ({"global_batch_size": 8, "log_every": 0}, "log_every"),
        ({"global_batch_size": 8, "checkpoint_every": -1}, "checkpoint_every"),
    ],
)
def test_trainer_rejects_bad_arguments(kwargs, match):
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    with pytest.raises(ValueError, match=match):
        Trainer(model, keras.optimizers.SGD(0.1), "mse", **kwargs)


def _dropout_model():
    from keras_attn import layers as kal

    keras.utils.set_random_seed(11)
    x = keras.Input((4, 8))
    h = kal.TransformerEncoderBlock(2, intermediate_dim=16, dropout=0.3)(x)
    h = keras.layers.Dropout(0.4)(keras.layers.GlobalAveragePooling1D()(h))
    return keras.Model(x, keras.layers.Dense(1)(h))


def _sequence_problem(n=64):
    rng = np.random.default_rng(5)
    x = rng.normal(size=(n, 4, 8)).astype("float32")
    return x, x.sum(axis=(1, 2))[:, None].astype("float32") / 10


def test_checkpoint_resume_with_dropout_equals_uninterrupted(tmp_path):
    # The dropout RNGs (SeedGenerator states of keras_attn's block and of
    # keras.layers.Dropout) are part of the checkpoint: the resumed run draws
    # the masks the uninterrupted run draws, instead of replaying the first ones.
    x, y = _sequence_problem()

    def make(checkpoint_dir=None):
        model = _dropout_model()
        return model, Trainer(model, keras.optimizers.Adam(0.01), "mse", global_batch_size=16,
                              checkpoint_dir=checkpoint_dir, checkpoint_every=5, log_every=5)

    full_model, full = make()
    full.fit(_input_fn(x, y, 16), steps=10, verbose=False)

    first_model, first = make(str(tmp_path / "ckpt"))
    first.fit(_input_fn(x, y, 16), steps=5, verbose=False)
    seeds_at_5 = [np.asarray(v) for v in first._random_state]
    assert len(seeds_at_5) == 4 and all(s[1] > 0 for s in seeds_at_5)
    model, trainer = make(str(tmp_path / "ckpt"))  # a fresh process would start like this
    assert trainer.restore() == 5
    for restored, saved in zip(trainer._random_state, seeds_at_5):
        np.testing.assert_array_equal(np.asarray(restored), saved)
    trainer.fit(_input_fn(x, y, 16), steps=10, verbose=False)
    for a, b in zip(model.get_weights(), full_model.get_weights()):
        tolerance.assert_close(a, b, ulps=1)  # at most one rounding apart


def test_restores_checkpoint_without_random_state(tmp_path):
    # A checkpoint written before the random state was saved (model, optimizer,
    # step only) still restores the weights and the step, with a warning.
    x, y = _sequence_problem()
    model = _dropout_model()
    old = Trainer(model, keras.optimizers.Adam(0.01), "mse", global_batch_size=16)
    old.fit(_input_fn(x, y, 16), steps=3, verbose=False)
    legacy = tf.train.Checkpoint(model=model, optimizer=old.optimizer, step=old.step)
    tf.train.CheckpointManager(legacy, str(tmp_path), max_to_keep=1).save(checkpoint_number=3)

    fresh = _dropout_model()
    trainer = Trainer(fresh, keras.optimizers.Adam(0.01), "mse", global_batch_size=16,
                      checkpoint_dir=str(tmp_path))
    with pytest.warns(UserWarning, match="no random_state"):
        assert trainer.restore() == 3
    for a, b in zip(fresh.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(a, b)
    assert all(np.asarray(v)[1] == 0 for v in trainer._random_state)


def test_checkpoint_holds_every_weight_of_a_lora_decoder_lm(tmp_path):
    # A DecoderOnlyLM keeps its blocks in a list, which `tf.train.Checkpoint`
    # does not follow from the model: the checkpoint must still hold every
    # block's frozen kernels and LoRA factors, and the optimizer's moments.
    def make(seed):
        keras.utils.set_random_seed(seed)
        lm = DecoderOnlyLM(6, 4, 8, num_layers=2, num_heads=2, intermediate_dim=8)
        lm(np.zeros((1, 4), "int32"))
        lm.enable_lora(2, target_names=("q_proj", "v_proj"))
        return lm, Trainer(lm, keras.optimizers.Adam(1e-2),
                           keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                           global_batch_size=4, checkpoint_dir=str(tmp_path), checkpoint_every=2)

    x = np.random.default_rng(0).integers(0, 6, (8, 4)).astype("int32")
    lm, trainer = make(0)
    trainer.fit(lambda context: tf.data.Dataset.from_tensor_slices((x, x)).repeat().batch(4),
                steps=4, verbose=False)
    fresh, restored = make(1)  # other initial weights, A included
    assert restored.restore() == 4
    assert any("decoder_1" in v.path and "lora_kernel_b" in v.path for v in fresh.weights)
    for got, want in zip(fresh.weights, lm.weights, strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=want.path)
    for got, want in zip(restored.optimizer.variables, trainer.optimizer.variables, strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=want.path)
