"""Serving under load: concurrency, soak (RSS) and the cost of request checks.

One run, side by side:

1. Concurrency: one loaded SavedModel signature and one ONNX Runtime session,
   each called from `--threads` threads at once (released together by a
   barrier), `--calls` distinct requests per thread; the results must be
   identical (bitwise) to the same requests called one after another.
2. Soak: `--requests` requests through one TFLite interpreter (signature
   runner) and one ORT session; resident memory (RSS) after `--warmup`
   requests and at the end, growth in percent (the bar: < 5%).
3. Cost of the checks: SavedModel `serving_default` with `check_ids=True`
   vs False, and the generation `decode` signature with and without its
   checks (SavedModel asserts, TFLite clamp + `valid`), median latency of
   interleaved calls and their ratio.

    python benchmarks/bench_serving.py                  # 8 threads, 10,000 requests
    python benchmarks/bench_serving.py --requests 500 --calls 5   # quick

The model is a small Transformer text classifier (TokenAndPositionEmbedding,
2 encoder blocks) and, for decode, a small DecoderOnlyLM. The machine may be
shared: latencies are medians of interleaved calls, ratios are what to read.
"""

import argparse
import gc
import os
import statistics
import sys
import tempfile
import threading
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # imported by file path in tests
import results_file  # noqa: E402

VOCAB, LENGTH = 200, 32


def build_models(directory, seed=0):
    """Exports the classifier to SavedModel (checked and unchecked), TFLite and ONNX."""
    import keras

    from keras_attn import export
    from keras_attn.training import transformer_classifier

    keras.utils.set_random_seed(seed)
    model = transformer_classifier(VOCAB, LENGTH, embedding_dim=32, num_heads=2,
                                   intermediate_dim=64, num_layers=2, dropout=0.0,
                                   dynamic_length=True)
    samples = export.make_samples(model, shapes=((2, LENGTH), (3, 7)))
    paths = {
        "saved_model": export.export_saved_model(model, os.path.join(directory, "sm"),
                                                 sample_inputs=samples).path,
        "saved_model_unchecked": export.export_saved_model(
            model, os.path.join(directory, "sm_unchecked"), sample_inputs=samples,
            check_ids=False).path,
        "tflite": export.export_tflite(model, os.path.join(directory, "m.tflite"),
                                       sample_inputs=samples).path,
        "onnx": export.export_onnx(model, os.path.join(directory, "m.onnx"),
                                   sample_inputs=samples).path,
    }
    return model, paths


def requests(count, batch=4, seed=1):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        ids = rng.integers(1, VOCAB, size=(batch, LENGTH)).astype("int32")
        ids[1::2, rng.integers(4, LENGTH):] = 0
        out.append(ids)
    return out


def saved_model_runner(path):
    import tensorflow as tf

    loaded = tf.saved_model.load(path)
    fn = loaded.signatures["serving_default"]
    name = next(iter(fn.structured_input_signature[1]))
    out_name = next(iter(fn.structured_outputs))

    def run(ids):
        return fn(**{name: tf.constant(ids)})[out_name].numpy()

    run.keep = loaded
    return run


def onnx_runner(path):
    import onnxruntime as ort

    session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name

    def run(ids):
        return session.run(None, {name: ids})[0]

    return run


def tflite_runner(path):
    from ai_edge_litert.interpreter import Interpreter

    runner = Interpreter(model_path=path).get_signature_runner("serving_default")
    name = next(iter(runner.get_input_details()))

    def run(ids):
        return next(iter(runner(**{name: ids}).values()))

    return run


def concurrency(run, reqs, threads, calls):
    """`(identical, max_abs_diff, seconds)`: `threads` threads x `calls` requests at once
    vs the same requests one by one."""
    work = [reqs[t * calls:(t + 1) * calls] for t in range(threads)]
    sequential = [[run(x) for x in chunk] for chunk in work]
    concurrent = [None] * threads
    errors = []
    barrier = threading.Barrier(threads)

    def worker(t):
        try:
            barrier.wait()
            concurrent[t] = [run(x) for x in work[t]]
        except Exception as error:  # noqa: BLE001  reported below
            errors.append(error)

    pool = [threading.Thread(target=worker, args=(t,)) for t in range(threads)]
    start = time.perf_counter()
    for p in pool:
        p.start()
    for p in pool:
        p.join()
    seconds = time.perf_counter() - start
    if errors:
        raise errors[0]
    diffs = [float(np.max(np.abs(a - b))) for s, c in zip(sequential, concurrent)
             for a, b in zip(s, c)]
    identical = all(np.array_equal(a, b) for s, c in zip(sequential, concurrent)
                    for a, b in zip(s, c))
    return identical, max(diffs), seconds


def rss_bytes():
    import psutil

    return psutil.Process().memory_info().rss


def soak(run, reqs, total, warmup):
    """`(rss_after_warmup, rss_end, growth_percent, seconds)` over `total` requests."""
    for i in range(warmup):
        run(reqs[i % len(reqs)])
    gc.collect()
    before = rss_bytes()
    start = time.perf_counter()
    for i in range(total):
        run(reqs[i % len(reqs)])
    seconds = time.perf_counter() - start
    gc.collect()
    after = rss_bytes()
    return before, after, 100.0 * (after - before) / before, seconds


def interleaved(fns, args, repeats):
    """Median seconds per call of each fn, calls interleaved."""
    times = {k: [] for k in fns}
    for i in range(repeats):
        for k, fn in fns.items():
            x = args[i % len(args)]
            start = time.perf_counter()
            fn(x)
            times[k].append(time.perf_counter() - start)
    return {k: statistics.median(v) for k, v in times.items()}


def decode_check_costs(directory, repeats, seed=0):
    """Median decode latency with and without request checks (SavedModel, TFLite)."""
    import keras
    import tensorflow as tf
    from ai_edge_litert.interpreter import Interpreter

    from keras_attn.generation import DecoderOnlyLM
    from keras_attn.runtimes import signatures as gen_export

    keras.utils.set_random_seed(seed)
    lm = DecoderOnlyLM(VOCAB, 64, 64, num_layers=2, num_heads=4, intermediate_dim=128,
                       position="rotary")
    prompt = np.ones((1, 8), np.int32)
    lm(prompt)
    fns = {}
    for checks in ("assert", "none"):
        path = gen_export.export_saved_model(lm, os.path.join(directory, f"gen_{checks}"),
                                             max_length=64, checks=checks,
                                             include_generate=False)
        loaded = tf.saved_model.load(path)
        cache = loaded.signatures["prefill"](token_ids=tf.constant(prompt))["cache"]
        decode = loaded.signatures["decode"]
        fns[f"SavedModel decode checks={checks}"] = (
            lambda i, d=decode, c=cache, keep=loaded: d(
                token_ids=tf.constant([[i % VOCAB]], tf.int32), cache=c,
                index=tf.constant(8 + i % 50, tf.int32)))
    for checks in ("flag", "none"):
        content = gen_export.tflite_bytes(lm, max_length=64, batch_size=1, prompt_length=8,
                                          checks=checks)
        interpreter = Interpreter(model_content=content)
        cache = interpreter.get_signature_runner("prefill")(token_ids=prompt)["cache"]
        runner = interpreter.get_signature_runner("decode")
        fns[f"TFLite decode checks={checks}"] = (
            lambda i, r=runner, c=cache, keep=interpreter: r(
                token_ids=np.array([[i % VOCAB]], np.int32), cache=c,
                index=np.array(8 + i % 50, np.int32)))
    return interleaved(fns, list(range(50)), repeats)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--calls", type=int, default=25, help="requests per thread")
    parser.add_argument("--requests", type=int, default=10_000, help="soak requests")
    parser.add_argument("--warmup", type=int, default=500)
    parser.add_argument("--repeats", type=int, default=300, help="latency calls per variant")
    results_file.add_argument(parser, "serving")
    args = parser.parse_args(argv)
    results_file.start(args)

    with results_file.recording(args):
        results = {}
        with tempfile.TemporaryDirectory(prefix="bench_serving_") as tmp:
            _, paths = build_models(tmp)
            reqs = requests(max(args.threads * args.calls, 64))
            runners = {"SavedModel": saved_model_runner(paths["saved_model"]),
                       "ONNX Runtime": onnx_runner(paths["onnx"])}
            print(f"concurrency: {args.threads} threads x {args.calls} requests (batch 4, "
                  f"length {LENGTH}) vs sequential")
            for name, run in runners.items():
                identical, diff, seconds = concurrency(run, reqs, args.threads, args.calls)
                results[f"concurrency {name}"] = (identical, diff)
                print(f"- {name:14} identical={identical} max|concurrent - sequential|={diff:.3g} "
                      f"({seconds:.2f} s)", flush=True)
            soakers = {"TFLite": tflite_runner(paths["tflite"]), "ONNX Runtime": runners["ONNX Runtime"]}
            print(f"soak: {args.requests} requests after {args.warmup} warm-up requests")
            for name, run in soakers.items():
                before, after, growth, seconds = soak(run, reqs, args.requests, args.warmup)
                results[f"soak {name}"] = growth
                print(f"- {name:14} RSS {before / 2**20:.1f} MiB -> {after / 2**20:.1f} MiB "
                      f"({growth:+.2f}%), {1e3 * seconds / args.requests:.2f} ms/request",
                      flush=True)
            checked = saved_model_runner(paths["saved_model"])
            unchecked = saved_model_runner(paths["saved_model_unchecked"])
            medians = interleaved({"check_ids=True": checked, "check_ids=False": unchecked},
                                  reqs, args.repeats)
            ratio = medians["check_ids=True"] / medians["check_ids=False"]
            results["check_ids ratio"] = ratio
            print(f"SavedModel serving_default: check_ids=True {1e3 * medians['check_ids=True']:.3f} ms"
                  f", False {1e3 * medians['check_ids=False']:.3f} ms, ratio {ratio:.3f}")
            decode = decode_check_costs(tmp, args.repeats)
            for runtime, on in (("SavedModel", "assert"), ("TFLite", "flag")):
                a = decode[f"{runtime} decode checks={on}"]
                b = decode[f"{runtime} decode checks=none"]
                results[f"{runtime} decode ratio"] = a / b
                print(f"{runtime} decode (2 layers, cache 64): checks={on} {1e3 * a:.3f} ms, "
                      f"none {1e3 * b:.3f} ms, ratio {a / b:.3f}", flush=True)
        return results


if __name__ == "__main__":
    main()
    sys.exit(0)
