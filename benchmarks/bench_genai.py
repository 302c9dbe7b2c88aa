"""ONNX Runtime GenAI: our exported folder vs the GenAI model builder's, same model.

One Hugging Face Llama (random weights, seeded; a real tokenizer trained here),
exported per precision by `keras_attn.convert.from_huggingface` +
`export_onnx_genai` (its defaults: the last token's logits only) and by
`python -m onnxruntime_genai.models.builder` (CPU) twice: as it writes by
default and with `--extra_options prune_lm_head=true` (its head on the last
position only); fp32, int8 and int4 weights (all `MatMulNBits`, blocks of
32, accuracy level 4: ours `quantization="int8"|"int4"`, the builder's
`-p int8|int4`), and ours `quantization="dynamic"` (7-bit `MatMulInteger`)
alone. All folders run in `onnxruntime_genai` in this process, in
alternating rounds: prefill time of a `--prompt`-token prompt and decode
tokens/s over `--new` greedy tokens. Prints a table of medians and, per
pair, the per-round ratios ours / peer in tokens/s (> 1 is faster: median,
lowest, highest, share of rounds ours was faster) and how often the greedy
tokens agree.

    python benchmarks/bench_genai.py                  # 8 layers, hidden 512, vocab 32000
    python benchmarks/bench_genai.py --quick          # 2 layers, hidden 128, vocab 4000

`--folders NAME=PATH ...` times existing folders instead (e.g. bench_real_size.py's);
`--profile DIR` then also runs one generation per folder with onnxruntime's
profiler on (GenAI's own session, through its `enable_profiling` session
option) and prints, per op type, the nodes and median milliseconds of a
decode call: wall-clock ratios on a loaded machine move by several percent,
the per-op split of one graph against another does not.

Needs `onnxruntime-genai` (test extra) and, for the builder, `onnx-ir`
(`pip install onnx-ir`, or `WITH_GENAI_BUILDER=1 bash benchmarks/install_peers.sh`).
"""

import argparse
import atexit
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import _common  # noqa: F401  (sets the environment first)
import results_file  # noqa: E402
import numpy as np  # noqa: E402


def trained_tokenizer(vocab_size):
    """A byte-level BPE tokenizer trained on generated English-like text."""
    from keras_attn.runtimes import bpe_tokenizer

    rng = np.random.default_rng(0)
    syllables = [a + b for a in "bcdfghklmnprstvwz" for b in "aeiou"]
    words = ["".join(rng.choice(syllables, rng.integers(1, 4))) for _ in range(5000)]
    corpus = [" ".join(rng.choice(words, 12)) for _ in range(4000)]
    return bpe_tokenizer(corpus, vocab_size=vocab_size)


def build_hf(folder, args):
    import torch
    import transformers

    tok = trained_tokenizer(args.vocab)
    # The model's vocabulary is --vocab (the output layer's cost); the small
    # training corpus gives the tokenizer fewer merges, i.e. the first ids.
    config = transformers.LlamaConfig(
        vocab_size=max(args.vocab, tok.get_vocab_size()), hidden_size=args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        intermediate_size=args.hidden * 8 // 3 // 64 * 64 or args.hidden * 2,
        max_position_embeddings=args.prompt + args.new, bos_token_id=1, eos_token_id=1,
        pad_token_id=0, initializer_range=0.05, tie_word_embeddings=False)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(config).eval()
    hf.save_pretrained(folder)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>",
                                                pad_token="<pad>", bos_token="<eos>")
    fast.save_pretrained(folder)
    return hf, tok


# (label, ours `quantization`, the builder's `-p` or None)
PRECISIONS = (
    ("fp32", None, "fp32"),
    ("int8 weights", "int8", "int8"),
    ("int4 weights", "int4", "int4"),
    ("int8 dynamic (MatMulInteger)", "dynamic", None),
)
# The builder's graph as it writes it by default, and with its option to
# compute the head for the last position only (ours: `prompt_logits="last"`,
# the default; the builder's option takes the batch's last position).
BUILDER_VARIANTS = (("", ()), (" prune_lm_head", ("--extra_options", "prune_lm_head=true")))


def run_genai(folder, prompt, max_length):
    """(prefill seconds, decode seconds per token, tokens) in onnxruntime_genai."""
    import onnxruntime_genai as og

    model = og.Model(folder)
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=max_length, do_sample=False)
    generator = og.Generator(model, params)
    start = time.perf_counter()
    generator.append_tokens(np.array([prompt], np.int32))
    prefill = time.perf_counter() - start
    steps = 0
    start = time.perf_counter()
    while not generator.is_done():
        generator.generate_next_token()
        steps += 1
    decode = (time.perf_counter() - start) / max(steps, 1)
    return prefill, decode, list(np.asarray(generator.get_sequence(0))[len(prompt):])


def _time(folders, prompt, max_length, rounds):
    """Prefill seconds and decode seconds per token of each folder, one of
    each per round, in alternating rounds after one warm-up; the last
    round's tokens."""
    times = {name: {"prefill": [], "decode": []} for name in folders}
    tokens = {}
    for name, folder in folders.items():  # warm-up
        run_genai(folder, prompt, max_length)
    for r in range(rounds):
        order = list(folders) if r % 2 == 0 else list(reversed(folders))
        for name in order:
            prefill, decode, tokens[name] = run_genai(folders[name], prompt, max_length)
            times[name]["prefill"].append(prefill)
            times[name]["decode"].append(decode)
    return times, tokens


def _medians(times):
    return {n: {k: statistics.median(v) for k, v in t.items()} for n, t in times.items()}


def paired_ratio(ours, peer):
    """Per-round speed ratios ours / peer (peer's seconds / ours, each round's
    two runs back to back): (median, lowest, highest, share of rounds > 1)."""
    ratios = [p / o for o, p in zip(ours, peer)]
    return (statistics.median(ratios), min(ratios), max(ratios),
            sum(r > 1 for r in ratios) / len(ratios))


def time_folders(folders, args):
    """Prefill and decode tokens/s of existing folders (same prompt, same length)."""
    for folder in folders.values():  # the same generation length for every folder
        path = os.path.join(folder, "genai_config.json")
        with open(path) as f:
            config = json.load(f)
        config["search"]["max_length"] = args.prompt + args.new
        config["search"]["min_length"] = args.prompt + args.new  # no early stop: the same steps
        with open(path, "w") as f:
            json.dump(config, f, indent=2)
    rng = np.random.default_rng(1)
    prompt = [int(t) for t in rng.integers(2, args.vocab, args.prompt)]
    times = _time(folders, prompt, args.prompt + args.new, args.rounds)[0]
    med = _medians(times)
    with results_file.recording(args):
        _report_folders(folders, times, med, args)
    if args.profile:
        profile_folders(folders, prompt, args.prompt + args.new, args.profile)


def decode_profile(path, skip=4):
    """`{op type: (nodes per call, median ms per call)}` over the decode calls
    of an onnxruntime profile of one generation (the prompt's call and the
    next `skip` left out), with "(kernels)" (all nodes) and "(call)" (the
    whole `model_run`, executor included)."""
    import bisect

    with open(path) as f:
        events = json.load(f)
    calls = sorted((e for e in events if e.get("name") == "model_run"), key=lambda e: e["ts"])[1 + skip:]
    starts = [c["ts"] for c in calls]
    per_call = [{} for _ in calls]
    for e in events:
        if e.get("cat") != "Node" or not e["name"].endswith("_kernel_time"):
            continue
        i = bisect.bisect_right(starts, e["ts"]) - 1
        if i < 0 or e["ts"] > calls[i]["ts"] + calls[i]["dur"]:
            continue
        nodes, us = per_call[i].get(e["args"]["op_name"], (0, 0))
        per_call[i][e["args"]["op_name"]] = (nodes + 1, us + e["dur"])
    table = {op: (per_call[0][op][0], statistics.median(c.get(op, (0, 0))[1] for c in per_call) / 1000)
             for op in per_call[0]}
    table["(kernels)"] = (sum(n for n, _ in per_call[0].values()),
                          statistics.median(sum(us for _, us in c.values()) for c in per_call) / 1000)
    table["(call)"] = (1, statistics.median(c["dur"] for c in calls) / 1000)
    return table


def profile_folders(folders, prompt, max_length, out):
    """One generation per folder with onnxruntime's profiler on (the folder's
    genai_config.json gains `enable_profiling` for that run only); prints the
    per-op decode tables side by side."""
    import gc
    import glob

    out = os.path.abspath(out)
    os.makedirs(out, exist_ok=True)
    tables = {}
    for name, folder in folders.items():
        path = os.path.join(folder, "genai_config.json")
        with open(path) as f:
            config = json.load(f)
        options = config["model"]["decoder"]["session_options"]
        prefix = os.path.join(out, name.replace(" ", "_"))
        earlier = set(glob.glob(prefix + "_*.json"))
        try:
            options["enable_profiling"] = prefix
            with open(path, "w") as f:
                json.dump(config, f, indent=2)
            run_genai(folder, prompt, max_length)
            gc.collect()  # the session writes its profile when it goes
        finally:
            del options["enable_profiling"]
            with open(path, "w") as f:
                json.dump(config, f, indent=2)
        written = sorted(set(glob.glob(prefix + "_*.json")) - earlier, key=os.path.getmtime)
        tables[name] = decode_profile(written[-1])
        print(f"profile of {name}: {written[-1]}")
    kernels = {name: t["(kernels)"][1] for name, t in tables.items()}
    ops = sorted({op for t in tables.values() for op in t}, key=lambda op: -max(
        t.get(op, (0, 0))[1] for t in tables.values()))
    print("\none decode call, median over the generation's calls: nodes, ms, share of the kernels' time\n")
    print("| op | " + " | ".join(tables) + " |")
    print("|---|" + "---|" * len(tables))
    for op in ops:
        cells = []
        for name, t in tables.items():
            nodes, ms = t.get(op, (0, 0.0))
            share = "" if op.startswith("(") else f", {ms / kernels[name]:.1%}"
            cells.append(f"{nodes}, {ms:.3f}{share}" if nodes else "-")
        print(f"| {op} | " + " | ".join(cells) + " |")


def _report_folders(folders, times, med, args):
    print(f"\nprompt {args.prompt}, {args.new} new tokens, batch 1, CPU; medians of {args.rounds} "
          "alternating rounds\n")
    print("| folder | prefill tok/s | decode tok/s |")
    print("|---|---|---|")
    for name, m in med.items():
        print(f"| {name} | {args.prompt / m['prefill']:.0f} | {1 / m['decode']:.1f} |")
    # Folders named `<who>_<precision>`: the first of each precision against the others.
    groups = {}
    for name in folders:
        groups.setdefault(name.rsplit("_", 1)[-1], []).append(name)
    print("\nper-round ratios in tokens/s (median [lowest, highest], rounds faster):")
    for names in groups.values():
        for peer in names[1:]:
            text = []
            for phase in ("prefill", "decode"):
                median, low, high, faster = paired_ratio(times[names[0]][phase], times[peer][phase])
                text.append(f"{phase} {median:.3f}x [{low:.2f}, {high:.2f}] {faster:.0%}")
            print(f"- {names[0]} / {peer}: " + "; ".join(text))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    _common.add_llm_size_args(parser)
    parser.add_argument("--writer", default="auto", choices=("auto", "direct", "traced"),
                        help="export_onnx_genai's graph writer (traced: tf2onnx's graph, from before the direct writer)")
    parser.add_argument("--folders", nargs="+", metavar="NAME=PATH",
                        help="time these GenAI folders instead of exporting (e.g. the real-size "
                             "benchmark's, benchmarks/bench_real_size.py); prompt ids from --vocab")
    parser.add_argument("--profile", metavar="DIR",
                        help="with --folders: also profile one generation per folder (onnxruntime's "
                             "per-node profile, files in DIR) and print each op type's share of a decode call")
    results_file.add_argument(parser, "genai")
    args = parser.parse_args()
    _common.apply_quick(args)
    results_file.start(args)
    if args.folders:
        time_folders(dict(item.split("=", 1) for item in args.folders), args)
        return

    from keras_attn.convert import from_huggingface
    from keras_attn.runtimes.onnx_genai import export_onnx_genai

    work = tempfile.mkdtemp(prefix="bench_genai_")
    atexit.register(shutil.rmtree, work, True)  # bundles and folders of 0.5-1 GB
    hf_dir = os.path.join(work, "hf")
    hf, tok = build_hf(hf_dir, args)
    max_length = args.prompt + args.new
    lm = from_huggingface(hf_dir)
    folders, export_s = {}, {}
    for precision, ours_q, peer_p in PRECISIONS:
        name, folder = f"keras_attn {precision}", os.path.join(work, f"ours_{ours_q}")
        start = time.perf_counter()
        export_onnx_genai(lm, folder, max_length=max_length, tokenizer=hf_dir, eos_token_id=1,
                          quantization=ours_q, writer=args.writer)
        folders[name], export_s[name] = folder, time.perf_counter() - start
        if peer_p is None:
            continue
        for suffix, extra in BUILDER_VARIANTS:
            name = f"genai builder {precision}{suffix}"
            folder = os.path.join(work, f"builder_{peer_p}{suffix.strip()}")
            start = time.perf_counter()
            subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", hf_dir,
                            "-o", folder, "-p", peer_p, "-e", "cpu",
                            "-c", os.path.join(work, "cache"), *extra], check=True, capture_output=True)
            folders[name], export_s[name] = folder, time.perf_counter() - start
            with open(os.path.join(folder, "genai_config.json")) as f:  # same generation length
                config = json.load(f)
            config["search"]["max_length"] = max_length
            with open(os.path.join(folder, "genai_config.json"), "w") as f:
                json.dump(config, f)

    rng = np.random.default_rng(1)
    prompt = [int(t) for t in rng.integers(2, tok.get_vocab_size(), args.prompt)]
    times, tokens = _time(folders, prompt, max_length, args.rounds)
    with results_file.recording(args):
        rows, ratios = _report(folders, times, tokens, export_s, tok, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(rows=rows, ratios=ratios, times=times, args=vars(args)), f, indent=2)


def _report(folders, times, tokens, export_s, tok, args):
    """Prints the table and the per-round ratios; returns both."""
    med = _medians(times)
    rows = []
    print(f"\nLlama {args.layers} layers, hidden {args.hidden}, {args.heads} heads "
          f"({args.kv_heads} KV), vocabulary {max(args.vocab, tok.get_vocab_size())} "
          f"(tokenizer {tok.get_vocab_size()}), prompt {args.prompt}, "
          f"{args.new} new tokens, batch 1, CPU; medians of {args.rounds} alternating rounds\n")
    print("| export | prefill ms | prefill tok/s | decode ms/token | decode tok/s | export s |")
    print("|---|---|---|---|---|---|")
    for name in folders:
        m = med[name]
        row = dict(name=name, prefill_ms=m["prefill"] * 1e3, prefill_tps=args.prompt / m["prefill"],
                   decode_ms=m["decode"] * 1e3, decode_tps=1 / m["decode"], export_s=export_s[name])
        rows.append(row)
        print(f"| {name} | {row['prefill_ms']:.1f} | {row['prefill_tps']:.0f} | "
              f"{row['decode_ms']:.2f} | {row['decode_tps']:.1f} | {row['export_s']:.1f} |")
    ratios = {}
    print(f"\nours / builder tokens/s, per round (median [lowest, highest], rounds faster), "
          f"{args.rounds} rounds:")
    for precision in (p for p, _, peer_p in PRECISIONS if peer_p):
        ours = f"keras_attn {precision}"
        for suffix, _ in BUILDER_VARIANTS:
            peer = f"genai builder {precision}{suffix}"
            agree = float(np.mean([a == b for a, b in zip(tokens[ours], tokens[peer])]))
            entry = dict(agreement=agree)
            for phase in ("prefill", "decode"):
                median, low, high, faster = paired_ratio(times[ours][phase], times[peer][phase])
                entry[phase], entry[phase + "_range"], entry[phase + "_faster"] = median, (low, high), faster
            ratios[precision + suffix] = entry
            print(f"- {precision}, vs builder{suffix or ' default'}: prefill {entry['prefill']:.3f}x "
                  f"[{entry['prefill_range'][0]:.2f}, {entry['prefill_range'][1]:.2f}] "
                  f"{entry['prefill_faster']:.0%}; decode {entry['decode']:.3f}x "
                  f"[{entry['decode_range'][0]:.2f}, {entry['decode_range'][1]:.2f}] "
                  f"{entry['decode_faster']:.0%}; greedy tokens equal at {agree:.0%}")
    return rows, ratios


if __name__ == "__main__":
    main()
