"""Before/after: one benchmark script of two checkouts, alternated in one run.

Each round runs `benchmarks/<script> --json` once from each checkout (each in
its own subprocess, importing that checkout's keras_attn), alternating the
order from round to round, so that load from other processes hits both
alike. Reported per row: the median over rounds of each checkout's
`ratio_vs_keras` (Keras MHA timed in the same interleaved rounds as ours,
which cancels most of the machine's load), and after / before.

    git worktree add /tmp/base <old-commit>
    python benchmarks/compare_revisions.py /tmp/base . --rounds 3 -- --lengths 512 --no-torch
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile


def _run(checkout, script, extra):
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        path = f.name
    cmd = [sys.executable, os.path.join(checkout, "benchmarks", script), "--json", path] + extra
    subprocess.run(cmd, cwd=checkout, check=True, capture_output=True, text=True)
    with open(path) as f:
        rows = json.load(f)["rows"]
    os.unlink(path)
    return {(r["T"], r["case"], r["step"]): r["ratio_vs_keras"] for r in rows}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before")
    parser.add_argument("after")
    parser.add_argument("--script", default="bench_attention.py")
    parser.add_argument("--rounds", type=int, default=3)
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    args = parser.parse_args(argv[:split])
    extra = argv[split + 1 :]  # passed on to the benchmark script
    print(f"load average at start: {os.getloadavg()}", flush=True)
    results = {"before": [], "after": []}
    for round_index in range(args.rounds):
        order = ["before", "after"] if round_index % 2 == 0 else ["after", "before"]
        for which in order:
            results[which].append(_run(getattr(args, which), args.script, extra))
            print(f"round {round_index + 1}: {which} done, load {os.getloadavg()}", flush=True)
    print(f"load average at end: {os.getloadavg()}")
    print("\n| T | case | pass | Keras/ours before | Keras/ours after | after / before |")
    print("|---|---|---|---|---|---|")
    for key in results["before"][0]:
        before = statistics.median(r[key] for r in results["before"])
        after = statistics.median(r[key] for r in results["after"])
        print(f"| {key[0]} | {key[1]} | {key[2]} | {before:.2f}x | {after:.2f}x | {after / before:.2f} |")


if __name__ == "__main__":
    main()
