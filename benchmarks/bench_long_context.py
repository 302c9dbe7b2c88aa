"""Long contexts: decode tokens/s at the same fill as the cache allocation grows.

One Hugging Face Llama (random weights, seeded; the tokenizer of
bench_genai.py), converted once and exported with `max_length` 512, 1024,
2048 and 4096: the TFLite `decode` signature (`tflite_bytes`, driven from
NumPy with the LiteRT interpreter's signature runner), the plain ONNX
`decode.onnx` (`onnx_models`, in onnxruntime), the SavedModel's `decode`
(`saved_model`: its traced function, called in process), the same exports'
`decode_step` (`tflite_step`, `onnx_step`, `saved_model_step`: the caller
keeps the cache and passes its first
slots, the filled ones rounded up to `keras_attn.runtimes.loop.STEP_BUCKET`,
as `greedy_loop(step=True)` does) and the `.litertlm` bundle
(`export_litertlm`, in `litert_lm.Engine`). Each decode is timed at a fill of
`--fills` tokens (the signatures: `--steps` consecutive decode calls from
`index = fill`; LiteRT-LM: a prompt of about `fill` tokens, then `--new`
greedy tokens, the engine's own decode counter), in rounds that alternate
the order of the lengths. Prints tokens/s per runtime, length and fill, and
each length's ratio to `max_length=512` (the target: >= 0.85 at fill 128 for
4096, issue 36; LiteRT-LM issue 2568 reports a peer bundle at 0.22).

    python benchmarks/bench_long_context.py                  # 8 layers, hidden 512, vocab 32000
    python benchmarks/bench_long_context.py --quick          # 2 layers, hidden 128, vocab 4000
    python benchmarks/bench_long_context.py --lengths 512 4096 --runtimes tflite litertlm
    python benchmarks/bench_long_context.py --runtimes tflite tflite_step onnx onnx_step --reads bounded

Needs `litert-lm-api` and `litert-lm-builder` for the bundle, onnxruntime and
tf2onnx for ONNX.
"""

import argparse
import atexit
import itertools
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common  # noqa: E402  (sets the environment first)
import results_file  # noqa: E402
from bench_genai import build_hf  # noqa: E402
from bench_litertlm import run_bundle  # noqa: E402

# "_step": the `decode_step` signature, driven as `greedy_loop(step=True)`
# drives it (the caller keeps the cache and passes its first slots).
RUNTIMES = ("tflite", "tflite_step", "onnx", "onnx_step", "saved_model", "saved_model_step",
            "litertlm")


def signature_decoder(step, cache_shape, cache_dtype, fill, steps):
    """A zero-argument function: `steps` decode calls from `index = fill`, the
    cache fed back each time (its contents do not change the work)."""
    rng = np.random.default_rng(0)
    cache0 = rng.normal(size=cache_shape).astype(cache_dtype)

    def run():
        cache = cache0
        for i in range(steps):
            cache = step(np.array([[5 + i]], np.int32), cache, np.array(fill + i, np.int32))
        return cache

    return run


def kept_cache_decoder(step, cache_shape, cache_dtype, fill, steps):
    """`signature_decoder` for `decode_step`: the caller's cache, of which each
    call passes the first slots (the filled ones rounded up to
    `loop.STEP_BUCKET`) and into which it writes the returned slot."""
    from keras_attn.runtimes.loop import STEP_BUCKET

    cache = np.random.default_rng(0).normal(size=cache_shape).astype(cache_dtype)

    def run():
        for i in range(steps):
            index = fill + i
            slots = min(cache_shape[3], -(-(index + 1) // STEP_BUCKET) * STEP_BUCKET)
            new = step(np.array([[5 + i]], np.int32), np.ascontiguousarray(cache[:, :, :, :slots]),
                       np.array(index, np.int32))
            cache[:, :, :, index:index + 1] = new
        return cache

    return run


def tflite_step(lm, max_length, kept=False):
    from ai_edge_litert import interpreter as litert

    from keras_attn.runtimes.signatures import tflite_bytes

    content = tflite_bytes(lm, max_length=max_length, batch_size=1, prompt_length=1,
                           checks="none")
    interpreter = litert.Interpreter(model_content=content)
    detail = interpreter.get_signature_runner("decode").get_input_details()["cache"]
    name, output = ("decode_step", "new_cache") if kept else ("decode", "cache")
    runner = interpreter.get_signature_runner(name)

    def step(token_ids, cache, index):
        return runner(token_ids=token_ids, cache=cache, index=index)[output]

    return step, tuple(detail["shape"]), detail["dtype"]


def onnx_step(lm, max_length, kept=False):
    import onnxruntime as ort

    from keras_attn.runtimes.signatures import onnx_models

    protos = onnx_models(lm, max_length=max_length, checks="none")
    cache_input = next(i for i in protos["decode"].graph.input if i.name == "cache")
    shape = tuple(d.dim_value or 1 for d in cache_input.type.tensor_type.shape.dim)
    name, output = ("decode_step", "new_cache") if kept else ("decode", "cache_out")
    session = ort.InferenceSession(protos[name].SerializeToString(), providers=["CPUExecutionProvider"])
    del protos
    position = [o.name for o in session.get_outputs()].index(output)

    def step(token_ids, cache, index):
        return session.run(None, {"token_ids": token_ids, "cache": cache, "index": index})[position]

    return step, shape, np.float32


def saved_model_step(lm, max_length, kept=False):
    """The SavedModel's signature functions (`signature_functions`, what
    `export_saved_model` saves), called in this process from NumPy."""
    import tensorflow as tf

    from keras_attn.runtimes import trace
    from keras_attn.runtimes.signatures import signature_functions

    fns = signature_functions(lm, max_length=max_length, checks="assert")
    name, output = ("decode_step", "new_cache") if kept else ("decode", "cache")
    fn = fns[name]
    shape = (trace.num_caches(lm), 2, 1, max_length, lm.num_key_value_heads, lm.head_dim)

    def step(token_ids, cache, index):
        return fn(token_ids=tf.constant(token_ids), cache=tf.constant(cache),
                  index=tf.constant(index))[output].numpy()

    return step, shape, np.float32


def add_litertlm(timers, lm, hf_dir, tok, work, length, read, args):
    import litert_lm

    from keras_attn.runtimes.litertlm import export_litertlm

    path = os.path.join(work, f"lm_{length}_{read}.litertlm")
    export_litertlm(lm, path, tokenizer=hf_dir, max_length=length,
                    prefill_lengths=(min(128, length),), stop_token_ids=[1])
    engine = litert_lm.Engine(path, backend=litert_lm.Backend.CPU(), enable_benchmark=True)
    for fill in args.fills if args.litertlm_all_fills else args.fills[:1]:
        if fill + args.new + 8 > length:
            continue
        rng = np.random.default_rng(fill)
        text = tok.decode([int(t) for t in rng.integers(300, tok.get_vocab_size(), fill)])

        def run(engine=engine, text=text):  # seconds per token, the engine's counter
            return 1.0 / run_bundle(engine, text, args.new)[1]

        timers[("litertlm", read, length, fill)] = run


def add_signature(timers, lm, runtime, length, read, args):
    kept = runtime.endswith("_step")
    make = {"tflite": tflite_step, "onnx": onnx_step,
            "saved_model": saved_model_step}[runtime.removesuffix("_step")]
    step, shape, dtype = make(lm, length, kept)
    for fill in args.fills:
        if fill + args.steps > length:
            continue
        decoder = (kept_cache_decoder if kept else signature_decoder)(step, shape, dtype, fill, args.steps)

        def run(decoder=decoder):  # seconds per token
            start = time.perf_counter()
            decoder()
            return (time.perf_counter() - start) / args.steps

        timers[(runtime, read, length, fill)] = run


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    _common.add_llm_size_args(parser, prompt=128, new=32, rounds=3)
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    parser.add_argument("--fills", type=int, nargs="+", default=[128, 1024],
                        help="decode from this many cached tokens (skipped where it does "
                             "not fit the length; LiteRT-LM runs the first fill only unless "
                             "--litertlm-all-fills)")
    parser.add_argument("--litertlm-all-fills", action="store_true")
    parser.add_argument("--steps", type=int, default=16,
                        help="decode calls per timing of a signature")
    parser.add_argument("--runtimes", nargs="+", default=list(RUNTIMES), choices=RUNTIMES)
    parser.add_argument("--reads", nargs="+", default=["bounded", "full"],
                        choices=["bounded", "full"],
                        help="bounded: the exports' decode (filled part of the cache); full: "
                             "every slot, as without `keras_attn.runtimes.trace.READ_BUCKET`")
    results_file.add_argument(parser, "long_context")
    args = parser.parse_args()
    results_file.start(args)
    _common.apply_quick(args)
    if args.quick:
        args.lengths, args.fills, args.steps = [128, 512], [32], 8

    from keras_attn.convert import from_huggingface

    load_start = os.getloadavg()
    work = tempfile.mkdtemp(prefix="bench_long_context_")
    atexit.register(shutil.rmtree, work, True)  # bundles and folders of 0.5-1 GB
    hf_dir = os.path.join(work, "hf")
    size_args = argparse.Namespace(**vars(args))
    size_args.prompt, size_args.new = max(args.lengths), max(args.fills) + args.new
    _, tok = build_hf(hf_dir, size_args)
    lm = from_huggingface(hf_dir)

    from keras_attn.runtimes import trace

    bucket = trace.READ_BUCKET
    timers, export_s = {}, {}
    for length, runtime, read in itertools.product(args.lengths, args.runtimes, args.reads):
        # "full" reads every slot and writes with a select over every slot:
        # the trace without bounded reads.
        trace.READ_BUCKET = bucket if read == "bounded" else None
        start = time.perf_counter()
        try:
            if runtime == "litertlm":
                add_litertlm(timers, lm, hf_dir, tok, work, length, read, args)
            else:
                add_signature(timers, lm, runtime, length, read, args)
        finally:
            trace.READ_BUCKET = bucket
        export_s[(runtime, read, length)] = time.perf_counter() - start
        print(f"exported {runtime} ({read} reads) max_length={length} in "
              f"{export_s[(runtime, read, length)]:.0f} s", flush=True)

    for run in timers.values():  # warm-up
        run()
    seconds = {key: [] for key in timers}
    keys = list(timers)
    for r in range(args.rounds):
        for key in (keys if r % 2 == 0 else keys[::-1]):
            seconds[key].append(timers[key]())
    load_end = os.getloadavg()

    with results_file.recording(args):
        print(f"\nLlama {args.layers} layers, hidden {args.hidden}, {args.heads} heads "
              f"({args.kv_heads} KV), vocabulary {max(args.vocab, tok.get_vocab_size())}, batch 1, "
              f"float32; decode tokens/s, medians of {args.rounds} alternating rounds "
              f"(signatures: {args.steps} calls from the fill; LiteRT-LM: {args.new} tokens after "
              f"a prompt of the fill); bounded reads in buckets of {bucket} slots; load average "
              f"{load_start[0]:.2f} at start, {load_end[0]:.2f} at end; peak RSS "
              f"{_common.peak_rss_kib() / 2**20:.1f} GB\n")
        base = min(args.lengths)
        print(f"| runtime | reads | fill | max_length | decode tok/s | vs max_length={base} |")
        print("|---|---|---|---|---|---|")
        tps = {key: 1.0 / statistics.median(times) for key, times in seconds.items()}
        rows = []
        for key in sorted(tps):
            runtime, read, length, fill = key
            ref = (runtime, read, base, fill)
            rows.append(dict(runtime=runtime, reads=read, max_length=length, fill=fill,
                             decode_tps=tps[key], ratio=tps[key] / tps[ref] if ref in tps else None,
                             export_s=export_s[(runtime, read, length)]))
            ratio = "" if rows[-1]["ratio"] is None else f"{rows[-1]['ratio']:.2f}"
            print(f"| {runtime} | {read} | {fill} | {length} | {tps[key]:.1f} | {ratio} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(rows=rows, load=[load_start, load_end], bucket=bucket, args=vars(args)), f, indent=2)


if __name__ == "__main__":
    main()
