"""int8/int4 ONNX weight schemes side by side: agreement with float32 and speed.

The schemes, each applied to the same float32 ONNX Runtime GenAI graph
(`export_onnx_genai`):

- `s8 full range`: int8 weights in [-127, 127] with uint8 activations
  (`quantize_dynamic` defaults). Saturates int16 pair sums on x86 CPUs with
  AVX2/AVX-512 and no VNNI: the answers depend on the CPU.
- `s8 reduce_range` (what `quantization="dynamic"` writes): int8 weights in
  [-64, 64]; exact integer arithmetic on every CPU.
- `u8u8`: uint8 weights with a zero point; exact on every CPU, onnxruntime
  has no VNNI kernel for it.
- `MatMulNBits 8` / `MatMulNBits 4`: weight-only blocks of 32 along the input
  axis (`keras_attn.export.onnx_quantize.matmul_nbits`), `accuracy_level` 4.

Agreement: a decoder trained here on the dates data (character vocabulary,
"<human date>=<iso date>"), held-out sequences run in one onnxruntime call
each (teacher forcing): how often the next-token argmax equals Keras's
float32 one, over all positions and over the answers' positions, and the
answers' accuracy. Speed: a Llama-shaped decoder (random weights) in
`onnxruntime_genai`, prefill and decode tokens/s in alternating rounds.
Also prints which int8 instructions this CPU has (VNNI or not).

    python benchmarks/bench_int8_schemes.py            # 8 x 512 speed model, trained decoder 10 epochs
    python benchmarks/bench_int8_schemes.py --quick
"""

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time

import _common  # noqa: F401  (sets the environment first)
import results_file  # noqa: E402
import numpy as np  # noqa: E402

SCHEMES = ("fp32", "s8 full range", "s8 reduce_range", "u8u8", "MatMulNBits 8", "MatMulNBits 4")


def cpu_int8_features():
    try:
        with open("/proc/cpuinfo") as f:
            flags = set(next(line for line in f if line.startswith("flags")).split(":")[1].split())
    except (OSError, StopIteration):
        return "unknown"
    have = [f for f in ("avx2", "avx512bw", "avx512_vnni", "avx_vnni", "amx_int8") if f in flags]
    return ", ".join(have) or "none of avx2/avx512/vnni"


def write_scheme(src, dst, scheme):
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    from keras_attn.export.onnx_quantize import matmul_nbits, quantize_matmul_weights

    common = dict(op_types_to_quantize=["MatMul"], per_channel=True,
                  extra_options={"MatMulConstBOnly": True})
    if scheme == "fp32":
        shutil.copy(src, dst)
    elif scheme == "s8 full range":
        quantize_dynamic(src, dst, weight_type=QuantType.QInt8, **common)
    elif scheme == "s8 reduce_range":
        onnx.save(quantize_matmul_weights(onnx.load(src)), dst)
    elif scheme == "u8u8":
        quantize_dynamic(src, dst, weight_type=QuantType.QUInt8, **common)
    else:
        bits = int(scheme.split()[-1])
        onnx.save(matmul_nbits(onnx.load(src), bits=bits, accuracy_level=4), dst)


def trained_decoder(epochs, examples):
    import keras

    from keras_attn.data.dates import INPUT_ALPHABET, generate_examples
    from keras_attn.generation import DecoderOnlyLM
    from keras_attn.runtimes.tokenizers import character_tokenizer

    tok = character_tokenizer(INPUT_ALPHABET + "=")

    def encode(count, seed):
        seqs = [tok.encode(f"{h}={i}").ids + [1] for h, i in generate_examples(count, seed=seed)]
        data = np.zeros((len(seqs), max(map(len, seqs))), np.int32)
        for row, seq in enumerate(seqs):
            data[row, :len(seq)] = seq
        return data

    data = encode(examples, seed=0)
    keras.utils.set_random_seed(0)
    lm = DecoderOnlyLM(len(INPUT_ALPHABET) + 3, 64, 48, num_layers=2, num_heads=4,
                       intermediate_dim=96, num_key_value_heads=2, position="rotary")
    lm.compile(keras.optimizers.Adam(3e-3),
               keras.losses.SparseCategoricalCrossentropy(from_logits=True, ignore_class=0))
    lm.fit(data[:, :-1], data[:, 1:], epochs=epochs, batch_size=64, verbose=0)
    held_out = encode(200, seed=98)
    answer = np.zeros(held_out.shape, bool)
    for row, seq in enumerate(held_out):
        answer[row, list(seq).index(tok.token_to_id("=")):np.count_nonzero(seq) - 1] = True
    return lm, data.shape[1], held_out, answer


def agreement(work, epochs, examples):
    """Agreement rows per scheme, and the trained decoder's float32 GenAI folder."""
    import onnxruntime as ort

    from keras_attn.runtimes.onnx_genai import export_onnx_genai

    lm, width, held_out, answer = trained_decoder(epochs, examples)
    keras_next = np.asarray(lm(held_out)).argmax(-1)
    target = np.zeros_like(held_out)
    target[:, :-1] = held_out[:, 1:]
    folder = os.path.join(work, "dates_fp32")
    export_onnx_genai(lm, folder, max_length=width, prompt_logits="all")  # every position scored
    src = os.path.join(folder, "model.onnx")
    valid = held_out != 0
    rows = {}
    for scheme in SCHEMES:
        dst = os.path.join(work, f"dates_{scheme.replace(' ', '_')}.onnx")
        write_scheme(src, dst, scheme)
        session = ort.InferenceSession(dst, providers=["CPUExecutionProvider"])
        feeds = {"input_ids": held_out.astype(np.int64), "attention_mask": np.ones(held_out.shape, np.int64)}
        for graph_input in session.get_inputs()[2:]:
            feeds[graph_input.name] = np.zeros((len(held_out),) + tuple(graph_input.shape[1:]), np.float32)
        got = session.run(["logits"], feeds)[0].argmax(-1)
        rows[scheme] = dict(all=float((got == keras_next)[valid].mean()),
                            answers=float((got == keras_next)[answer].mean()),
                            accuracy=float((got == target)[answer].mean()))
    return rows, folder


def speed(work, args, base=None):
    """Tokens/s per scheme: of the float32 GenAI folder `base` if given
    (--quick: the trained decoder's), else of a Llama-shaped decoder of the
    requested size."""
    import onnxruntime_genai as og

    from keras_attn.generation import DecoderOnlyLM
    from keras_attn.runtimes.onnx_genai import export_onnx_genai

    if base is None:
        lm = DecoderOnlyLM(args.vocab, args.prompt + args.new, args.hidden, num_layers=args.layers,
                           num_heads=args.heads, num_key_value_heads=args.kv_heads,
                           intermediate_dim=args.intermediate, position="rotary",
                           normalization="rms_norm", use_gated_feedforward=True, activation="silu")
        lm(np.array([[2, 3]], np.int32))
        base = os.path.join(work, "speed_fp32")
        export_onnx_genai(lm, base, max_length=args.prompt + args.new)
    with open(os.path.join(base, "genai_config.json")) as f:
        vocab = json.load(f)["model"]["vocab_size"]
    folders = {}
    for scheme in SCHEMES:
        folder = os.path.join(work, "speed_" + scheme.replace(" ", "_"))
        if scheme != "fp32":
            shutil.copytree(base, folder)
            write_scheme(os.path.join(base, "model.onnx"), os.path.join(folder, "model.onnx"), scheme)
        folders[scheme] = base if scheme == "fp32" else folder
    prompt = [int(t) for t in np.random.default_rng(1).integers(2, vocab, args.prompt)]

    def run(folder):
        model = og.Model(folder)
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=args.prompt + args.new, do_sample=False)
        generator = og.Generator(model, params)
        start = time.perf_counter()
        generator.append_tokens(np.array([prompt], np.int32))
        prefill = time.perf_counter() - start
        start, count = time.perf_counter(), 0
        while not generator.is_done():
            generator.generate_next_token()
            count += 1
        return prefill, (time.perf_counter() - start) / max(count, 1)

    for folder in folders.values():
        run(folder)  # warm-up
    samples = {s: ([], []) for s in folders}
    for r in range(args.rounds):
        for scheme in (SCHEMES if r % 2 == 0 else SCHEMES[::-1]):
            prefill, decode = run(folders[scheme])
            samples[scheme][0].append(prefill)
            samples[scheme][1].append(decode)
    rows = {}
    for scheme, (prefill, decode) in samples.items():
        rows[scheme] = dict(prefill_tps=args.prompt / statistics.median(prefill),
                            decode_tps=1 / statistics.median(decode),
                            size_mb=os.path.getsize(os.path.join(folders[scheme], "model.onnx")) / 1e6)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--examples", type=int, default=3000)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--intermediate", type=int, default=1408)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--json")
    results_file.add_argument(parser, "int8_schemes")
    args = parser.parse_args()
    results_file.start(args)
    if args.quick:
        args.epochs, args.examples, args.prompt, args.new, args.rounds = 1, 300, 8, 8, 1
    work = tempfile.mkdtemp(prefix="bench_int8_")
    agree, dates_folder = agreement(work, args.epochs, args.examples)
    # --quick times the trained decoder itself: one export fewer.
    fast = speed(work, args, base=dates_folder if args.quick else None)
    with results_file.recording(args):
        print(f"\nCPU int8 features: {cpu_int8_features()}")
        print(f"agreement: dates decoder ({args.epochs} epochs on {args.examples} examples), 200 held-out "
              "sequences, next token under the same prefix vs Keras float32")
        model = "the dates decoder" if args.quick else (
            f"decoder {args.layers} x {args.hidden} ({args.heads} heads, {args.kv_heads} KV), vocabulary {args.vocab}")
        print(f"speed: {model}, prompt {args.prompt}, {args.new} new tokens, onnxruntime_genai, "
              f"medians of {args.rounds} alternating rounds\n")
        print("| scheme | agreement (all) | agreement (answers) | answer accuracy | prefill tok/s | "
              "decode tok/s | decode vs fp32 | MB |")
        print("|---|---|---|---|---|---|---|---|")
        for scheme in SCHEMES:
            a, s = agree[scheme], fast[scheme]
            print(f"| {scheme} | {a['all']:.4f} | {a['answers']:.4f} | {a['accuracy']:.4f} | "
                  f"{s['prefill_tps']:.0f} | {s['decode_tps']:.1f} | "
                  f"{s['decode_tps'] / fast['fp32']['decode_tps']:.2f}x | {s['size_mb']:.0f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(agreement=agree, speed=fast, cpu=cpu_int8_features(), args=vars(args)), f, indent=2)
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
