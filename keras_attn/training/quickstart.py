"""The quickstart: dates -> ISO with a small Transformer, end to end.

`keras-attn demo` (or `python examples/quickstart.py`) runs `main`: builds
the `human_dates` data set through tfds, trains a Transformer made of
`TokenAndPositionEmbedding` + `TransformerEncoderBlock` /
`TransformerDecoderBlock` with a progress bar, prints the exact-match test
accuracy and a few translations, writes a cross-attention heatmap PNG and,
when `keras_attn.export` is available, exports SavedModel, TFLite and ONNX
and prints each one's largest difference from Keras.

The helpers here (`load_dates_task`, `build_dates_model`, `evaluate_dates`,
`save_attention_heatmap`) are shared with `examples/translate_dates.py`.
"""

import argparse
import os
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def add_dates_arguments(parser, epochs, num_train, output_dir="outputs/demo"):
    """Size flags shared by the dates scripts."""
    parser.add_argument("--num-train", type=int, default=num_train, help="training pairs")
    parser.add_argument("--num-test", type=int, default=2000, help="test pairs")
    parser.add_argument("--epochs", type=int, default=epochs)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--embedding-dim", type=int, default=64)
    parser.add_argument("--num-heads", type=int, default=4)
    parser.add_argument("--intermediate-dim", type=int, default=128)
    parser.add_argument("--num-layers", type=int, default=2,
                        help="encoder blocks and decoder blocks (each)")
    parser.add_argument("--learning-rate", type=float, default=2e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data-dir", default=os.path.join("~", "tensorflow_datasets"),
                        help="where tfds writes the generated data set")
    parser.add_argument("--output-dir", default=output_dir,
                        help="the .keras model, PNG heatmap and exported models go here")
    parser.add_argument("--verbose", type=int, default=None,
                        help="Keras fit verbosity: 1 = progress bar, 2 = one line per "
                        "epoch (default: the bar on a terminal, a line per epoch when "
                        "the output goes to a file or a pipe)")
    return parser


def fit_verbosity(verbose=None, stream=None):
    """Keras `fit`'s `verbose`: `verbose` if given, else 1 (a progress bar) when
    `stream` (default stdout) is a terminal and 2 (one line per epoch) when it
    is a file or a pipe, where a bar's carriage returns and ANSI codes would
    fill the log with one long line per batch."""
    if verbose is not None:
        return verbose
    stream = sys.stdout if stream is None else stream
    isatty = getattr(stream, "isatty", None)
    return 1 if isatty is not None and isatty() else 2


def load_dates_task(args):
    """(train, validation, test) tf.data pipelines and the tokenizers, built through tfds."""
    from keras_attn import data
    from keras_attn.data.dates_tfds import quiet_tfds

    print(f"data: human_dates through tfds ({args.num_train} training pairs; generated "
          f"offline on the first run, then read from {args.data_dir})", flush=True)
    with quiet_tfds(verbose=os.environ.get("KERAS_ATTN_VERBOSE", "") not in ("", "0")):
        train, validation, test = data.load_dates(
            num_train=args.num_train, num_validation=max(1, args.num_test // 2),
            num_test=args.num_test, seed=args.seed, data_dir=os.path.expanduser(args.data_dir),
        )
    pipelines = (
        data.dates_pipeline(train, args.batch_size, training=True, seed=args.seed),
        data.dates_pipeline(validation, 256),
        data.dates_pipeline(test, 256),
    )
    return pipelines, test, data.dates_tokenizers()


def build_dates_model(args, source, target, dynamic_length=False):
    import keras

    from keras_attn.data import dates
    from keras_attn.training import seq2seq_transformer

    model, attention_model = seq2seq_transformer(
        source.vocabulary_size, target.vocabulary_size, dates.MAX_INPUT_LENGTH,
        dates.TARGET_LENGTH, embedding_dim=args.embedding_dim, num_heads=args.num_heads,
        intermediate_dim=args.intermediate_dim, num_encoder_layers=args.num_layers,
        num_decoder_layers=args.num_layers, name="dates_transformer",
        dynamic_length=dynamic_length,
    )
    # Warm up, then decay to zero: the last epoch settles instead of bouncing.
    total_steps = args.epochs * -(-args.num_train // args.batch_size)
    warmup = min(200, max(1, total_steps // 10))
    schedule = keras.optimizers.schedules.CosineDecay(
        0.0, decay_steps=max(1, total_steps - warmup), warmup_target=args.learning_rate,
        warmup_steps=warmup,
    )
    model.compile(
        optimizer=keras.optimizers.Adam(schedule),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=[keras.metrics.SparseCategoricalAccuracy(name="token_accuracy")],
    )
    return model, attention_model


def compile_notice():
    """A Keras callback printing, before the first step, that it compiles.

    The first step traces and compiles the training function (tens of seconds
    on a small CPU); Keras's bar meanwhile shows an ETA computed from it.
    """
    import keras

    class CompileNotice(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            print("training: the first step compiles the model (slow; the ETA of "
                  "step 1 counts it), later steps are fast", flush=True)

    return CompileNotice()


def test_arrays(test_pipeline):
    import numpy as np

    enc, targets = [], []
    for x, y in test_pipeline:
        enc.append(x["encoder_inputs"].numpy())
        targets.append(y.numpy())
    return np.concatenate(enc), np.concatenate(targets)


def evaluate_dates(model, encoder_inputs, targets, target_tokenizer):
    """Exact-match accuracy of greedy decoding, and the predicted ids."""
    import numpy as np

    from keras_attn.data.pipelines import START_TOKEN
    from keras_attn.generation.greedy import greedy_decode

    start_id = target_tokenizer.token_to_id[START_TOKEN]
    predictions = greedy_decode(model, encoder_inputs, start_id, targets.shape[1])
    return float(np.mean(np.all(predictions == targets, axis=1))), predictions


def save_predictions(output_dir, encoder_inputs, targets, predictions):
    """Writes `predictions.npz` (test inputs, target ids, greedy ids) for checking."""
    import numpy as np

    os.makedirs(output_dir, exist_ok=True)
    path = os.path.join(output_dir, "predictions.npz")
    np.savez(path, encoder_inputs=encoder_inputs, targets=targets, predictions=predictions)
    return path


def save_attention_heatmap(attention_model, source, target, text, path):
    """Plots cross-attention for `text` as a PNG; returns (decoded text, weights).

    `attention_model([enc, dec]) -> (logits, scores)` with scores
    `(B, heads, T_out, T_in)` (averaged over heads) or `(B, T_out, T_in)`.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    from keras_attn.data import dates
    from keras_attn.data.pipelines import START_TOKEN, dates_arrays
    from keras_attn.generation.greedy import greedy_decode
    from keras_attn.visualize import plot_attention

    enc, _, _ = dates_arrays([(text, "0000-00-00")])
    start_id = target.token_to_id[START_TOKEN]
    predicted = greedy_decode(attention_model, enc, start_id, dates.TARGET_LENGTH)
    dec = np.concatenate([[[start_id]], predicted[:, :-1]], axis=1).astype("int32")
    _, scores = attention_model([enc, dec], training=False)
    n = min(len(text), dates.MAX_INPUT_LENGTH)
    weights = np.asarray(scores, dtype="float32")[0]
    if weights.ndim == 3:  # (heads, T_out, T_in): average the heads
        weights = weights.mean(axis=0)
    weights = weights[:, :n]  # (T_out, T_in)
    output = target.decode(predicted[0])
    fig, ax = plt.subplots(figsize=(max(6, 0.32 * n), 4))
    plot_attention(weights, list(output), list(text[:n]), ax=ax,
                   title=f"cross-attention: {text!r} -> {output}")
    ax.set_xlabel("input characters")
    ax.set_ylabel("output characters")
    ax.tick_params(labelsize=10)
    plt.setp(ax.get_xticklabels(), rotation=0)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return output, weights


EXAMPLE_TEXTS = [
    "3rd of March 1999",
    "03/03/99",
    "Wednesday, March 3, 1999",
    "mercredi 17 juillet 2024",
    "5 de mayo de 1962",
    "Freitag, 9. November 1989",
]


def dates_export_samples(encoder_inputs, predictions, start_id, trim=True):
    """Two sample sets of real test dates for the exporters' parity checks.

    Decoder inputs are the greedy predictions shifted right behind the start
    token (what the model sees when decoding). The first set is 8 rows at the
    full padded length; with `trim` (dynamic-length models) the second set is
    3 rows cut to their longest input and 6 decoder steps, so parity is
    checked at two batch sizes and two sequence lengths, padding included.
    """
    import numpy as np

    start = np.full((len(predictions), 1), start_id, dtype="int32")
    dec = np.concatenate([start, predictions[:, :-1]], axis=1).astype("int32")
    enc = encoder_inputs.astype("int32")
    second_enc, second_dec = enc[8:11], dec[8:11]
    if trim:
        width = int(np.flatnonzero((second_enc != 0).any(axis=0)).max()) + 1
        second_enc, second_dec = second_enc[:, :width], second_dec[:, :6]
    return [
        {"encoder_inputs": enc[:8], "decoder_inputs": dec[:8]},
        {"encoder_inputs": second_enc, "decoder_inputs": second_dec},
    ]


def export_all(model, output_dir, sample_inputs):
    """Exports through `keras_attn.export.export_all` if importable; prints each report."""
    try:
        from keras_attn import export
    except ImportError as error:
        print(f"export skipped: keras_attn.export is not available ({error})")
        return {}
    return export.export_all(
        model, output_dir, sample_inputs=sample_inputs, name="dates", on_error="continue"
    )


def run(args, export=True):
    import keras

    keras.utils.set_random_seed(args.seed)
    begin = time.perf_counter()
    (train, validation, test), _, (source, target) = load_dates_task(args)
    print(f"data: ready in {time.perf_counter() - begin:.1f}s", flush=True)
    model, attention_model = build_dates_model(args, source, target)
    model.fit(train, validation_data=validation, epochs=args.epochs,
              verbose=fit_verbosity(args.verbose), shuffle=False,
              callbacks=[compile_notice()])  # the pipeline shuffles (seeded)
    trained = time.perf_counter()
    print(f"trained in {trained - begin:.1f}s")
    os.makedirs(args.output_dir, exist_ok=True)
    model_path = os.path.join(args.output_dir, "dates.keras")
    model.save(model_path)
    print(f"model: {model_path} (load with `import keras_attn` first)")
    encoder_inputs, targets = test_arrays(test)
    accuracy, predictions = evaluate_dates(model, encoder_inputs, targets, target)
    print(f"test exact-match accuracy: {accuracy:.4f} ({len(targets)} dates)")
    save_predictions(args.output_dir, encoder_inputs, targets, predictions)
    from keras_attn.data.pipelines import dates_arrays

    enc, _, _ = dates_arrays([(t, "0000-00-00") for t in EXAMPLE_TEXTS])
    from keras_attn.generation.greedy import greedy_decode

    decoded = greedy_decode(model, enc, target.token_to_id["[START]"], targets.shape[1])
    for text, ids in zip(EXAMPLE_TEXTS, decoded):
        print(f"  {text!r:32} -> {target.decode(ids)}")
    heatmap = os.path.join(args.output_dir, "dates_attention.png")
    save_attention_heatmap(attention_model, source, target, EXAMPLE_TEXTS[2], heatmap)
    print(f"attention heatmap: {heatmap}")
    reports = {}
    if export:
        dec = predictions.copy()
        dec[:, 1:] = predictions[:, :-1]
        dec[:, 0] = target.token_to_id["[START]"]
        samples = [
            {"encoder_inputs": encoder_inputs[:8], "decoder_inputs": dec[:8]},
            {"encoder_inputs": encoder_inputs[8:11], "decoder_inputs": dec[8:11]},
        ]
        print("export: SavedModel, TFLite and ONNX, each run and compared with Keras ...",
              flush=True)
        reports = export_all(model, args.output_dir, samples)
        if "saved_model" in reports:
            write_serving_examples(args.output_dir, samples[0])
            print(serving_commands(args.output_dir))
    print(f"total {time.perf_counter() - begin:.1f}s")
    return {"accuracy": accuracy, "heatmap": heatmap, "reports": reports, "model": model_path}


def write_serving_examples(output_dir, sample):
    """Real test inputs for the serving commands: `example_inputs.npz`, `request.json`."""
    import json

    import numpy as np

    from keras_attn.export import rest_predict_body

    rows = {k: np.asarray(v[:2], dtype="int32") for k, v in sample.items()}
    np.savez(os.path.join(output_dir, "example_inputs.npz"), **rows)
    with open(os.path.join(output_dir, "request.json"), "w") as handle:
        json.dump(rest_predict_body(rows), handle)


def serving_commands(output_dir, name="dates"):
    """The commands that inspect and serve the demo's SavedModel (as in the docs)."""
    base = f"{output_dir}/saved_model/{name}"
    return (
        "serve it with TF Serving (REST on :8501, gRPC on :8500):\n"
        f'  docker run --rm -p 8500:8500 -p 8501:8501 -v "$PWD/{base}:/models/{name}" '
        f"-e MODEL_NAME={name} tensorflow/serving\n"
        f"  curl -X POST http://localhost:8501/v1/models/{name}:predict -d @{output_dir}/request.json\n"
        "run it without a server:\n"
        f"  saved_model_cli run --dir {base}/1 --tag_set serve --signature_def serving_default "
        f"--inputs 'encoder_inputs={output_dir}/example_inputs.npz[encoder_inputs];"
        f"decoder_inputs={output_dir}/example_inputs.npz[decoder_inputs]'"
    )


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="keras-attn demo", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_dates_arguments(parser, epochs=3, num_train=20_000)
    parser.add_argument("--no-export", action="store_true", help="skip the export step")
    args = parser.parse_args(argv)
    result = run(args, export=not args.no_export)
    return 0 if result["accuracy"] >= 0 else 1


if __name__ == "__main__":
    sys.exit(main())
