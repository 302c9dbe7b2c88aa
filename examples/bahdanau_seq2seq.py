"""The classic GRU encoder-decoder with additive (Bahdanau) attention, on dates.

A bidirectional GRU reads the characters of a human-written date; a GRU
decoder, fed the previous output character (teacher forcing), produces a
state per output step; keras_attn's `AdditiveAttention`
(`v^T tanh(W_q q + W_k k)`, Bahdanau et al. 2015) scores every encoder state
against each decoder state, and the context vector joins the decoder state to
predict the next character. (Attention is applied after the decoder GRU, as
in Luong et al. 2015, so the whole model is a plain functional graph.)

It trains on the `human_dates` tfds data set, reports exact-match accuracy
of greedy decoding on the test split and saves the attention heatmap, then
exports the model to SavedModel, TFLite float32 and dynamic-range int8, and
ONNX in `--output-dir`, each checked against Keras on test dates at two batch
sizes (`--no-export` skips this).

The GRUs are unrolled (`unroll=True`, fixed input and target lengths): the
same arithmetic as the default while-loop, but TFLite cannot convert a Keras
RNN loop with a dynamic batch size to builtin ops (its TensorList lowering
needs a static element shape: "'tf.TensorListReserve' op requires
element_shape to be static"; `keras_attn.export` reports it as an
UnsupportedOpsError), while an unrolled RNN is plain builtin ops. Masking
(padding) works the same either way.

    python examples/bahdanau_seq2seq.py                  # ~3-5 min on 2 CPU cores
    python examples/bahdanau_seq2seq.py --num-train 2000 --epochs 1
"""

import argparse
import os
import sys

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
import keras_attn_cli  # noqa: E402

# Before TensorFlow is imported: hides its log lines (KERAS_ATTN_VERBOSE=1 shows them).
keras_attn_cli.quiet()

from keras_attn.training import quickstart  # noqa: E402


def build_model(source_vocabulary, target_vocabulary, input_length, target_length,
                embedding_dim, units, unroll=True):
    """(model, attention_model) on `[encoder_inputs, decoder_inputs]`.

    `unroll=False` gives the while-loop GRUs: same outputs, and it accepts
    `None` lengths, but it does not convert to TFLite builtins.
    """
    import keras

    from keras_attn.layers import AdditiveAttention

    enc_in = keras.Input((input_length,), dtype="int32", name="encoder_inputs")
    dec_in = keras.Input((target_length,), dtype="int32", name="decoder_inputs")
    x = keras.layers.Embedding(source_vocabulary, embedding_dim, mask_zero=True)(enc_in)
    encoder = keras.layers.Bidirectional(
        keras.layers.GRU(units, return_sequences=True, return_state=True, unroll=unroll),
        name="encoder",
    )
    encoded, forward_state, backward_state = encoder(x)
    state = keras.layers.Dense(units, activation="tanh", name="bridge")(
        keras.layers.Concatenate()([forward_state, backward_state])
    )
    y = keras.layers.Embedding(target_vocabulary, embedding_dim, name="target_embedding")(dec_in)
    decoded = keras.layers.GRU(units, return_sequences=True, unroll=unroll, name="decoder")(
        y, initial_state=state
    )
    value_mask = keras.ops.not_equal(enc_in, 0)
    context, scores = AdditiveAttention(units, name="attention")(
        decoded, encoded, value_mask=value_mask, return_attention_scores=True
    )
    h = keras.layers.Concatenate()([decoded, context])
    h = keras.layers.Dense(units, activation="tanh", name="attentional_state")(h)
    logits = keras.layers.Dense(target_vocabulary, dtype="float32", name="logits")(h)
    model = keras.Model([enc_in, dec_in], logits, name="bahdanau_seq2seq")
    return model, keras.Model([enc_in, dec_in], [logits, scores])


def main(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    quickstart.add_dates_arguments(parser, epochs=4, num_train=20_000,
                                   output_dir="outputs/bahdanau_seq2seq")
    parser.add_argument("--units", type=int, default=64, help="GRU and attention size")
    parser.add_argument("--heatmap-text", default="Wednesday, March 3, 1999")
    parser.add_argument("--min-accuracy", type=float, default=0.0,
                        help="exit with status 1 if test exact match is below this")
    parser.add_argument("--no-export", action="store_true", help="skip the export step")
    args = parser.parse_args(argv)

    import keras

    from keras_attn.data import dates

    keras.utils.set_random_seed(args.seed)
    (train, validation, test), _, (source, target) = quickstart.load_dates_task(args)
    model, attention_model = build_model(
        source.vocabulary_size, target.vocabulary_size, dates.MAX_INPUT_LENGTH,
        dates.TARGET_LENGTH, args.embedding_dim, args.units,
    )
    model.compile(
        keras.optimizers.Adam(args.learning_rate),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=[keras.metrics.SparseCategoricalAccuracy(name="token_accuracy")],
    )
    model.fit(train, validation_data=validation, epochs=args.epochs,
              verbose=quickstart.fit_verbosity(args.verbose), shuffle=False)
    encoder_inputs, targets = quickstart.test_arrays(test)
    accuracy, predictions = quickstart.evaluate_dates(model, encoder_inputs, targets, target)
    print(f"test exact-match accuracy: {accuracy:.4f} on {len(targets)} dates")
    quickstart.save_predictions(args.output_dir, encoder_inputs, targets, predictions)
    for i in range(5):
        print(f"  {source.decode(encoder_inputs[i])!r:34} -> {target.decode(predictions[i])}")
    path = os.path.join(args.output_dir, "bahdanau_attention.png")
    output, _ = quickstart.save_attention_heatmap(
        attention_model, source, target, args.heatmap_text, path
    )
    print(f"{args.heatmap_text!r} -> {output}; attention heatmap: {path}")
    if not args.no_export:
        from keras_attn import export

        samples = quickstart.dates_export_samples(
            encoder_inputs, predictions, target.token_to_id["[START]"], trim=False
        )
        export.export_all(model, args.output_dir, sample_inputs=samples,
                          name="bahdanau_seq2seq", tflite_quantizations=(None, "dynamic"))
    return 0 if accuracy >= args.min_accuracy else 1


if __name__ == "__main__":
    sys.exit(main())
