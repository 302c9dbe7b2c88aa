"""LiteRT-LM: our `.litertlm` bundle vs litert-torch's export of the same model.

One Hugging Face Llama (random weights, seeded; a byte-level BPE tokenizer
trained here, as in bench_genai.py), exported twice per precision:
`keras_attn.convert.from_huggingface` + `export_litertlm`, and litert-torch's
Hugging Face exporter (`python -m litert_torch.generative.export_hf`, run in
its own venv: it pins torch and needs TensorFlow; see install_peers.sh).
Precisions: float32 (ours `quantization=None`, peer
`--quantization_recipe=none`) and int8 weights (ours "dynamic", peer's
default `dynamic_wi8_afp32`). Every bundle runs in `litert_lm.Engine` (CPU)
in this process, in alternating rounds: prefill and decode tokens/s as the
engine's own benchmark counters report them, over the same text prompt and
`--new` greedy tokens; the float32 texts must agree. Prints a table and
ratios (ours / peer tokens/s: > 1 is faster).

    python benchmarks/bench_litertlm.py                  # 8 layers, hidden 512, vocab 32000
    python benchmarks/bench_litertlm.py --quick          # 2 layers, hidden 128, vocab 4000
    PEER_PYTHON=/path/to/venv/bin/python python benchmarks/bench_litertlm.py

Needs `litert-lm-api` and `litert-lm-builder` (the `llm-runtimes` extra);
the peer column is skipped when PEER_PYTHON (default
/work/venv-litert-torch/bin/python) cannot run litert-torch. Install that venv with
`WITH_LITERT_TORCH=1 bash benchmarks/install_peers.sh`.
"""

import argparse
import atexit
import glob
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common  # noqa: E402  (sets the environment first)
import results_file  # noqa: E402
from bench_genai import build_hf  # noqa: E402

PEER_PYTHON = os.environ.get("PEER_PYTHON", "/work/venv-litert-torch/bin/python")


def peer_export(hf_dir, out, prompt, cache_length, recipe):
    """litert-torch's bundle path, or None (and why) when the peer cannot run."""
    if not os.path.exists(PEER_PYTHON):
        return None, f"no peer Python at {PEER_PYTHON}"
    command = [PEER_PYTHON, "-m", "litert_torch.generative.export_hf", "--model", hf_dir,
               "--output_dir", out, f"--prefill_lengths=[{prompt}]",
               f"--cache_length={cache_length}", f"--quantization_recipe={recipe}"]
    result = subprocess.run(command, capture_output=True, text=True)
    found = glob.glob(os.path.join(out, "**", "*.litertlm"), recursive=True)
    if result.returncode or not found:
        return None, (result.stderr or result.stdout)[-2000:]
    return found[0], None


def run_bundle(engine, text, new):
    """(prefill tok/s, decode tok/s, text) from the engine's benchmark counters."""
    import litert_lm

    session = engine.create_session(apply_prompt_template=False,
                                    sampler_config=litert_lm.SamplerConfig(top_k=1),
                                    max_output_tokens=new)
    try:
        session.run_prefill([text])
        out = "".join(session.run_decode().texts)
        info = session.get_benchmark_info()
    finally:
        session.close()
    return info.last_prefill_tokens_per_second, info.last_decode_tokens_per_second, out, info


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    _common.add_llm_size_args(parser)
    results_file.add_argument(parser, "litertlm")
    args = parser.parse_args()
    results_file.start(args)
    _common.apply_quick(args)

    import litert_lm

    from keras_attn.convert import from_huggingface
    from keras_attn.runtimes.litertlm import export_litertlm

    work = tempfile.mkdtemp(prefix="bench_litertlm_")
    atexit.register(shutil.rmtree, work, True)  # bundles and folders of 0.5-1 GB
    hf_dir = os.path.join(work, "hf")
    _, tok = build_hf(hf_dir, args)
    max_length = args.prompt + args.new + 8
    # A text of about --prompt tokens; neither bundle adds a start token
    # (litert-torch writes none for this checkpoint), so both prefill the same ids.
    rng = np.random.default_rng(1)
    ids = [int(t) for t in rng.integers(300, tok.get_vocab_size(), args.prompt)]
    text = tok.decode(ids)
    prompt_tokens = len(tok.encode(text).ids)

    bundles, export_s, notes = {}, {}, {}
    lm = from_huggingface(hf_dir)
    for precision, ours_q, peer_recipe in (("float32", None, "none"),
                                           ("int8 weights", "dynamic", "dynamic_wi8_afp32")):
        name = f"keras_attn {precision}"
        start = time.perf_counter()
        path = os.path.join(work, f"ours_{ours_q}.litertlm")
        export_litertlm(lm, path, tokenizer=hf_dir, max_length=max_length,
                        prefill_lengths=(args.prompt,), quantization=ours_q,
                        stop_token_ids=[1], min_agreement=0.0)
        bundles[name], export_s[name] = path, time.perf_counter() - start
        name = f"litert-torch {precision}"
        start = time.perf_counter()
        path, why = peer_export(hf_dir, os.path.join(work, f"peer_{peer_recipe}"), args.prompt,
                                max_length, peer_recipe)
        if path is None:
            notes[name] = why
            print(f"{name}: skipped ({why.strip().splitlines()[-1] if why else ''})")
            continue
        bundles[name], export_s[name] = path, time.perf_counter() - start

    engines = {n: litert_lm.Engine(p, backend=litert_lm.Backend.CPU(), enable_benchmark=True)
               for n, p in bundles.items()}
    speeds = {n: {"prefill": [], "decode": []} for n in bundles}
    texts, counts = {}, {}
    for name, engine in engines.items():  # warm-up
        run_bundle(engine, text, args.new)
    for r in range(args.rounds):
        order = list(engines) if r % 2 == 0 else list(reversed(engines))
        for name in order:
            prefill, decode, texts[name], info = run_bundle(engines[name], text, args.new)
            speeds[name]["prefill"].append(prefill)
            speeds[name]["decode"].append(decode)
            counts[name] = (info.last_prefill_token_count, info.last_decode_token_count)
    for engine in engines.values():
        engine.close()
    med = {n: {k: statistics.median(v) for k, v in s.items()} for n, s in speeds.items()}

    with results_file.recording(args):
        print(f"\nLlama {args.layers} layers, hidden {args.hidden}, {args.heads} heads "
              f"({args.kv_heads} KV), vocabulary {max(args.vocab, tok.get_vocab_size())}, prompt "
              f"{prompt_tokens} tokens, {args.new} new tokens, batch 1, LiteRT-LM CPU; medians of "
              f"{args.rounds} alternating rounds\n")
        print("| bundle | size MB | prefill tok/s | decode tok/s | tokens (prefill, decode) | export s |")
        print("|---|---|---|---|---|---|")
        rows = []
        for name in bundles:
            m = med[name]
            row = dict(name=name, size_mb=os.path.getsize(bundles[name]) / 2**20,
                       prefill_tps=m["prefill"], decode_tps=m["decode"], counts=counts[name],
                       export_s=export_s[name])
            rows.append(row)
            print(f"| {name} | {row['size_mb']:.1f} | {row['prefill_tps']:.0f} | "
                  f"{row['decode_tps']:.1f} | {counts[name]} | {row['export_s']:.1f} |")
        ratios = {}
        for precision in ("float32", "int8 weights"):
            ours, peer = f"keras_attn {precision}", f"litert-torch {precision}"
            if ours in med and peer in med:
                ratios[precision] = {k: med[ours][k] / med[peer][k] for k in ("prefill", "decode")}
                print(f"ours / litert-torch tokens/s, {precision}: prefill "
                      f"{ratios[precision]['prefill']:.2f}x, decode {ratios[precision]['decode']:.2f}x")
        if "keras_attn float32" in texts and "litert-torch float32" in texts:
            same = texts["keras_attn float32"] == texts["litert-torch float32"]
            print(f"float32 greedy texts equal: {same}")
        if "keras_attn float32" in med:
            ours_q = med["keras_attn int8 weights"]["decode"] / med["keras_attn float32"]["decode"]
            print(f"ours int8 weights / ours float32, decode tokens/s: {ours_q:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(rows=rows, ratios=ratios, notes=notes, texts=texts, args=vars(args)),
                      f, indent=2)


if __name__ == "__main__":
    main()
