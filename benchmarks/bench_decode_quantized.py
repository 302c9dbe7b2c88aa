"""Quantized generation exports: TFLite decode-step speed, size, cache memory and greedy agreement.

Variants of `keras_attn.runtimes.signatures.tflite_bytes` side by side, one run:
float32; float16 weights; int8 weights (`quantization="dynamic"`: LiteRT's
hybrid int8 kernels); int8 weights with a float16 cache (`cache_dtype`); int4
weights in blocks of 32 (`quantization="int4"`, ai-edge-quantizer).

- Speed: a Llama-shaped `DecoderOnlyLM` (default 8 layers, hidden 512, 8
  heads / 2 key-value heads, vocabulary 32000, rotary, RMSNorm, SwiGLU;
  random weights: speed does not depend on them), the `decode` signature at
  batch 1 with a `--cache`-position cache, median of `--repeats` calls in the
  LiteRT interpreter (XNNPACK), variants timed in alternating rounds, ratios
  to float32.
- Answers: greedy tokens of each variant vs float32 Keras over long
  generations, judged on a model with trained weights (a character-level
  decoder trained here on the dates data: its next-token distributions are
  peaked, as a trained model's are) and on the random model above.

    python benchmarks/bench_decode_quantized.py            # full size
    python benchmarks/bench_decode_quantized.py --quick    # 2 layers, hidden 128
"""

import argparse
import json
import statistics
import time

import _common  # noqa: F401  (sets the environment first)
import results_file  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402

from keras_attn.generation import DecoderOnlyLM, greedy_search  # noqa: E402
from keras_attn.runtimes import signatures as gen_export  # noqa: E402

VARIANTS = {
    "float32": dict(quantization=None),
    "float16 weights": dict(quantization="float16"),
    "int8 weights": dict(quantization="dynamic"),
    "int8 weights + float16 cache": dict(quantization="dynamic", cache_dtype="float16"),
    "int4 weights (blocks of 32)": dict(quantization="int4"),
}


def interpreter(content):
    from ai_edge_litert import interpreter as litert

    return litert.Interpreter(model_content=content)


def decode_runner(content, cache_length):
    """A zero-argument call of the `decode` signature (batch 1, mid-cache index)."""
    runner = interpreter(content).get_signature_runner("decode")
    details = runner.get_input_details()
    cache = np.zeros(details["cache"]["shape"], details["cache"]["dtype"])
    token = np.array([[5]], np.int32)
    index = np.array(cache_length // 2, np.int32)

    def call():
        runner(token_ids=token, cache=cache, index=index)

    return call, details["cache"]


def interleaved_ms(calls, repeats, rounds=5):
    """Median ms per call of each callable, timed in alternating rounds."""
    times = {name: [] for name in calls}
    for call in calls.values():
        for _ in range(3):
            call()
    names = list(calls)
    for r in range(rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            for _ in range(max(1, repeats // rounds)):
                start = time.perf_counter()
                calls[name]()
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def greedy_tflite(content, prompt, max_length, stop):
    """Greedy tokens after `prompt` from a `prompt_length=1` export: the first
    token through `prefill`, the rest of the prompt through `decode`."""
    it = interpreter(content)
    prefill, decode = it.get_signature_runner("prefill"), it.get_signature_runner("decode")
    out = prefill(token_ids=np.array([prompt[:1]], np.int32))
    logits, cache = out["logits"][0, -1], out["cache"]
    tokens = list(prompt[:1])
    while len(tokens) < max_length:
        nxt = prompt[len(tokens)] if len(tokens) < len(prompt) else int(np.argmax(logits))
        tokens.append(nxt)
        if len(tokens) > len(prompt) and nxt == stop:
            break
        out = decode(token_ids=np.array([[nxt]], np.int32), cache=cache,
                     index=np.array(len(tokens) - 1, np.int32))
        logits, cache = out["logits"][0, -1], out["cache"]
    return tokens[len(prompt):]


def agreement(want, got):
    """Share of positions equal to float32 Keras up to the first divergence's end (both lengths)."""
    n = max(len(want), len(got))
    same = sum(a == b for a, b in zip(want, got))
    first = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))
    return same / n if n else 1.0, first


def trained_dates_model(seed=0):
    from keras_attn.data.dates import INPUT_ALPHABET, generate_examples

    chars = INPUT_ALPHABET + "="
    ids = {c: i + 2 for i, c in enumerate(chars)}
    pairs = generate_examples(3000, seed=seed)
    seqs = [[ids[c] for c in f"{h}={iso}"] + [1] for h, iso in pairs]
    width = max(map(len, seqs))
    data = np.zeros((len(seqs), width), np.int32)
    for row, seq in enumerate(seqs):
        data[row, :len(seq)] = seq
    keras.utils.set_random_seed(seed)
    lm = DecoderOnlyLM(len(chars) + 2, 64, 64, num_layers=2, num_heads=4, intermediate_dim=128,
                       num_key_value_heads=2, position="rotary")
    lm.compile(keras.optimizers.Adam(3e-3),
               keras.losses.SparseCategoricalCrossentropy(from_logits=True, ignore_class=0))
    lm.fit(data[:, :-1], data[:, 1:], epochs=6, batch_size=64, verbose=0)
    prompts = [[ids[c] for c in f"{h}="] for h, _ in generate_examples(40, seed=99)]
    return lm, prompts, width


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    _common.add_llm_size_args(parser)
    parser.add_argument("--cache", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--generate", type=int, default=256, help="random model: tokens generated")
    results_file.add_argument(parser, "decode_quantized")
    args = _common.apply_quick(parser.parse_args())
    results_file.start(args)
    if args.quick:
        args.cache, args.repeats, args.generate = 128, 20, 64

    keras.utils.set_random_seed(0)
    big = DecoderOnlyLM(args.vocab, args.cache, args.hidden, num_layers=args.layers,
                        num_heads=args.heads, num_key_value_heads=args.kv_heads,
                        intermediate_dim=args.hidden * 8 // 3 // 64 * 64 or 2 * args.hidden,
                        position="rotary", normalization="rms_norm",
                        use_gated_feedforward=True, activation="silu")
    big(np.array([[2, 3]], np.int32))
    small, prompts, width = trained_dates_model()
    rng = np.random.default_rng(0)
    big_prompt = [int(t) for t in rng.integers(2, args.vocab, 16)]
    big_len = min(args.cache, 16 + args.generate)
    big_want = [int(t) for t in np.asarray(greedy_search(
        big, np.array([big_prompt], np.int32), big_len, stop_token_ids=()))[0, 16:]]
    small_want = [[int(t) for t in np.asarray(greedy_search(
        small, np.array([p], np.int32), width, stop_token_ids=(1,)))[0, len(p):]]
        for p in prompts]
    small_want = [w[:w.index(1) + 1] if 1 in w else w for w in small_want]

    rows, calls = [], {}
    for name, options in VARIANTS.items():
        content = gen_export.tflite_bytes(big, max_length=args.cache, batch_size=1, prompt_length=1,
                                          checks="none", **options)
        calls[name], cache = decode_runner(content, args.cache)
        per_token = np.prod(cache["shape"]) * np.dtype(cache["dtype"]).itemsize / args.cache
        big_got = greedy_tflite(content, big_prompt, big_len, stop=-1)
        big_agree, big_first = agreement(big_want, big_got)
        small_content = gen_export.tflite_bytes(small, max_length=width, batch_size=1,
                                                prompt_length=1, checks="none", **options)
        small_scores = []
        for prompt, want in zip(prompts, small_want):
            got = greedy_tflite(small_content, prompt, width, stop=1)
            small_scores.append(agreement(want, got)[0])
        rows.append(dict(variant=name, size_mb=len(content) / 2**20,
                         cache_bytes_per_token=int(per_token), random_agreement=big_agree,
                         random_first_divergence=big_first,
                         trained_agreement=float(np.mean(small_scores)),
                         trained_exact=float(np.mean([s == 1.0 for s in small_scores]))))
        print(rows[-1], flush=True)
    speeds = interleaved_ms(calls, args.repeats)
    for row in rows:
        row["decode_ms"] = speeds[row["variant"]]
    base = rows[0]["decode_ms"]
    with results_file.recording(args):
        print(f"\nDecoderOnlyLM {args.layers} layers, hidden {args.hidden}, {args.heads} heads "
              f"({args.kv_heads} KV), vocabulary {args.vocab}; TFLite `decode` at batch 1 with a "
              f"{args.cache}-position cache, median of {args.repeats} calls (LiteRT, XNNPACK)\n")
        print("| variant | decode ms | speed vs float32 | model MB | cache bytes/token | "
              f"random model: greedy = float32 Keras ({args.generate} tokens) | trained dates model: "
              f"greedy = float32 Keras ({len(prompts)} prompts; all tokens equal) |")
        print("|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['variant']} | {r['decode_ms']:.2f} | {base / r['decode_ms']:.2f}x | "
                  f"{r['size_mb']:.1f} | {r['cache_bytes_per_token']} | "
                  f"{r['random_agreement']:.1%} (first difference at {r['random_first_divergence']}) | "
                  f"{r['trained_agreement']:.1%} ({r['trained_exact']:.0%}) |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(rows=rows, args=vars(args)), f, indent=2)


if __name__ == "__main__":
    main()
