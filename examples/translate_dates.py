"""Translate human-written dates to ISO 8601 with a Transformer encoder-decoder.

The model is `TokenAndPositionEmbedding` + 2 `TransformerEncoderBlock`s and
2 `TransformerDecoderBlock`s (keras_attn.training.seq2seq_transformer),
trained with teacher forcing on the `human_dates` tfds data set (generated
offline from a seed: "3rd of March 1999", "03/03/99", "mercredi 3 mars
1999", ... -> "1999-03-03"). It reports exact-match accuracy of greedy
decoding on the test split, decodes a few inputs and saves the
cross-attention heatmap of one example: each output digit attends to the
input characters it comes from. Then it exports the model (inputs of any
length up to the training length) to SavedModel, TFLite float32 and
dynamic-range int8, and ONNX in `--output-dir`, each checked against Keras on
test dates at two batch sizes and two lengths (`--no-export` skips this).

    python examples/translate_dates.py                      # ~3-5 min on 2 CPU cores
    python examples/translate_dates.py --num-train 2000 --epochs 1   # smoke run
"""

import argparse
import os
import sys

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
import keras_attn_cli  # noqa: E402

# Before TensorFlow is imported: hides its log lines (KERAS_ATTN_VERBOSE=1 shows them).
keras_attn_cli.quiet()

from keras_attn.training import quickstart  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    quickstart.add_dates_arguments(parser, epochs=4, num_train=20_000,
                                   output_dir="outputs/translate_dates")
    parser.add_argument("--heatmap-text", default="Wednesday, March 3, 1999",
                        help="input whose cross-attention is plotted")
    parser.add_argument("--min-accuracy", type=float, default=0.0,
                        help="exit with status 1 if test exact match is below this")
    parser.add_argument("--no-export", action="store_true", help="skip the export step")
    args = parser.parse_args(argv)

    import keras

    keras.utils.set_random_seed(args.seed)
    (train, validation, test), _, (source, target) = quickstart.load_dates_task(args)
    model, attention_model = quickstart.build_dates_model(
        args, source, target, dynamic_length=True
    )
    print(f"dates Transformer: {model.count_params():,} parameters")
    model.fit(train, validation_data=validation, epochs=args.epochs,
              verbose=quickstart.fit_verbosity(args.verbose), shuffle=False)

    encoder_inputs, targets = quickstart.test_arrays(test)
    accuracy, predictions = quickstart.evaluate_dates(model, encoder_inputs, targets, target)
    print(f"test exact-match accuracy: {accuracy:.4f} on {len(targets)} dates")
    quickstart.save_predictions(args.output_dir, encoder_inputs, targets, predictions)
    for i in range(5):
        print(f"  {source.decode(encoder_inputs[i])!r:34} -> {target.decode(predictions[i])}"
              f"   (truth {target.decode(targets[i])})")
    path = os.path.join(args.output_dir, "translate_dates_attention.png")
    output, _ = quickstart.save_attention_heatmap(
        attention_model, source, target, args.heatmap_text, path
    )
    print(f"{args.heatmap_text!r} -> {output}; cross-attention heatmap: {path}")
    if not args.no_export:
        from keras_attn import export

        samples = quickstart.dates_export_samples(
            encoder_inputs, predictions, target.token_to_id["[START]"]
        )
        export.export_all(model, args.output_dir, sample_inputs=samples,
                          name="translate_dates", tflite_quantizations=(None, "dynamic"))
    return 0 if accuracy >= args.min_accuracy else 1


if __name__ == "__main__":
    sys.exit(main())
