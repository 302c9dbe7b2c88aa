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

`--sweep` (issue 54): prefill tokens/s at every prompt length in 1-1024,
each side of every prefill signature length, at real sizes (bench_real_size's
published shapes, random bfloat16 weights; int8 weights, cache 1024): ours
with the default prefill lengths (or each `--ours-prefill` set) against
litert-torch's `--prefill_lengths=[128]` bundle, all loaded in one
`litert_lm.Engine` process, alternating rounds; then each bundle's size and
the peak RSS (VmHWM) of a fresh process that loads it (engine made) and then
prefills the longest prompt. Bundles are kept under `--work` and reused.

    python benchmarks/bench_litertlm.py --sweep --real-size qwen2.5-0.5b,llama-3.2-1b \
        --write-results litertlm_prefill_sweep
    python benchmarks/bench_litertlm.py --sweep --real-size qwen2.5-0.5b --ours-prefill 128 \
        --ours-prefill 32,128 --ours-prefill 128,256,512

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


# ---------------------------------------------------------------------------
# --sweep (issue 54): prefill at every prompt length, real sizes.

SWEEP_MAX_LENGTH = 1024  # the cache of both bundles (litert-torch's --cache_length)
PEER_PREFILL = 128  # litert-torch's bundle: one prefill signature
PEER_RECIPE = "dynamic_wi8_afp32"
# The prompt lengths: 1, a few lengths inside each range, and each side of every
# signature length (and of its multiples) found in the swept bundles.
# (The sweep starts at 2: a 1-token prompt measured no prefill time.)
SWEEP_BASE_LENGTHS = (2, 16, 48, 64, 80, 96, 97, 107, 113, 119, 300, 422, 700, 1000)


def sweep_lengths(signature_lengths, largest=SWEEP_MAX_LENGTH - 8):
    """Prompt lengths from 2 to `largest`: SWEEP_BASE_LENGTHS and T - 1, T, T + 1
    for every signature length T, and for every multiple of each one from 128 up
    (where a bundle's calls change)."""
    lengths = {n for n in SWEEP_BASE_LENGTHS if n <= largest}
    edges = set(signature_lengths)
    for top in signature_lengths:
        if top >= 128:
            edges.update(range(top, largest + 1, top))
    for t in edges:
        lengths.update(n for n in (t - 1, t, t + 1) if 2 <= n <= largest)
    return sorted(lengths)


def prompt_ids(tok, n, seed=0):
    """A text of exactly `n` tokens of `tok` (random ids, re-encoded until the
    text's own encoding has `n` ids), and those ids' count."""
    rng = np.random.default_rng(seed + n)
    ids = [int(t) for t in rng.integers(300, tok.get_vocab_size(), n + 8)]
    for _ in range(20):
        text = tok.decode(ids[:n])
        ids = tok.encode(text).ids
        if len(ids) == n:
            return text
        ids = ids + [int(t) for t in rng.integers(300, tok.get_vocab_size(), 8)]
    raise RuntimeError(f"no text of exactly {n} tokens")


def _lengths_name(lengths):
    return "_".join(str(t) for t in lengths)


def _ours_path(work, lengths):
    return os.path.join(work, f"litertlm_int8_prefill_{_lengths_name(lengths)}.litertlm")


def _export_ours_child(folder, path, lengths):
    """In a fresh process: convert the checkpoint and export our int8 bundle
    with these prefill lengths (None: the package's default)."""
    from keras_attn.convert import from_huggingface
    from keras_attn.runtimes.litertlm import export_litertlm

    start = time.perf_counter()
    lm = from_huggingface(folder)
    converted = time.perf_counter()
    export_litertlm(lm, path, tokenizer=folder, max_length=SWEEP_MAX_LENGTH, prefill_lengths=lengths,
                    quantization="dynamic", stop_token_ids=[1], min_agreement=0.0)
    print(json.dumps({"convert_s": converted - start, "export_s": time.perf_counter() - converted}))


def _rss_child(path, text):
    """In a fresh process: VmHWM after `litert_lm.Engine(path)` and after one
    prefill of `text` (and one decode step)."""
    import litert_lm

    def hwm():
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM"))

    base = hwm()
    engine = litert_lm.Engine(path, backend=litert_lm.Backend.CPU(), enable_benchmark=True)
    loaded = hwm()
    run_bundle(engine, text, 1)
    ran = hwm()
    engine.close()
    print(json.dumps({"start": base, "load": loaded, "run": ran}))


def _child(*argv):
    out = subprocess.run([sys.executable, os.path.abspath(__file__), *argv], capture_output=True,
                         text=True, check=False)
    if out.returncode:
        raise RuntimeError(f"{argv[0]} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _sweep_bundles(model, args, ours_sets):
    """`({name: path}, tokenizer)` of one real-size model: the checkpoint (made
    by bench_real_size.py when missing), our bundle per prefill set and
    litert-torch's, each exported when missing (one export at a time)."""
    import bench_real_size
    import tokenizers

    paths = bench_real_size._paths(args, model)
    if not os.path.isdir(paths["checkpoint"]):
        subprocess.run([sys.executable, os.path.join(os.path.dirname(__file__), "bench_real_size.py"),
                        "--models", model, "--stages", "checkpoint", "--work", args.work], check=True)
    folder = bench_real_size._with_tokenizer(paths)
    bundles = {}
    for lengths in ours_sets:
        path = _ours_path(paths["work"], lengths)
        if not os.path.exists(path):
            print(f"exporting ours {model} prefill {lengths} ...", flush=True)
            print(" ", _child("--export-child", folder, path, _lengths_name(lengths)), flush=True)
        bundles[f"ours [{', '.join(map(str, lengths))}]"] = path
    peer_dir = bench_real_size._peer_folder(paths, "int8")
    found = glob.glob(os.path.join(peer_dir, "**", "*.litertlm"), recursive=True)
    if not found and not args.no_peer:
        print(f"exporting litert-torch {model} ...", flush=True)
        path, why = peer_export(folder, peer_dir, PEER_PREFILL, SWEEP_MAX_LENGTH, PEER_RECIPE)
        if path is None:
            raise RuntimeError(f"litert-torch export failed: {why}")
        found = [path]
    if not args.no_peer:
        bundles[f"litert-torch [{PEER_PREFILL}]"] = found[0]
    tok = tokenizers.Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))
    return bundles, tok


def _signature_lengths(name):
    return [int(t) for t in name[name.index("[") + 1:name.index("]")].replace(" ", "").split(",") if t]


def sweep_model(model, args, ours_sets):
    """One model's sweep: `(rows, sizes, text)`; prints its tables (`text`)."""
    import litert_lm

    lines = []

    def say(line=""):
        print(line, flush=True)
        lines.append(line)

    bundles, tok = _sweep_bundles(model, args, ours_sets)
    signature_lengths = sorted({t for n in bundles for t in _signature_lengths(n)})
    lengths = args.lengths or sweep_lengths(signature_lengths)
    texts = {n: prompt_ids(tok, n) for n in lengths}
    # The reference of the ratios: litert-torch's bundle, or with --no-peer the
    # first of ours (with one signature of 128 it makes litert-torch's calls).
    peer = next((n for n in bundles if n.startswith("litert-torch")), next(iter(bundles)))
    reference = peer.split(" [")[0] if peer.startswith("litert-torch") else peer
    loads = [os.getloadavg()[0]]
    engines = {n: litert_lm.Engine(p, backend=litert_lm.Backend.CPU(), enable_benchmark=True)
               for n, p in bundles.items()}
    speeds = {(n, length): [] for n in bundles for length in lengths}
    counts = {}
    try:
        warm = prompt_ids(tok, max(signature_lengths) + 1)
        for engine in engines.values():  # warm-up: every signature once
            run_bundle(engine, warm, 1)
        for r in range(args.rounds):
            for i, length in enumerate(lengths):
                order = list(engines) if (r + i) % 2 == 0 else list(reversed(engines))
                for n in order:
                    prefill, _, _, info = run_bundle(engines[n], texts[length], 1)
                    speeds[n, length].append(prefill)
                    counts[n, length] = info.last_prefill_token_count
            loads.append(os.getloadavg()[0])
            print(f"  round {r + 1}/{args.rounds} done, load {loads[-1]:.1f}: " + ", ".join(
                f"{length}: " + "/".join(f"{speeds[n, length][-1]:.0f}" for n in bundles)
                for length in lengths), flush=True)
    finally:
        for engine in engines.values():
            engine.close()
    med = {k: statistics.median(v) for k, v in speeds.items()}
    ours = [n for n in bundles if n != peer]
    rows = []
    for length in lengths:
        rows.append(dict(prompt=length, engine_tokens=counts[peer, length],
                         tps={n: med[n, length] for n in bundles},
                         ratio={n: med[n, length] / med[peer, length] for n in ours}))
    sizes = {}
    if not args.no_rss:
        for n, p in bundles.items():
            sizes[n] = dict(bytes=os.path.getsize(p), **_child("--rss-child", p, texts[lengths[-1]]))
    say(f"\n### {model}: prefill tokens/s by prompt length\n")
    say(f"Int8 weights, cache {SWEEP_MAX_LENGTH}, `litert_lm.Engine` 0.18.1 CPU, the engine's "
          f"prefill counter; medians of {args.rounds} alternating rounds, all bundles loaded in one "
          f"process; load average {min(loads):.1f}-{max(loads):.1f} during the sweep. "
          f"Ratios: ours / {reference} tokens/s (> 1 is faster).\n")
    say("| prompt tokens | " + " | ".join(f"{n} tok/s" for n in bundles) + " | "
          + " | ".join(f"{n} / {reference}" for n in ours) + " |")
    say("|---" * (1 + len(bundles) + len(ours)) + "|")
    for row in rows:
        say(f"| {row['prompt']} | " + " | ".join(f"{row['tps'][n]:.0f}" for n in bundles) + " | "
              + " | ".join(f"{row['ratio'][n]:.2f}x" for n in ours) + " |")
    for n in ours:
        worst = min(rows, key=lambda row: row["ratio"][n])
        say(f"\n{n}: lowest ratio {worst['ratio'][n]:.2f}x at {worst['prompt']} tokens, "
              f"highest {max(r['ratio'][n] for r in rows):.2f}x; "
              f"{sum(r['ratio'][n] >= 1.0 for r in rows)} of {len(rows)} lengths >= 1.00x.")
    if sizes:
        say(f"\n| bundle | size MB | peak RSS after load GiB | peak RSS after a "
              f"{lengths[-1]}-token prefill GiB |")
        say("|---|---|---|---|")
        for n, s in sizes.items():
            say(f"| {n} | {s['bytes'] / 2**20:.1f} | {s['load'] / 2**30:.2f} | {s['run'] / 2**30:.2f} |")
    return rows, sizes, "\n".join(lines)


def sweep_main(args):
    from keras_attn.runtimes import litertlm

    ours_sets = [tuple(sorted(int(t) for t in s.split(","))) for s in args.ours_prefill] or [
        litertlm._prefill_lengths(None, SWEEP_MAX_LENGTH)]
    if args.ours_prefill_rule:
        ours_sets.insert(0, litertlm._prefill_lengths(None, SWEEP_MAX_LENGTH))
    results = {}
    # The tables are collected and written at the end (litert_lm's import
    # replaces sys.stdout, so results_file.recording would miss them).
    intro = (f"Prompt-length sweep (issue 54): ours = `export_litertlm(max_length={SWEEP_MAX_LENGTH}, "
              f"quantization=\"dynamic\", prefill_lengths=...)`, the signature lengths in brackets; "
              + ("" if args.no_peer else
                 f"litert-torch 0.10 = `export_hf --prefill_lengths=[{PEER_PREFILL}] --cache_length="
                 f"{SWEEP_MAX_LENGTH} --quantization_recipe={PEER_RECIPE}`; ")
              + "random bfloat16 weights in the published shapes (bench_real_size.py).")
    print(intro)
    for model in args.real_size.split(","):
        results[model] = sweep_model(model, args, ours_sets)
    results_file.finish(args, "\n".join([intro] + [text for _, _, text in results.values()]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({m: {"rows": r, "sizes": s} for m, (r, s, _) in results.items()}, f, indent=2)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    _common.add_llm_size_args(parser)
    parser.add_argument("--sweep", action="store_true",
                        help="prefill tokens/s by prompt length, ours vs litert-torch (issue 54)")
    parser.add_argument("--real-size", default="qwen2.5-0.5b",
                        help="--sweep: comma-separated models of bench_real_size.py")
    parser.add_argument("--work", default=os.path.join(tempfile.gettempdir(), "keras_attn_real_size"),
                        help="--sweep: where checkpoints and bundles are kept and reused "
                             "(bench_real_size.py's --work)")
    parser.add_argument("--ours-prefill", action="append", default=[], metavar="T,T,...",
                        help="--sweep: our bundle's prefill lengths (repeat for several bundles; "
                             "default: the package's default)")
    parser.add_argument("--ours-prefill-rule", action="store_true",
                        help="--sweep: add the package's default beside the --ours-prefill sets")
    parser.add_argument("--lengths", type=lambda s: [int(t) for t in s.split(",")],
                        help="--sweep: prompt lengths (default: 1-1016 around every signature length)")
    parser.add_argument("--no-rss", action="store_true", help="--sweep: skip the size/RSS table")
    parser.add_argument("--no-peer", action="store_true",
                        help="--sweep: ours only, ratios against the first --ours-prefill set")
    parser.add_argument("--export-child", nargs=3, help=argparse.SUPPRESS)
    parser.add_argument("--rss-child", nargs=2, help=argparse.SUPPRESS)
    results_file.add_argument(parser, "litertlm")
    args = parser.parse_args()
    if args.export_child:
        folder, path, lengths = args.export_child
        return _export_ours_child(folder, path, tuple(int(t) for t in lengths.split("_")))
    if args.rss_child:
        return _rss_child(*args.rss_child)
    if args.sweep:
        args.rounds = args.rounds if "--rounds" in sys.argv else 3
        if args.write_results == "litertlm":
            args.write_results = "litertlm_prefill_sweep"
        results_file.start(args)
        return sweep_main(args)
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
