"""Attend and caption: read a strip of 3-5 real handwritten digits, left to right.

Each strip places 3-5 of scikit-learn's real 8x8 digits side by side with
random gaps, a random start offset and vertical jitter. Train strips use only
train digits and test strips only held-out digits (`keras_attn.data.digits`).

Model: a small CNN turns the strip into a 5x14 feature map, flattened to 70
positions with learned position embeddings and contextualised by one
`TransformerEncoderBlock`; a `TransformerDecoderBlock` (causal self-attention
over the tokens emitted so far, cross-attention over the feature map) emits
the digits and an end token, greedily. The cross-attention (mean over heads)
of each step is where the model looked: the script reports sequence
exact-match accuracy and per-digit accuracy (next to the best constant
answer's) on the held-out strips, the attention centroid x-position
of every step (it should move left to right across the digits, and sit near
the digit being written), and saves `caption_attention.png` with one panel per
emitted token for one test strip.

The step model `(image, tokens so far) -> (next-token logits, cross-attention)`
is exported with `keras_attn.export` (SavedModel, TFLite builtins, ONNX),
parity checked on real strips and prefixes at two batch sizes and lengths.

    python examples/attend_and_caption.py                    # defaults, a few min on 2 cores
    python examples/attend_and_caption.py --train-strips 300 --epochs 1 --no-export
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

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_attn  # noqa: E402
from keras_attn.data import digits as digits_data  # noqa: E402

MAX_DIGITS = 5
MAX_TOKENS = MAX_DIGITS + 1  # digits + END
# Feature-map geometry: two 2x2 poolings in x, one in y.
POOL_X, POOL_Y = 4, 2


def build_models(args, height, width):
    """(train_model, step_model); both map (image, tokens) to per-token outputs.

    The train model returns logits `(B, T, vocab)`; the step model also returns
    the cross-attention `(B, T, rows*cols)` (mean over heads).
    """
    image = keras.Input((height, width, 1), name="image")
    tokens = keras.Input((None,), dtype="int32", name="tokens")
    dim = args.dim
    x = keras.layers.Conv2D(32, 3, padding="same", activation="relu", name="conv1")(image)
    x = keras.layers.Conv2D(32, 3, padding="same", activation="relu", name="conv2")(x)
    x = keras.layers.MaxPooling2D((2, 2), name="pool1")(x)
    x = keras.layers.Conv2D(dim, 3, padding="same", activation="relu", name="conv3")(x)
    x = keras.layers.MaxPooling2D((1, 2), name="pool2")(x)  # (B, rows, cols, dim)
    rows, cols = x.shape[1], x.shape[2]
    # Flatten column-major (position p = col * rows + row), so the 1-D
    # sinusoidal encoding of p is mostly an encoding of x: reading order.
    x = keras.layers.Permute((2, 1, 3), name="columns_first")(x)
    memory = keras.layers.Reshape((rows * cols, dim), name="to_sequence")(x)
    if args.positions == "sinusoidal":
        positions = keras_attn.SinusoidalPositionEncoding(name="grid_positions")(memory)
    else:
        positions = keras_attn.LearnedPositionEmbedding(rows * cols, name="grid_positions")(memory)
    memory = keras.layers.Add(name="add_positions")([memory, positions])
    for i in range(args.encoder_blocks):
        memory = keras_attn.TransformerEncoderBlock(
            num_heads=args.num_heads, intermediate_dim=2 * dim, dropout=args.dropout,
            normalize_first=args.pre_norm, name=f"encoder_{i}"
        )(memory)
    if args.pre_norm and args.encoder_blocks:  # pre-norm stacks end with a LayerNorm
        memory = keras.layers.LayerNormalization(name="encoder_norm")(memory)
    embedded = keras_attn.TokenAndPositionEmbedding(
        digits_data.VOCABULARY_SIZE, MAX_TOKENS, dim, name="token_embedding"
    )(tokens)
    # With two blocks, the first block's cross-attention outputs at earlier
    # steps (which carry the positions they looked at) reach the second
    # block's self-attention: "where did I read the previous digit".
    decoded = embedded
    for i in range(args.decoder_blocks):
        decoded, scores = keras_attn.TransformerDecoderBlock(
            num_heads=args.num_heads, intermediate_dim=2 * dim, dropout=args.dropout,
            normalize_first=args.pre_norm, name=f"decoder_{i}"
        )(decoded, memory, return_attention_scores=True)
    if args.pre_norm:
        decoded = keras.layers.LayerNormalization(name="decoder_norm")(decoded)
    logits = keras.layers.Dense(digits_data.VOCABULARY_SIZE, name="logits")(decoded)
    # (B, H, T, rows*cols) -> mean over heads
    attention = keras.layers.Identity(name="attention")(
        keras.ops.mean(scores["cross_attention"], axis=1)
    )
    train_model = keras.Model([image, tokens], logits, name="captioner")
    step_model = keras.Model([image, tokens], [logits, attention], name="caption_step")
    return train_model, step_model, (rows, cols)


def make_data(args):
    split = digits_data.load_digits_split(args.test_fraction, seed=0)
    layout = dict(max_digits=MAX_DIGITS, max_gap=3, max_jitter=2, max_offset=4)
    train = digits_data.make_strips(
        split.x_train, split.y_train, args.train_strips, seed=1, **layout
    )
    test = digits_data.make_strips(split.x_test, split.y_test, args.test_strips, seed=2, **layout)
    return split, train, test


def greedy_caption(step_model, images, batch_size=256):
    """Greedy decoding; returns (tokens (N, MAX_TOKENS), attention (N, MAX_TOKENS, P))."""
    all_tokens, all_attention = [], []
    for start in range(0, len(images), batch_size):
        x = images[start : start + batch_size, ..., None]
        prefix = np.full((len(x), 1), digits_data.START, "int32")
        steps = []
        for _ in range(MAX_TOKENS):
            logits, attention = step_model([x, prefix], training=False)
            next_token = np.argmax(np.asarray(logits)[:, -1], axis=-1).astype("int32")
            steps.append(np.asarray(attention)[:, -1])
            prefix = np.concatenate([prefix, next_token[:, None]], axis=1)
        all_tokens.append(prefix[:, 1:])
        all_attention.append(np.stack(steps, axis=1))
    return np.concatenate(all_tokens), np.concatenate(all_attention)


def digit_accuracy(predicted, truth):
    """Share of the true digits read right at their position (a missing
    digit counts as wrong), and the same share for the best constant answer
    (the most frequent digit at each position): the floor to beat."""
    right = total = 0
    by_position = [[] for _ in range(MAX_DIGITS)]
    for p, t in zip(predicted, truth):
        t = [int(d) for d in t]
        right += sum(1 for i, d in enumerate(t) if i < len(p) and p[i] == d)
        total += len(t)
        for i, d in enumerate(t):
            by_position[i].append(d)
    constant = sum(np.bincount(ds, minlength=10).max() for ds in by_position if ds)
    return right / total, constant / total


def centroids_x(attention, grid):
    """x-centroid in pixels of each attention map `(..., rows*cols)`."""
    rows, cols = grid
    # column c of the feature map covers pixels [c*POOL_X, (c+1)*POOL_X)
    x_of_column = np.arange(cols) * POOL_X + (POOL_X - 1) / 2.0
    per_column = attention.reshape(attention.shape[:-1] + (cols, rows)).sum(axis=-1)
    return (per_column * x_of_column).sum(-1) / per_column.sum(-1)


def attention_report(tokens, attention, strips, grid):
    """Centroid statistics over the digit steps of every strip.

    Per strip, the steps that emitted a digit (up to the true length) give a
    centroid each; we report the mean centroid per step index, the mean
    step-to-step increase, the share of strips whose centroids strictly
    increase, and the mean distance to the centre of the true digit.
    """
    cx = centroids_x(attention, grid)  # (N, MAX_TOKENS)
    increases, monotone, distances = [], [], []
    by_step = [[] for _ in range(MAX_DIGITS)]
    for i, n in enumerate(strips.lengths):
        emitted = len(digits_data.decode_tokens(tokens[i]))
        k = min(n, emitted)
        if k < 2:
            continue
        c = cx[i, :k]
        for t in range(k):
            by_step[t].append(c[t])
        d = np.diff(c)
        increases.append(d.mean())
        monotone.append(bool(np.all(d > 0)))
        distances.append(np.abs(c - strips.centers_x[i, :k]).mean())
    return {
        "mean_centroid_x_per_step": [float(np.mean(s)) if s else None for s in by_step],
        "mean_true_center_x_per_step": [
            float(np.nanmean(strips.centers_x[:, t])) for t in range(MAX_DIGITS)
        ],
        "mean_step_increase_px": float(np.mean(increases)) if increases else float("nan"),
        "share_strictly_increasing": float(np.mean(monotone)) if monotone else float("nan"),
        "mean_distance_to_true_digit_px": float(np.mean(distances)) if distances else float("nan"),
        "strips_measured": len(increases),
    }


def plot_strip(image, tokens, attention, grid, true_digits, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, cols = grid
    emitted = digits_data.decode_tokens(tokens)
    num_panels = min(len(emitted) + 1, MAX_TOKENS)  # the digits and the end token
    cx = centroids_x(attention[:num_panels], grid)
    height, width = image.shape
    fig, axes = plt.subplots(num_panels, 1, figsize=(6, 1.25 * num_panels))
    axes = np.atleast_1d(axes)
    for t, ax in enumerate(axes):
        heat = attention[t].reshape(cols, rows).T
        ax.imshow(image, cmap="gray_r", extent=(0, width, height, 0))
        ax.imshow(
            heat, cmap="magma", alpha=0.55, extent=(0, cols * POOL_X, rows * POOL_Y, 0)
        )
        ax.axvline(cx[t], color="cyan", lw=1)
        token = str(emitted[t]) if t < len(emitted) else "<end>"
        ax.set_title(f"step {t + 1}: emits {token}  (centroid x={cx[t]:.1f})", fontsize=8)
        ax.set_xticks([])
        ax.set_yticks([])
    fig.suptitle(f"true {''.join(map(str, true_digits))} -> read {''.join(map(str, emitted))}")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def export_all(step_model, test, out_dir):
    from keras_attn import export

    images = test.images[..., None]
    inputs, _, _ = digits_data.encode_captions(test, MAX_DIGITS)
    samples = [
        {"image": images[:2], "tokens": inputs[:2, :1]},
        {"image": images[2:5], "tokens": inputs[2:5, :4]},
    ]
    reports = export.export_all(
        step_model, out_dir, sample_inputs=samples, name="caption_step", verbose=False
    )
    for report in reports.values():
        print(report)
    return reports


def parse_args(argv):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--train-strips", type=int, default=6000)
    p.add_argument("--test-strips", type=int, default=1000)
    p.add_argument("--epochs", type=int, default=15)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--learning-rate", type=float, default=2e-3)
    p.add_argument("--dim", type=int, default=64, help="model width")
    p.add_argument("--num-heads", type=int, default=2)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--encoder-blocks", type=int, default=1,
                   help="TransformerEncoderBlocks over the feature map (0: CNN features only)")
    p.add_argument("--decoder-blocks", type=int, default=1,
                   help="TransformerDecoderBlocks; the last one's cross-attention is shown")
    p.add_argument("--positions", choices=["learned", "sinusoidal"], default="learned",
                   help="positions of the feature-map cells (flattened column by column)")
    p.add_argument("--warmup", type=float, default=0.0, help="share of steps warming up")
    p.add_argument(
        "--pre-norm", action=argparse.BooleanOptionalAction, default=False,
        help="pre-norm Transformer blocks (x + f(LN(x))) instead of post-norm",
    )
    p.add_argument("--test-fraction", type=float, default=0.25)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-dir", default="outputs/attend_and_caption")
    p.add_argument("--no-export", action="store_true", help="skip the exports")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    os.makedirs(args.output_dir, exist_ok=True)
    keras.utils.set_random_seed(args.seed)
    split, train, test = make_data(args)
    height, width = train.images.shape[1:]
    print(
        f"strips {height}x{width}: {len(train.lengths)} train from {len(split.y_train)} "
        f"train digits, {len(test.lengths)} test from {len(split.y_test)} held-out digits"
    )
    train_model, step_model, grid = build_models(args, height, width)
    inputs, targets, weights = digits_data.encode_captions(train, MAX_DIGITS)
    steps = max(1, args.epochs * len(inputs) // args.batch_size)
    warmup = int(args.warmup * steps)
    schedule = keras.optimizers.schedules.CosineDecay(
        0.0 if warmup else args.learning_rate,
        steps - warmup,
        alpha=0.05,
        warmup_target=args.learning_rate if warmup else None,
        warmup_steps=warmup,
    )
    train_model.compile(
        optimizer=keras.optimizers.Adam(schedule),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        weighted_metrics=["accuracy"],
    )
    start = time.time()
    history = train_model.fit(
        [train.images[..., None], inputs],
        targets,
        sample_weight=weights,
        batch_size=args.batch_size,
        epochs=args.epochs,
        verbose=2,
    )
    print(f"trained in {time.time() - start:.0f}s")
    tokens, attention = greedy_caption(step_model, test.images)
    predicted = [digits_data.decode_tokens(t) for t in tokens]
    truth = test.sequences()
    exact = float(np.mean([p == list(map(int, t)) for p, t in zip(predicted, truth)]))
    digits, constant = digit_accuracy(predicted, truth)
    print(f"held-out strips: sequence exact match {exact:.4f}, digit accuracy {digits:.4f} "
          f"(best constant answer {constant:.4f}; {len(truth)} strips)")
    report = attention_report(tokens, attention, test, grid)
    fmt = lambda xs: ", ".join("-" if x is None else f"{x:.1f}" for x in xs)  # noqa: E731
    print(f"attention centroid x per step (px): {fmt(report['mean_centroid_x_per_step'])}")
    print(f"true digit centre x per step (px) : {fmt(report['mean_true_center_x_per_step'])}")
    print(
        f"mean step-to-step centroid move {report['mean_step_increase_px']:+.2f} px; "
        f"strictly left-to-right in {100 * report['share_strictly_increasing']:.1f}% of "
        f"{report['strips_measured']} strips; mean distance to the digit being written "
        f"{report['mean_distance_to_true_digit_px']:.2f} px"
    )
    png = os.path.join(args.output_dir, "caption_attention.png")
    example = int(np.argmax(test.lengths))  # a long strip
    plot_strip(test.images[example], tokens[example], attention[example], grid,
               truth[example], png)
    print(f"wrote {png}")
    summary = {
        "exact_match": exact,
        "digit_accuracy": digits,
        "digit_accuracy_best_constant": constant,
        "final_train_loss": float(history.history["loss"][-1]),
        "attention": report,
        "attention_png": png,
    }
    if not args.no_export:
        reports = export_all(step_model, test, args.output_dir)
        summary["export_max_abs_error"] = {k: r.max_abs_error for k, r in reports.items()}
        summary["export_paths"] = {k: r.path for k, r in reports.items()}
    with open(os.path.join(args.output_dir, "results.json"), "w") as f:
        json.dump(summary, f, indent=1)
    summary.update(
        step_model=step_model, split=split, train=train, test=test, tokens=tokens,
        attention_maps=attention, grid=grid,
    )
    return summary


if __name__ == "__main__":
    main(sys.argv[1:])
    sys.exit(0)
