"""One LoRA fine-tune of a tiny causal LM with `model.fit`, in its own process.

    python -m tests.training.lm_fit_child OUT.npz --devices N [--model-parallel]
    python -m tests.training.lm_fit_child OUT.npz --checkpoint-dir DIR --kill-at-step K ...

`KERAS_BACKEND` picks the backend. N > 1 splits the one CPU into N devices
(logical devices for TensorFlow's `MirroredStrategy`, XLA host devices for
JAX's `keras.distribution`; the parent sets `XLA_FLAGS`, which must precede
JAX's import) and trains across them: data-parallel, or with
`--model-parallel` (JAX) tensor-parallel with `DecoderOnlyLM.get_layout_map`
over a `(1, N)` mesh. Writes the loss of every epoch and the trainable
weights.

With `--checkpoint-dir` the fit takes a `keras_attn.training.FitCheckpoint`
every epoch (of `--steps-per-epoch` steps) and resumes from it; with
`--kill-at-step K` the process SIGKILLs itself after step K. `--log` gets
one `epoch loss` line per finished epoch, so a killed run leaves the losses
it reached.
"""

import argparse
import contextlib
import os
import signal
import subprocess
import sys

STEPS = 12
LENGTH = 8
BATCH = 8


def run(out, backend, *args, devices=1):
    """Runs this module with `args` in a fresh interpreter; returns the
    `subprocess.CompletedProcess` (output captured)."""
    from tests.environments import ROOT, child_env

    env = child_env(KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="2",
                    XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
                    CUDA_VISIBLE_DEVICES="")
    return subprocess.run(
        [sys.executable, "-m", "tests.training.lm_fit_child", str(out), "--devices", str(devices),
         *map(str, args)],
        check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def load(out):
    """`({weight path in the model: value}, epoch losses)` of a finished run."""
    import numpy as np

    with np.load(out) as f:
        # Paths without the model's own name (`decoder_only_lm_1` when the
        # run made another model first).
        names = [str(n).split("/", 1)[1] for n in f["names"]]
        return dict(zip(names, (f[f"w{i}"] for i in range(len(names))))), f["losses"]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--model-parallel", action="store_true")
    parser.add_argument("--optimizer", choices=("sgd", "adam"), default="sgd")
    parser.add_argument("--lora-dropout", type=float, default=0.0)
    parser.add_argument("--steps-per-epoch", type=int, default=1)
    parser.add_argument("--checkpoint-dir")
    parser.add_argument("--kill-at-step", type=int)
    parser.add_argument("--log")
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

    from keras_attn.data import causal_lm_dataset
    from keras_attn.generation import DecoderOnlyLM
    from keras_attn.runtimes.tokenizers import character_tokenizer
    from keras_attn.training import FitCheckpoint

    rng = np.random.default_rng(0)
    tok = character_tokenizer("abc=", special_tokens=("<pad>", "<eos>"))
    examples = [("".join(rng.choice(list("abc"), rng.integers(2, 5))) + "=",
                 "".join(rng.choice(list("abc"), rng.integers(1, 4)))) for _ in range(64)]

    def make_lm():
        return DecoderOnlyLM(tok.get_vocab_size(), LENGTH, 32, num_layers=2, num_heads=2,
                             intermediate_dim=32)

    if backend == "jax" and args.devices > 1:
        import jax

        assert len(jax.devices()) == args.devices, jax.devices()
        if args.model_parallel:
            mesh = keras.distribution.DeviceMesh((1, args.devices), ("data", "model"),
                                                 jax.devices())
            # The layout map reads only the sizes: an unbuilt model gives it.
            distribution = keras.distribution.ModelParallel(
                layout_map=make_lm().get_layout_map(mesh), batch_dim_name="data")
        else:
            distribution = keras.distribution.DataParallel()
        keras.distribution.set_distribution(distribution)

    data = causal_lm_dataset(examples, tok, LENGTH, BATCH, eos_token_id=1, shuffle=True,
                             seed=3, repeat=True, drop_remainder=True)
    callbacks = []
    if args.checkpoint_dir:
        checkpoint = FitCheckpoint(args.checkpoint_dir, delete_at_end=False)
        # The batches the checkpoint has trained on are not seen again.
        data = data.skip(checkpoint.step)
        callbacks.append(checkpoint)
    if args.log:
        def log(epoch, logs):
            with open(args.log, "a") as f:
                print(epoch, repr(logs["loss"]), file=f)

        callbacks.append(keras.callbacks.LambdaCallback(on_epoch_end=log))
    if args.kill_at_step:
        class Kill(keras.callbacks.Callback):
            def on_train_batch_end(self, batch, logs=None):
                # `self.model` (not `lm`): under JAX it syncs the variables
                # `fit` holds, the step counter among them.
                step = int(keras.ops.convert_to_numpy(self.model.optimizer.iterations))
                if step == args.kill_at_step:
                    os.kill(os.getpid(), signal.SIGKILL)

        callbacks.append(Kill())
    with scope:
        keras.utils.set_random_seed(0)
        lm = make_lm()
        lm(np.zeros((1, LENGTH), "int32"))
        lm.enable_lora(4, target_names=("q_proj", "v_proj", "down_proj"),
                       dropout=args.lora_dropout)
        # Plain SGD for the multi-device runs: see
        # tests/training/test_training_distributed.py on why Adam would turn
        # summation-order rounding into full steps.
        optimizer = (keras.optimizers.SGD(0.5) if args.optimizer == "sgd"
                     else keras.optimizers.Adam(1e-2))
        lm.compile(optimizer, keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    if args.model_parallel:
        # The layout map did shard: a query kernel is split over the devices.
        kernel = next(v for v in lm.weights if v.path.endswith("query/kernel"))
        assert not kernel.value.sharding.is_fully_replicated, kernel.value.sharding
    history = lm.fit(data, epochs=STEPS // args.steps_per_epoch,
                     steps_per_epoch=args.steps_per_epoch, verbose=0, callbacks=callbacks)
    np.savez(args.out, losses=np.asarray(history.history["loss"]),
             names=np.asarray([w.path for w in lm.weights]),
             **{f"w{i}": np.asarray(w) for i, w in enumerate(lm.weights)})


if __name__ == "__main__":
    main()
