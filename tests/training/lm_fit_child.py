"""One LoRA fine-tune of a tiny causal LM with `model.fit`, in its own process.

    python -m tests.training.lm_fit_child OUT.npz --devices N

`KERAS_BACKEND` picks the backend. N > 1 splits the one CPU into N devices
(logical devices for TensorFlow's `MirroredStrategy`, XLA host devices for
JAX's `keras.distribution.DataParallel`; the parent sets `XLA_FLAGS`, which
must precede JAX's import) and trains data-parallel across them. Writes the
loss of every step and the trainable weights.
"""

import argparse
import contextlib
import os

STEPS = 12
LENGTH = 8
BATCH = 8


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--devices", type=int, default=1)
    args = parser.parse_args()
    backend = os.environ["KERAS_BACKEND"]

    import tensorflow as tf

    scope = contextlib.nullcontext()
    if backend == "tensorflow":
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * args.devices)
        if args.devices > 1:
            scope = tf.distribute.MirroredStrategy(
                [f"/cpu:{i}" for i in range(args.devices)]).scope()

    import keras
    import numpy as np

    if backend == "jax" and args.devices > 1:
        import jax

        assert len(jax.devices()) == args.devices, jax.devices()
        keras.distribution.set_distribution(keras.distribution.DataParallel())

    from keras_attn.data import causal_lm_dataset
    from keras_attn.generation import DecoderOnlyLM
    from keras_attn.runtimes.tokenizers import character_tokenizer

    rng = np.random.default_rng(0)
    tok = character_tokenizer("abc=", special_tokens=("<pad>", "<eos>"))
    examples = [("".join(rng.choice(list("abc"), rng.integers(2, 5))) + "=",
                 "".join(rng.choice(list("abc"), rng.integers(1, 4)))) for _ in range(64)]
    data = causal_lm_dataset(examples, tok, LENGTH, BATCH, eos_token_id=1, shuffle=True,
                             seed=3, repeat=True, drop_remainder=True)
    with scope:
        keras.utils.set_random_seed(0)
        lm = DecoderOnlyLM(tok.get_vocab_size(), LENGTH, 32, num_layers=2, num_heads=2,
                           intermediate_dim=32)
        lm(np.zeros((1, LENGTH), "int32"))
        lm.enable_lora(4, target_names=("q_proj", "v_proj", "down_proj"))
        # Plain SGD: see tests/training/test_training_distributed.py on why
        # Adam would turn summation-order rounding into full steps.
        lm.compile(keras.optimizers.SGD(0.5),
                   keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    # One step per epoch: each epoch's logged loss is that step's.
    history = lm.fit(data, epochs=STEPS, steps_per_epoch=1, verbose=0)
    np.savez(args.out, losses=np.asarray(history.history["loss"]),
             names=np.asarray([w.path for w in lm.trainable_weights]),
             **{f"w{i}": np.asarray(w) for i, w in enumerate(lm.trainable_weights)})


if __name__ == "__main__":
    main()
