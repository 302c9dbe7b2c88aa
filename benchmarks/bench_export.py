"""Exported inference: batch-1 latency of the same encoder classifier, ours vs KerasHub.

The classifier: token + learned position embedding (vocab 1000, T=64,
d=128), 2 post-norm encoder blocks (4 heads, FFN 256), mean pooling, a
2-way dense head; once from keras_attn layers and once from KerasHub layers
(same weight counts, checked). Both are converted the same way, from one
SavedModel serving signature with a `(1, 64)` int32 input, by
`keras_attn.export`: to TFLite (builtin ops only, run by LiteRT with its
default XNNPACK delegate, 2 threads) and to ONNX (`tf2onnx`, opset 17, run
by onnxruntime on CPU, 2 intra-op threads). Outputs are checked against Keras (1e-4), then the two
models are timed interleaved; medians of `--repeats` rounds of `--calls`
calls.

    python benchmarks/bench_export.py --markdown export.md
"""

import argparse
import json
import sys
import time

import _common  # noqa: E402  (sets the environment first)
import results_file  # noqa: E402

VOCAB, LENGTH, DIM, HEADS, FFN, LAYERS = 1000, 64, 128, 4, 256, 2


def build(impl):
    import keras

    keras.utils.set_random_seed(0)
    tokens = keras.Input((LENGTH,), batch_size=1, dtype="int32", name="tokens")
    if impl == "ours":
        from keras_attn.layers import TokenAndPositionEmbedding
        from keras_attn.layers import TransformerEncoderBlock

        x = TokenAndPositionEmbedding(VOCAB, LENGTH, DIM, position="learned")(tokens)
        for _ in range(LAYERS):
            x = TransformerEncoderBlock(num_heads=HEADS, intermediate_dim=FFN)(x)
    else:
        import keras_hub

        x = keras_hub.layers.TokenAndPositionEmbedding(VOCAB, LENGTH, DIM)(tokens)
        for _ in range(LAYERS):
            x = keras_hub.layers.TransformerEncoder(intermediate_dim=FFN, num_heads=HEADS)(x)
    x = keras.layers.GlobalAveragePooling1D()(x)
    out = keras.layers.Dense(2)(x)
    return keras.Model(tokens, out)


def convert(model):
    """TFLite and ONNX bytes, through keras_attn.export (SavedModel -> converters)."""
    from keras_attn.export import onnx as onnx_export
    from keras_attn.export import tflite as tflite_export

    tflite_bytes, _ = tflite_export.convert(model)
    onnx_model = onnx_export.convert(model, opset=17)
    return tflite_bytes, onnx_model.SerializeToString()


class _TFLiteRunner:
    def __init__(self, content):
        from ai_edge_litert import interpreter as litert

        self.interp = litert.Interpreter(model_content=content, num_threads=2)
        self.interp.allocate_tensors()
        self.inp = self.interp.get_input_details()[0]["index"]
        self.out = self.interp.get_output_details()[0]["index"]

    def __call__(self, tokens):
        self.interp.set_tensor(self.inp, tokens)
        self.interp.invoke()
        return self.interp.get_tensor(self.out)


class _OnnxRunner:
    def __init__(self, content):
        self.session = _common.ort_session(content)
        self.name = self.session.get_inputs()[0].name

    def __call__(self, tokens):
        return self.session.run(None, {self.name: tokens})[0]


def run(repeats, calls):
    import numpy as np

    tokens = np.random.default_rng(0).integers(1, VOCAB, size=(1, LENGTH)).astype("int32")
    models = {impl: build(impl) for impl in ("ours", "keras_hub")}
    counts = {impl: m.count_params() for impl, m in models.items()}
    if counts["ours"] != counts["keras_hub"]:
        raise RuntimeError(f"weight counts differ: {counts}")
    runners = {}
    sizes = {}
    for impl, model in models.items():
        expected = np.asarray(model(tokens))
        tflite_bytes, onnx_bytes = convert(model)
        sizes[impl] = {"tflite_kib": len(tflite_bytes) / 1024, "onnx_kib": len(onnx_bytes) / 1024}
        for fmt, runner in (("tflite", _TFLiteRunner(tflite_bytes)), ("onnx", _OnnxRunner(onnx_bytes))):
            _common.tolerance.assert_close(runner(tokens), expected, terms=256, err_msg=f"{impl} {fmt}")
            runners[(impl, fmt)] = runner
    rows = []
    for fmt in ("tflite", "onnx"):
        samples = {impl: [] for impl in models}
        for impl in models:
            for _ in range(20):
                runners[(impl, fmt)](tokens)
        for _ in range(repeats):
            for impl in models:
                f = runners[(impl, fmt)]
                start = time.perf_counter()
                for _ in range(calls):
                    f(tokens)
                samples[impl].append((time.perf_counter() - start) / calls)
        med = {impl: float(np.median(s)) * 1e3 for impl, s in samples.items()}
        row = {
            "format": fmt, "ours_ms": med["ours"], "hub_ms": med["keras_hub"],
            "ratio": med["keras_hub"] / med["ours"], "params": counts["ours"],
            "ours_kib": sizes["ours"][f"{fmt}_kib"], "hub_kib": sizes["keras_hub"][f"{fmt}_kib"],
        }
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def to_markdown(rows):
    header = ["format", "ours ms", "KerasHub ms", "KerasHub / ours", "ours KiB", "KerasHub KiB"]
    body = [[r["format"], f"{r['ours_ms']:.3f}", f"{r['hub_ms']:.3f}", f"{r['ratio']:.2f}x",
             f"{r['ours_kib']:.0f}", f"{r['hub_kib']:.0f}"] for r in rows]
    return (f"Encoder classifier, batch 1, T={LENGTH}, d={DIM}, {HEADS} heads, FFN {FFN}, "
            f"{LAYERS} blocks, {rows[0]['params']} weights each; ratio > 1 means ours is faster.\n\n"
            + _common.markdown_table(header, body))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--json", help="write the raw rows to this file")
    parser.add_argument("--markdown")
    results_file.add_argument(parser, "export")
    args = parser.parse_args(argv)
    results_file.start(args)
    rows = run(args.repeats, args.calls)
    text = to_markdown(rows)
    _common.emit(text, args, rows=rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
