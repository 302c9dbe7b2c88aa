"""Train the text classifier (TokenAndPositionEmbedding + TransformerEncoderBlock)
across devices with MirroredStrategy, or across machines with
MultiWorkerMirroredStrategy, using keras_attn.training.Trainer.

One machine, the CPU split into 2 logical devices (or all local GPUs):

    python examples/distributed_training.py --strategy mirrored --num-cpu-devices 2
    python examples/distributed_training.py --strategy mirrored --use-fit   # Keras model.fit

Two workers (run each line in its own shell, or on two machines with their
addresses; checkpoint_dir must be shared storage for resuming):

    TF_CONFIG='{"cluster": {"worker": ["127.0.0.1:12345", "127.0.0.1:12346"]},
                "task": {"type": "worker", "index": 0}}' \\
        python examples/distributed_training.py --strategy multi-worker --checkpoint-dir /tmp/ckpt
    TF_CONFIG='{"cluster": {"worker": ["127.0.0.1:12345", "127.0.0.1:12346"]},
                "task": {"type": "worker", "index": 1}}' \\
        python examples/distributed_training.py --strategy multi-worker --checkpoint-dir /tmp/ckpt

Kill a worker and start both again: training resumes from the last
checkpoint. (Keras 3's model.fit does not run under MultiWorkerMirroredStrategy,
keras-team/keras#20585; the Trainer does.)

At the end the chief exports the trained classifier (a float32 copy built
outside the strategy, inputs of any length up to `--sequence-length`) to
SavedModel, TFLite float32 and dynamic-range int8, and ONNX in `--output-dir`,
each checked against Keras on test reviews at two batch sizes and two lengths
(`--no-export` skips this).
"""

import argparse
import json
import os
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
import keras_attn_cli  # noqa: E402

# Before TensorFlow is imported: hides its log lines (KERAS_ATTN_VERBOSE=1 shows them).
keras_attn_cli.quiet()


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--strategy", choices=["mirrored", "multi-worker", "auto"], default="auto",
                   help="auto: multi-worker if TF_CONFIG lists >1 worker, else mirrored")
    p.add_argument("--num-cpu-devices", type=int, default=0,
                   help="split the CPU into N logical devices (mirrored, no GPU)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--global-batch-size", type=int, default=64)
    p.add_argument("--num-train", type=int, default=8000)
    p.add_argument("--num-test", type=int, default=1000)
    p.add_argument("--sequence-length", type=int, default=32)
    p.add_argument("--embedding-dim", type=int, default=32)
    p.add_argument("--num-heads", type=int, default=2)
    p.add_argument("--intermediate-dim", type=int, default=64)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--learning-rate", type=float, default=2e-3)
    p.add_argument("--optimizer", choices=["adam", "sgd"], default="adam")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mixed-precision", action="store_true", help="mixed_float16 policy")
    p.add_argument("--jit-compile", action="store_true")
    p.add_argument("--deterministic", action="store_true",
                   help="tf.config.experimental.enable_op_determinism()")
    p.add_argument("--use-fit", action="store_true",
                   help="Keras model.fit instead of the Trainer (MirroredStrategy only)")
    p.add_argument("--checkpoint-dir", default=None)
    p.add_argument("--checkpoint-every", type=int, default=50)
    p.add_argument("--log-dir", default=None, help="TensorBoard directory")
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--save-weights", default=None, help="write final weights to this .npz")
    p.add_argument("--output-dir", default="outputs/distributed_training",
                   help="exported models go here (chief only)")
    p.add_argument("--no-export", action="store_true", help="skip the export step")
    p.add_argument("--step-delay", type=float, default=0.0,
                   help="sleep after each step (seconds); for fault-injection tests")
    return p.parse_args(argv)


def export_model(model, vocab_size, args):
    """A float32 copy of `model` built outside any strategy, for export.

    The trained model's variables are MirroredVariables (and its layers may
    compute in float16 under --mixed-precision); the copy has plain float32
    variables holding the same values and accepts any length up to
    `--sequence-length`.
    """
    import keras
    import numpy as np

    from keras_attn.training import transformer_classifier

    policy = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy("float32")
    try:
        copy = transformer_classifier(
            vocab_size, args.sequence_length, embedding_dim=args.embedding_dim,
            num_heads=args.num_heads, intermediate_dim=args.intermediate_dim,
            dropout=args.dropout, dynamic_length=True,
        )
    finally:
        keras.mixed_precision.set_global_policy(policy)
    copy.set_weights([np.asarray(w, "float32") for w in model.get_weights()])
    return copy


def main(argv=None):
    args = parse_args(argv)
    import tensorflow as tf

    tf.get_logger().setLevel("ERROR")
    if args.strategy == "multi-worker" and len(
        json.loads(os.environ.get("TF_CONFIG", "{}") or "{}").get("cluster", {}).get("worker", [])
    ) < 1:
        sys.exit("--strategy multi-worker needs TF_CONFIG with a cluster (see --help).")
    if args.num_cpu_devices:
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * args.num_cpu_devices
        )
    if args.strategy == "multi-worker" or (
        args.strategy == "auto"
        and len(json.loads(os.environ.get("TF_CONFIG", "{}") or "{}").get("cluster", {}).get("worker", [])) > 1
    ):
        # Must be created before any other TensorFlow op runs.
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
    else:
        gpus = tf.config.list_logical_devices("GPU")
        devices = [d.name for d in (gpus or tf.config.list_logical_devices("CPU"))]
        strategy = tf.distribute.MirroredStrategy(devices=devices)

    import keras
    import numpy as np

    from keras_attn import data
    from keras_attn.training import Trainer, transformer_classifier

    keras.utils.set_random_seed(args.seed)
    if args.deterministic:
        tf.config.experimental.enable_op_determinism()
    if args.mixed_precision:
        keras.mixed_precision.set_global_policy("mixed_float16")
    print(f"strategy: {type(strategy).__name__}, replicas in sync: {strategy.num_replicas_in_sync}",
          flush=True)

    train_pairs = data.generate_reviews(args.num_train, seed=args.seed)
    test_pairs = data.generate_reviews(args.num_test, seed=args.seed + 1)
    vectorizer = data.make_vectorizer([t for t, _ in train_pairs],
                                      sequence_length=args.sequence_length)
    vocab_size = vectorizer.vocabulary_size()
    x_train = vectorizer(tf.constant([t for t, _ in train_pairs])).numpy().astype("int32")
    y_train = np.array([y for _, y in train_pairs], np.int32)
    x_test = vectorizer(tf.constant([t for t, _ in test_pairs])).numpy().astype("int32")
    y_test = np.array([y for _, y in test_pairs], np.int32)

    def make_dataset(batch_size, input_context=None):
        ds = tf.data.Dataset.from_tensor_slices((x_train, y_train))
        ds = ds.shuffle(len(x_train), seed=args.seed, reshuffle_each_iteration=True).repeat()
        return ds.batch(batch_size, drop_remainder=True).prefetch(tf.data.AUTOTUNE)

    with strategy.scope():
        model = transformer_classifier(
            vocab_size, args.sequence_length, embedding_dim=args.embedding_dim,
            num_heads=args.num_heads, intermediate_dim=args.intermediate_dim,
            dropout=args.dropout,
        )
        if args.optimizer == "adam":
            optimizer = keras.optimizers.Adam(args.learning_rate)
        else:
            optimizer = keras.optimizers.SGD(args.learning_rate)
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    start = time.perf_counter()
    if args.use_fit:
        if isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
            sys.exit("--use-fit does not work under MultiWorkerMirroredStrategy "
                     "(keras-team/keras#20585); drop it to use the Trainer.")
        jit_compile = args.jit_compile
        if jit_compile and strategy.num_replicas_in_sync > 1:
            # XLA cannot compile Keras's train step when the variables live on
            # several devices (keras-team/keras#19005); the Trainer can.
            print("model.fit cannot XLA-compile with more than one replica "
                  "(keras-team/keras#19005): running fit without jit_compile; "
                  "drop --use-fit to get XLA from keras_attn's Trainer.", flush=True)
            jit_compile = False
        with strategy.scope():
            model.compile(optimizer, loss, metrics=["accuracy"], jit_compile=jit_compile)
        # One "epoch" per log line so that the history shows the loss falling.
        history = model.fit(make_dataset(args.global_batch_size),
                            epochs=max(1, args.steps // args.log_every),
                            steps_per_epoch=min(args.log_every, args.steps), verbose=2)
        losses = history.history["loss"]
    else:
        with strategy.scope():
            metrics = [keras.metrics.SparseCategoricalAccuracy(name="accuracy")]
        trainer = Trainer(
            model, optimizer, loss, args.global_batch_size, strategy=strategy, metrics=metrics,
            checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.checkpoint_every,
            log_dir=args.log_dir, log_every=args.log_every, jit_compile=args.jit_compile,
        )
        resumed = trainer.restore()
        if resumed:
            print(f"resumed from checkpoint at step {resumed}", flush=True)
        on_step_end = (lambda step, loss: time.sleep(args.step_delay)) if args.step_delay else None
        trainer.fit(
            data.distributed_input_fn(make_dataset, args.global_batch_size),
            steps=args.steps, on_step_end=on_step_end,
        )
        losses = [v for _, v in trainer.history]
    elapsed = time.perf_counter() - start
    logits = model.predict(x_test, batch_size=256, verbose=0)
    accuracy = float(np.mean(np.argmax(logits, -1) == y_test))
    print(f"trained {args.steps} steps in {elapsed:.1f}s; test accuracy {accuracy:.4f}", flush=True)
    if args.save_weights:
        weights = {f"w{i}": np.asarray(w) for i, w in enumerate(model.get_weights())}
        weights["losses"] = np.asarray(losses, np.float64)
        weights["accuracy"] = np.asarray(accuracy)
        np.savez(args.save_weights, **weights)
    chief = strategy.cluster_resolver is None or strategy.cluster_resolver.task_id in (None, 0)
    if not args.no_export and chief:
        from keras_attn import export

        exported = export_model(model, vocab_size, args)
        gap = np.max(np.abs(exported.predict(x_test[:64], verbose=0) - logits[:64]))
        print(f"float32 export copy: max |copy - trained model| = {gap:.2e} on 64 test "
              "reviews", flush=True)
        second = x_test[8:11]
        width = int(np.flatnonzero((second != 0).any(axis=0)).max()) + 1
        samples = [{"token_ids": x_test[:8]}, {"token_ids": second[:, :width]}]
        export.export_all(exported, args.output_dir, sample_inputs=samples,
                          name="distributed_classifier", tflite_quantizations=(None, "dynamic"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
