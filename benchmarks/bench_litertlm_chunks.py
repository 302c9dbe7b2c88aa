"""Which prefill calls LiteRT-LM makes (issue 54): one small Llama (4 x 256,
vocabulary 4000, int8 weights, cache 1024) exported with prefill lengths
(32, 128), (128,) and (32,), all loaded in one `litert_lm.Engine` process;
prefill milliseconds (the engine's counter) by prompt length, medians of
alternating rounds. At this size a call's fixed cost shows, so the times
count the calls: where (32, 128) takes what (32,) takes, the runtime ran
calls of 32 (`keras_attn.runtimes.litertlm.prefill_chunks`).

    python benchmarks/bench_litertlm_chunks.py [--rounds 15] [--work DIR]
"""

import argparse
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common  # noqa: E402,F401  (sets the environment first)
import results_file  # noqa: E402
from bench_genai import build_hf  # noqa: E402
from bench_litertlm import prompt_ids, run_bundle  # noqa: E402

SETS = ((32, 128), (128,), (32,))
LENGTHS = (32, 33, 64, 96, 97, 107, 119, 127, 128, 129, 160)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--work", default=os.path.join(tempfile.gettempdir(), "bench_litertlm_chunks"))
    results_file.add_argument(parser, "litertlm_chunks")
    args = parser.parse_args()
    results_file.start(args)
    import litert_lm
    import tokenizers

    from keras_attn.convert import from_huggingface
    from keras_attn.runtimes.litertlm import export_litertlm, prefill_chunks

    hf_dir = os.path.join(args.work, "hf")
    if not os.path.exists(os.path.join(hf_dir, "config.json")):
        build_hf(hf_dir, argparse.Namespace(vocab=4000, hidden=256, layers=4, heads=4, kv_heads=2,
                                            prompt=1000, new=24))
    paths, lm = {}, None
    for lengths in SETS:
        paths[lengths] = os.path.join(args.work, "_".join(map(str, lengths)) + ".litertlm")
        if not os.path.exists(paths[lengths]):
            lm = lm or from_huggingface(hf_dir)
            export_litertlm(lm, paths[lengths], tokenizer=hf_dir, max_length=1024,
                            prefill_lengths=lengths, quantization="dynamic", stop_token_ids=[1],
                            min_agreement=0.0)
    tok = tokenizers.Tokenizer.from_file(os.path.join(hf_dir, "tokenizer.json"))
    texts = {n: prompt_ids(tok, n) for n in LENGTHS}
    engines = {s: litert_lm.Engine(p, backend=litert_lm.Backend.CPU(), enable_benchmark=True)
               for s, p in paths.items()}
    ms = {(s, n): [] for s in SETS for n in LENGTHS}
    loads = [os.getloadavg()[0]]
    try:
        for engine in engines.values():
            run_bundle(engine, texts[LENGTHS[-1]], 1)
        for r in range(args.rounds):
            for i, n in enumerate(LENGTHS):
                for s in (SETS if (r + i) % 2 == 0 else SETS[::-1]):
                    tps, _, _, info = run_bundle(engines[s], texts[n], 1)
                    ms[s, n].append(1000 * info.last_prefill_token_count / tps)
            loads.append(os.getloadavg()[0])
    finally:
        for engine in engines.values():
            engine.close()
    lines = [(f"Prefill ms by prompt length, medians of {args.rounds} alternating rounds, load "
              f"{min(loads):.1f}-{max(loads):.1f}; in brackets the calls `prefill_chunks` predicts.\n"),
             "| prompt tokens | " + " | ".join(f"{list(s)} ms" for s in SETS) + " |",
             "|---" * (1 + len(SETS)) + "|"]
    for n in LENGTHS:
        cells = []
        for s in SETS:
            calls = prefill_chunks(s, n, 1024)
            shape = " + ".join(f"{sum(1 for c in calls if c[0] == t)}x{t}"
                               for t in sorted({c[0] for c in calls}, reverse=True))
            cells.append(f"{statistics.median(ms[s, n]):.0f} ({shape})")
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    # Printed and written at the end: litert_lm's import replaces sys.stdout.
    print("\n".join(lines))
    results_file.finish(args, "\n".join(lines))


if __name__ == "__main__":
    main()
