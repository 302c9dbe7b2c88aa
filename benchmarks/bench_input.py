"""Variable-length training input: fixed padding vs pad-to-batch vs length buckets.

A text classifier built from our layers (`training.recipes.transformer_classifier`,
`dynamic_length=True`) trains with `model.fit` on the same examples batched by
`keras_attn.data.batch_and_pad` four ways:

- `fixed`: every batch padded to the longest possible sequence (one shape);
- `batch`: padded to the longest sequence of each batch (many shapes);
- `buckets`: grouped by length (`bucket_by_sequence_length`), padded to the
  longest in each batch (many shapes, little padding);
- `buckets_boundary`: grouped by length and padded to the bucket's boundary
  (`pad_to_bucket_boundary=True`: a handful of shapes, little padding).

Lengths are long-tailed (log-normal, like sentences): most examples are short,
a few are long, so padding everything to the maximum wastes most of the work.
For graph mode and XLA (`jit_compile=True`) it reports the first epoch (which
includes tracing and, under XLA, one compilation per new input shape: Keras'
train function uses `reduce_retracing=True`, but XLA still compiles each
shape) and the median of later epochs, run interleaved (one epoch of each
pipeline per round), plus the fraction of padded tokens and the number of
distinct batch shapes over all epochs (the examples are reshuffled every epoch). Ratios are against `fixed` in the same mode.

    python benchmarks/bench_input.py --markdown input.md
"""

import argparse
import json
import time

import _common  # noqa: F401  (sets the environment first)
import results_file  # noqa: E402

MAX_LENGTH = 256
BOUNDARIES = (32, 64, 128, 256)
PIPELINES = ("fixed", "batch", "buckets", "buckets_boundary")


def make_examples(num_examples, seed=0):
    """Token ids (1..999) of log-normal lengths in [4, MAX_LENGTH], and labels."""
    import numpy as np

    rng = np.random.default_rng(seed)
    lengths = np.clip(np.round(rng.lognormal(np.log(40.0), 0.7, num_examples)), 4, MAX_LENGTH)
    rows = [rng.integers(1, 1000, size=int(n)).astype("int32") for n in lengths]
    labels = np.array([int(r[0] % 2) for r in rows], dtype="int32")
    return rows, labels


def make_dataset(rows, labels, pipeline, batch_size):
    import tensorflow as tf

    from keras_attn.data import batch_and_pad

    ds = tf.data.Dataset.from_generator(
        lambda: zip(rows, labels),
        output_signature=(tf.TensorSpec((None,), tf.int32), tf.TensorSpec((), tf.int32)),
    ).cache()
    # Reshuffled every epoch, as in real training: pad-to-batch and plain
    # buckets then meet new batch widths epoch after epoch.
    ds = ds.shuffle(len(rows), seed=0, reshuffle_each_iteration=True)
    common = dict(batch_size=batch_size, bucket_boundaries=BOUNDARIES,
                  length_fn=lambda x, y: tf.shape(x)[0])
    if pipeline == "fixed":
        ds = batch_and_pad(ds, batch_size, padding="fixed", lengths=([MAX_LENGTH], []))
    elif pipeline == "batch":
        ds = batch_and_pad(ds, batch_size, padding="batch")
    elif pipeline == "buckets":
        ds = batch_and_pad(ds, padding="buckets", **common)
    else:
        ds = batch_and_pad(ds, padding="buckets", pad_to_bucket_boundary=True, **common)
    return ds.prefetch(tf.data.AUTOTUNE)


def build_model(jit):
    import keras

    from keras_attn.training.recipes import transformer_classifier

    keras.utils.set_random_seed(0)
    model = transformer_classifier(
        1000, MAX_LENGTH, embedding_dim=64, num_heads=4, intermediate_dim=128,
        num_layers=2, dropout=0.0, dynamic_length=True,
    )
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=jit,
    )
    return model


def batch_stats(dataset, epochs):
    """(distinct batch shapes over `epochs` passes, fraction of padded tokens, real tokens per epoch)."""
    shapes, real, total = set(), 0, 0
    for _ in range(epochs):
        for x, _ in dataset:
            shapes.add(tuple(x.shape))
            real += int((x.numpy() != 0).sum())
            total += int(x.shape[0] * x.shape[1])
    return len(shapes), 1.0 - real / total, real // epochs


def run(num_examples, batch_size, rounds, modes):
    import numpy as np

    rows, labels = make_examples(num_examples)
    results = []
    for mode in modes:
        datasets = {p: make_dataset(rows, labels, p, batch_size) for p in PIPELINES}
        models = {p: build_model(jit=(mode == "xla")) for p in PIPELINES}
        first = {}
        for p in PIPELINES:
            start = time.perf_counter()
            models[p].fit(datasets[p], epochs=1, verbose=0)
            first[p] = time.perf_counter() - start
        samples = {p: [] for p in PIPELINES}
        for r in range(rounds):
            order = PIPELINES[r % len(PIPELINES):] + PIPELINES[: r % len(PIPELINES)]
            for p in order:
                start = time.perf_counter()
                models[p].fit(datasets[p], epochs=1, verbose=0)
                samples[p].append(time.perf_counter() - start)
        for p in PIPELINES:
            # The same number of passes as the model saw (shuffle seeds repeat
            # for a new iterator, so these are the shapes it was given).
            shapes, padded, real = batch_stats(make_dataset(rows, labels, p, batch_size), rounds + 1)
            epoch = float(np.median(samples[p]))
            row = {
                "mode": mode, "pipeline": p, "shapes": shapes, "padded_fraction": padded,
                "first_epoch_s": first[p], "epoch_s": epoch, "real_tokens_per_s": real / epoch,
            }
            results.append(row)
            print(json.dumps(row), flush=True)
        base = {r["pipeline"]: r for r in results if r["mode"] == mode}["fixed"]
        for r in results:
            if r["mode"] == mode:
                r["speedup_vs_fixed"] = base["epoch_s"] / r["epoch_s"]
                r["first_speedup_vs_fixed"] = base["first_epoch_s"] / r["first_epoch_s"]
    return results


def to_markdown(rows, num_examples, batch_size):
    header = ["mode", "pipeline", "batch shapes (all epochs)", "padded tokens", "first epoch s",
              "first epoch: fixed / this", "later epoch s (median)", "later epoch: fixed / this",
              "real tokens/s"]
    body = [
        [r["mode"], r["pipeline"], str(r["shapes"]), f"{100 * r['padded_fraction']:.0f}%",
         f"{r['first_epoch_s']:.1f}", f"{r['first_speedup_vs_fixed']:.2f}x", f"{r['epoch_s']:.2f}",
         f"{r['speedup_vs_fixed']:.2f}x", f"{r['real_tokens_per_s']:.0f}"]
        for r in rows
    ]
    return (f"Text classifier from our layers (2 encoder blocks, d=64, 4 heads, FFN 128), "
            f"{num_examples} examples of log-normal length (median 40, max {MAX_LENGTH}), "
            f"batch {batch_size}, `model.fit`; bucket boundaries {BOUNDARIES}. "
            "\"first epoch\" includes tracing (and XLA compilations); later epochs are "
            "interleaved rounds.\n\n" + _common.markdown_table(header, body))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--modes", nargs="+", default=["graph", "xla"], choices=["graph", "xla"])
    parser.add_argument("--json", help="write the raw rows to this file")
    parser.add_argument("--markdown")
    results_file.add_argument(parser, "input")
    args = parser.parse_args(argv)
    results_file.start(args)
    rows = run(args.examples, args.batch_size, args.rounds, args.modes)
    _common.emit(to_markdown(rows, args.examples, args.batch_size), args, rows=rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
