"""Text classification with TokenAndPositionEmbedding + TransformerEncoderBlock.

Offline by default: generated movie reviews whose label needs context
("the plot was not good" is negative; in "X, but Y" the clause after "but"
decides). With `--dataset imdb_reviews` (or another tfds data set with
train/test splits of (text, label)) it trains on the real data when the
machine can download it, and otherwise says so and falls back to the
generated reviews. Text is tokenised with `keras.layers.TextVectorization`
inside a `tf.data` pipeline (shuffle, cache, batch, prefetch AUTOTUNE).
At the end the classifier (inputs of any length up to `--sequence-length`) is
exported to SavedModel, TFLite float32 and dynamic-range int8, and ONNX in
`--output-dir`, each checked against Keras on test reviews at two batch sizes
and two lengths (`--no-export` skips this).

    python examples/text_classification.py                # < 1 min on 2 CPU cores
    python examples/text_classification.py --dataset imdb_reviews --sequence-length 256
"""

import argparse
import os
import sys

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
import keras_attn_cli  # noqa: E402

# Before TensorFlow is imported: hides its log lines (KERAS_ATTN_VERBOSE=1 shows them).
keras_attn_cli.quiet()


def export_samples(token_ids):
    """Two parity sets of real inputs: 8 rows at full length, 3 cut to their longest."""
    import numpy as np

    second = token_ids[8:11]
    width = int(np.flatnonzero((second != 0).any(axis=0)).max()) + 1
    return [{"token_ids": token_ids[:8]}, {"token_ids": second[:, :width]}]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dataset", default=None,
                   help="a tfds data set name (e.g. imdb_reviews); offline generated reviews if unset or unavailable")
    p.add_argument("--data-dir", default=None, help="tfds data_dir")
    p.add_argument("--num-train", type=int, default=8000)
    p.add_argument("--num-test", type=int, default=1000)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--sequence-length", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=5000)
    p.add_argument("--embedding-dim", type=int, default=32)
    p.add_argument("--num-heads", type=int, default=2)
    p.add_argument("--intermediate-dim", type=int, default=64)
    p.add_argument("--num-layers", type=int, default=1)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--learning-rate", type=float, default=2e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--verbose", type=int, default=2)
    p.add_argument("--output-dir", default="outputs/text_classification",
                   help="exported models go here")
    p.add_argument("--no-export", action="store_true", help="skip the export step")
    p.add_argument("--min-accuracy", type=float, default=0.0,
                   help="exit with status 1 if test accuracy is below this")
    args = p.parse_args(argv)

    import keras
    import numpy as np

    from keras_attn import data
    from keras_attn.training import transformer_classifier

    keras.utils.set_random_seed(args.seed)
    train, test, source = data.load_text_classification(
        args.dataset, num_train=args.num_train, num_test=args.num_test, seed=args.seed,
        data_dir=args.data_dir,
    )
    print(f"data: {source}")
    vectorizer = data.make_vectorizer(train.map(lambda x, y: x), max_tokens=args.max_tokens,
                                      sequence_length=args.sequence_length)
    train_ds = data.text_classification_pipeline(train, vectorizer, args.batch_size,
                                                 training=True, seed=args.seed)
    test_ds = data.text_classification_pipeline(test, vectorizer, 256)
    model = transformer_classifier(
        vectorizer.vocabulary_size(), args.sequence_length, embedding_dim=args.embedding_dim,
        num_heads=args.num_heads, intermediate_dim=args.intermediate_dim,
        num_layers=args.num_layers, dropout=args.dropout, dynamic_length=True,
    )
    model.compile(keras.optimizers.Adam(args.learning_rate),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    model.fit(train_ds, epochs=args.epochs, verbose=args.verbose, shuffle=False)
    _, accuracy = model.evaluate(test_ds, verbose=0)
    print(f"test accuracy: {accuracy:.4f}")
    examples = ["the acting was superb.", "the plot was not good.",
                "the music was great, but the ending was very dull."]
    probs = keras.ops.softmax(model.predict(vectorizer(np.array(examples)), verbose=0))
    for text, prob in zip(examples, np.asarray(probs)):
        print(f"  {text!r:55} positive: {prob[1]:.3f}")
    if not args.no_export:
        from keras_attn import export

        x_test = next(iter(test_ds))[0].numpy().astype("int32")
        export.export_all(model, args.output_dir, sample_inputs=export_samples(x_test),
                          name="text_classifier", tflite_quantizations=(None, "dynamic"))
    return 0 if accuracy >= args.min_accuracy else 1


if __name__ == "__main__":
    sys.exit(main())
