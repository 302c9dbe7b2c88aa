"""Dates -> ISO on a phone: train, export prefill/decode to TFLite, decode without Keras.

Trains a `keras_attn.generation.Seq2SeqLM` (Transformer encoder-decoder with a
key/value cache) on the offline `human_dates` tfds data set (through
`keras_attn.data`), then:

1. reports the test exact-match accuracy of Keras cached greedy decoding
   (`keras_attn.generation.greedy_search`);
2. exports a TFLite multi-signature model (`prefill`, `decode`; builtin ops
   only) with `keras_attn.runtimes.signatures`;
3. decodes the test inputs with the TFLite model alone: `tflite_greedy` below
   imports only NumPy and `ai_edge_litert` (no TensorFlow, Keras or
   keras_attn), the loop an app would run. It prints a few translations, the
   token-for-token agreement with Keras greedy and the TFLite accuracy;
4. does the same with ONNX `prefill.onnx` / `decode.onnx` and onnxruntime
   (`onnx_greedy`, NumPy + onnxruntime only), unless `--no-onnx`.

The signatures (see `keras_attn.runtimes.signatures`):

    prefill(token_ids (B, 1), encoder_ids (B, T_in))
        -> logits, cache, cross_cache, encoder_padding_mask
    decode(token_ids (B, 1), cache, index, cross_cache, encoder_padding_mask)
        -> logits, cache

    python examples/translate_dates_mobile.py           # a few minutes on 2 CPU cores
    python examples/translate_dates_mobile.py --num-train 2000 --epochs 1 --num-test 200

`--output-dir` receives `dates_prefill_decode.tflite`, `onnx/{prefill,decode}.onnx`
and `mobile_tokens.npz` (test inputs and the Keras / TFLite / ONNX tokens).
"""

import argparse
import json
import os
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")


def _greedy_with(prefill, decode, encoder_ids, start_id, max_length):
    """The shared NumPy loop; `prefill`/`decode` take and return dicts of arrays.

    Mirrors `keras_attn.generation.greedy_search` with a one-token prompt:
    prefill writes `[START]` at position 0, then each step feeds the token at
    position `i - 1` with `index = i - 1` and takes the argmax for position `i`.
    """
    import numpy as np

    batch = encoder_ids.shape[0]
    tokens = np.zeros((batch, max_length), np.int32)
    tokens[:, 0] = start_id
    out = prefill(token_ids=tokens[:, :1], encoder_ids=encoder_ids)
    if "valid" in out and not np.all(out["valid"]):
        raise ValueError("prefill flagged the request invalid (valid=False): encoder ids "
                         "outside the vocabulary")
    cache = out["cache"]
    cross = {"cross_cache": out["cross_cache"],
             "encoder_padding_mask": out["encoder_padding_mask"]}
    for i in range(1, max_length):
        out = decode(token_ids=tokens[:, i - 1:i], cache=cache,
                     index=np.array(i - 1, np.int32), **cross)
        # The exported signatures clamp bad ids/indices and say so in `valid`.
        if "valid" in out and not np.all(out["valid"]):
            raise ValueError(f"decode flagged step {i} invalid (valid=False)")
        cache = out["cache"]
        tokens[:, i] = np.argmax(out["logits"][:, 0], axis=-1)
    return tokens


def tflite_greedy(model_path, encoder_ids, start_id, max_length):
    """Greedy decoding with the TFLite model alone (NumPy + ai_edge_litert).

    The model's batch size is static: inputs are decoded in chunks of it (the
    last chunk padded with copies of its first row). Returns `(N, max_length)`
    int32 tokens, `[START]` first.
    """
    import numpy as np
    from ai_edge_litert.interpreter import Interpreter

    interpreter = Interpreter(model_path=model_path)
    prefill = interpreter.get_signature_runner("prefill")
    decode = interpreter.get_signature_runner("decode")
    batch = int(prefill.get_input_details()["encoder_ids"]["shape"][0])
    encoder_ids = np.asarray(encoder_ids, np.int32)
    results = []
    for begin in range(0, len(encoder_ids), batch):
        chunk = encoder_ids[begin:begin + batch]
        rows = len(chunk)
        if rows < batch:
            chunk = np.concatenate([chunk, np.repeat(chunk[:1], batch - rows, axis=0)])
        results.append(_greedy_with(prefill, decode, chunk, start_id, max_length)[:rows])
    return np.concatenate(results) if results else np.zeros((0, max_length), np.int32)


def onnx_runner(path):
    """An onnxruntime session as a function of keyword arrays returning a dict
    of arrays, like a TFLite signature runner."""
    import onnxruntime as ort

    session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]

    def run(**inputs):
        # An output named like an input carries `_out` (`cache_out`).
        return {n.removesuffix("_out"): v for n, v in zip(names, session.run(None, inputs))}

    return run


def onnx_greedy(prefill_path, decode_path, encoder_ids, start_id, max_length):
    """Greedy decoding with the ONNX models alone (NumPy + onnxruntime); dynamic batch."""
    import numpy as np

    return _greedy_with(onnx_runner(prefill_path), onnx_runner(decode_path),
                        np.asarray(encoder_ids, np.int32), start_id, max_length)


def _parse(argv):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--num-train", type=int, default=20_000, help="training pairs")
    parser.add_argument("--num-test", type=int, default=1000, help="test pairs")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--hidden-dim", type=int, default=64)
    parser.add_argument("--num-heads", type=int, default=4)
    parser.add_argument("--num-key-value-heads", type=int, default=None,
                        help="grouped-query attention: fewer key/value heads (smaller cache)")
    parser.add_argument("--intermediate-dim", type=int, default=128)
    parser.add_argument("--num-layers", type=int, default=2,
                        help="encoder blocks and decoder blocks (each)")
    parser.add_argument("--position", default="learned",
                        choices=("sinusoidal", "learned", "rotary"))
    parser.add_argument("--learning-rate", type=float, default=2e-3)
    parser.add_argument("--tflite-batch-size", type=int, default=1,
                        help="static batch of the TFLite model (1, as on a phone)")
    parser.add_argument("--no-onnx", action="store_true", help="skip the ONNX export and run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data-dir", default=os.path.join("~", "tensorflow_datasets"),
                        help="where tfds writes the generated data set")
    parser.add_argument("--output-dir", default="outputs/translate_dates_mobile",
                        help="exported models and mobile_tokens.npz go here")
    parser.add_argument("--verbose", type=int, default=1, help="Keras fit verbosity (1 = bar)")
    return parser.parse_args(argv)


def main(argv=None):
    args = _parse(argv)
    # Here, not at import: the NumPy decoding loops above must import without
    # TensorFlow. Before TensorFlow is imported: hides its log lines
    # (KERAS_ATTN_VERBOSE=1 shows them).
    import keras_attn_cli

    keras_attn_cli.quiet()
    import keras
    import numpy as np
    import tensorflow as tf

    from keras_attn import data
    from keras_attn.data import dates
    from keras_attn.data.pipelines import START_TOKEN
    from keras_attn.generation import Seq2SeqLM, greedy_search
    from keras_attn.runtimes import signatures as gen_export

    # Saving signatures warns about the tokenizers' lookup tables (harmless noise).
    tf.get_logger().setLevel("ERROR")
    keras.utils.set_random_seed(args.seed)
    os.makedirs(args.output_dir, exist_ok=True)
    train, _, test = data.load_dates(
        num_train=args.num_train, num_validation=max(1, args.num_test // 2),
        num_test=args.num_test, seed=args.seed, data_dir=os.path.expanduser(args.data_dir),
    )
    source, target = data.dates_tokenizers()
    start_id = target.token_to_id[START_TOKEN]
    max_input = dates.MAX_INPUT_LENGTH
    max_length = dates.TARGET_LENGTH + 1  # [START] + "YYYY-MM-DD"

    def as_pairs(x, y):
        return (x["encoder_inputs"], x["decoder_inputs"]), y

    train_ds = data.dates_pipeline(train, args.batch_size, training=True,
                                   seed=args.seed).map(as_pairs)
    test_pairs = [(ex["text"].decode(), ex["iso"].decode()) for ex in test.as_numpy_iterator()]
    encoder_ids, _, targets = data.dates_arrays(test_pairs, max_input)

    # One vocabulary for both sides: the source alphabet is the larger one.
    model = Seq2SeqLM(
        max(source.vocabulary_size, target.vocabulary_size), max_input, args.hidden_dim,
        num_layers=args.num_layers, num_heads=args.num_heads,
        intermediate_dim=args.intermediate_dim, num_key_value_heads=args.num_key_value_heads,
        position=args.position,
    )
    model.compile(
        optimizer=keras.optimizers.Adam(args.learning_rate),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    model((encoder_ids[:1], np.full((1, max_length - 1), start_id, np.int32)))
    print(f"Seq2SeqLM: {model.count_params():,} parameters")
    began = time.perf_counter()
    model.fit(train_ds, epochs=args.epochs, verbose=args.verbose, shuffle=False)
    print(f"trained in {time.perf_counter() - began:.0f} s")

    start = np.full((len(encoder_ids), 1), start_id, np.int32)
    began = time.perf_counter()
    keras_tokens = greedy_search(model, start, max_length, encoder_ids=encoder_ids).numpy()
    keras_seconds = time.perf_counter() - began
    keras_accuracy = float(np.mean(np.all(keras_tokens[:, 1:] == targets, axis=1)))
    print(f"Keras cached greedy: test exact match {keras_accuracy:.4f} on {len(targets)} "
          f"dates ({keras_seconds:.1f} s, one batch)")

    tflite_path = os.path.join(args.output_dir, "dates_prefill_decode.tflite")
    began = time.perf_counter()
    gen_export.export_tflite(model, tflite_path, max_length=max_length,
                             batch_size=args.tflite_batch_size, prompt_length=1,
                             encoder_length=max_input)
    print(f"TFLite prefill/decode: {tflite_path} ({os.path.getsize(tflite_path) / 1024:.0f} KiB, "
          f"exported in {time.perf_counter() - began:.0f} s)")

    began = time.perf_counter()
    tflite_tokens = tflite_greedy(tflite_path, encoder_ids, start_id, max_length)
    tflite_seconds = time.perf_counter() - began
    summary = {"keras_accuracy": keras_accuracy, "num_test": len(targets)}
    outputs = {"encoder_ids": encoder_ids, "targets": targets, "keras": keras_tokens,
               "tflite": tflite_tokens}
    runtimes = [("TFLite", tflite_tokens, tflite_seconds)]
    for i in range(5):
        print(f"  {test_pairs[i][0]!r:34} -> TFLite {target.decode(tflite_tokens[i])}   "
              f"(truth {test_pairs[i][1]})")

    if not args.no_onnx:
        onnx_dir = os.path.join(args.output_dir, "onnx")
        began = time.perf_counter()
        paths = gen_export.export_onnx(model, onnx_dir, max_length=max_length)
        print(f"ONNX prefill/decode: {onnx_dir} (exported in {time.perf_counter() - began:.0f} s)")
        began = time.perf_counter()
        onnx_tokens = onnx_greedy(paths["prefill"], paths["decode"], encoder_ids, start_id,
                                  max_length)
        runtimes.append(("ONNX", onnx_tokens, time.perf_counter() - began))
        outputs["onnx"] = onnx_tokens

    ok = True
    for name, tokens, seconds in runtimes:
        same_rows = float(np.mean(np.all(tokens == keras_tokens, axis=1)))
        same_tokens = float(np.mean(tokens == keras_tokens))
        accuracy = float(np.mean(np.all(tokens[:, 1:] == targets, axis=1)))
        print(f"{name} alone vs Keras greedy: {same_rows:.4f} of sequences and "
              f"{same_tokens:.4f} of tokens identical; {name} exact match {accuracy:.4f} "
              f"({seconds:.1f} s)")
        key = name.lower()
        summary.update({f"{key}_sequence_agreement": same_rows,
                        f"{key}_token_agreement": same_tokens, f"{key}_accuracy": accuracy})
        ok = ok and same_rows == 1.0
    np.savez(os.path.join(args.output_dir, "mobile_tokens.npz"), **outputs)
    with open(os.path.join(args.output_dir, "mobile_summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
