"""Runs the side-by-side benchmarks and writes their sections of benchmarks/RESULTS.md.

    python benchmarks/run_all.py                    # all seven sections (~30-60 min on 2 busy cores)
    python benchmarks/run_all.py --only attention   # one section; every other byte of the file stays
    python benchmarks/run_all.py --quick            # a smoke run, written to RESULTS.quick.md

Each benchmark runs in its own process; its table, the run's provenance and the
issue's targets computed from the same rows replace that benchmark's section
(between its `<!-- results:NAME -->` markers, see results_file.py). Sections
of other scripts in the file are left alone.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import _common  # noqa: E402,F401  (the benchmarks' environment, inherited by each run)
import results_file  # noqa: E402

FULL = {
    "long": [],
    "export": [],
    "attention": ["--repeats", "7"],
    "head_groups": ["--repeats", "7"],
    "blocks": ["--repeats", "5"],
    "decode": ["--repeats", "30"],
    "input": [],
}
QUICK = {
    "attention": ["--repeats", "2", "--lengths", "128"],
    "head_groups": ["--repeats", "2", "--lengths", "512"],
    "blocks": ["--repeats", "2", "--quick"],
    "long": ["--lengths", "2048", "4096", "--repeats", "1"],
    "export": ["--repeats", "3", "--calls", "5"],
    "decode": ["--repeats", "3", "--lengths", "32", "--skip-tflite"],
    "input": ["--examples", "256", "--rounds", "1", "--modes", "graph"],
}
TITLES = {
    "attention": "MultiHeadAttention vs keras.layers.MultiHeadAttention (and torch)",
    "head_groups": "Attention in independent head groups (the unblocked core split n ways)",
    "blocks": "Transformer blocks vs KerasHub (tokens/s, fraction of the matmul ceiling)",
    "long": "Long sequences: peak RSS and time (fresh subprocess per config)",
    "export": "Exported encoder classifier: TFLite (XNNPACK) and onnxruntime, batch 1",
    "decode": "Incremental decoding: per-token latency, KV cache vs recompute vs KerasHub",
    "input": "Variable-length training input: fixed padding vs pad-to-batch vs length buckets",
}


# Notes that belong to one section: written under its table on every run.
NOTES = {
    "long": [
        "- Each configuration is its own subprocess, run one after the other, so the time "
        "columns are NOT interleaved (one warm run each); the peak RSS includes ~0.6 GiB of an "
        "idle TensorFlow process. T=2048/4096 use the unblocked path (automatic blocking starts "
        "above 4096 x 4096 scores), T>=8192 the blocked one.",
        "- \"not run\": Keras configurations whose score tensors alone would need more than "
        "9 GiB are not started (the issue reports `std::bad_alloc` for Keras training at "
        "T=16384).",
    ],
    "blocks": [
        "- The matmul ceiling is measured in the same rounds as each row, so it varies from row "
        "to row with the machine's load (see the ceiling column).",
        "- XLA rows (`jit_compile=True`): XLA compiles ours and KerasHub into nearly the same "
        "fused kernels (it fuses the softmax and LayerNorm passes our hand-written gradients "
        "save in graph mode), so those ratios sit at parity within the noise.",
        "- \"matmuls only\" times the step's matmuls one after the other; TensorFlow overlaps "
        "independent ops in a real step, so a step can read a higher fraction than this "
        "reference.",
    ],
}


def _fmt(x):
    return "n/a" if x is None else f"{x:.2f}"


def targets(data):
    """`{section: lines}` checking the issue's targets against that section's rows."""
    out = {}
    blocks = data.get("blocks", {}).get("rows", [])
    train = [r for r in blocks if r["step"] == "train"]
    lines = out.setdefault("blocks", [])
    for t, d in ((128, 256), (512, 256)):
        got = [r["ratio"] for r in train if (r["T"], r["d"]) == (t, d)]
        if got:
            lines.append(f"- train step vs KerasHub at ({t}, {d}), target >= 1.15x: "
                         + ", ".join(f"{r['block']}/{r['mode']} {r['ratio']:.2f}x"
                                     for r in train if (r["T"], r["d"]) == (t, d))
                         + (" -> met" if min(got) >= 1.15 else " -> MISSED"))
    if blocks:
        worst = min(blocks, key=lambda r: r["ratio"])
        lines.append(f"- never below 1.0x vs KerasHub: lowest {worst['ratio']:.2f}x "
                     f"({worst['block']} {worst['step']} {worst['mode']} T={worst['T']} d={worst['d']})"
                     + (" -> met" if worst["ratio"] >= 1.0 else " -> MISSED"))
        d512 = [r for r in train if r["d"] == 512]
        if d512:
            worst = min(r["ours_ceiling"] for r in d512)
            lines.append("- train step at d=512, target >= 85% of the ceiling (every row): ours "
                         + ", ".join(f"{r['block']}/{r['mode']} T={r['T']} {100 * r['ours_ceiling']:.0f}%"
                                     for r in d512)
                         + (" -> met" if worst >= 0.85 else " -> MISSED"))
    att = [r for r in data.get("attention", {}).get("rows", [])
           if r["T"] == 512 and r["case"] == "self" and r["step"] == "forward"]
    for r in att:
        out.setdefault("attention", []).append(
            f"- forward self-attention at T=512 vs Keras MHA, target >= 1.2x: "
            f"{r['ratio_vs_keras']:.2f}x" + (" -> met" if r["ratio_vs_keras"] >= 1.2 else " -> MISSED"))
    lines = out.setdefault("long", [])
    long_rows = data.get("long", {}).get("rows", [])
    for t, mode in ((32768, "fwd"), (16384, "fwd+bwd")):
        for r in long_rows:
            if r["T"] == t and r["mode"] == mode and r["impl"] == "ours":
                peak = r.get("peak_gib")
                lines.append(f"- ours {mode} at T={t}, target < 2 GiB peak RSS: {_fmt(peak)} GiB"
                             + (" -> met" if peak is not None and peak < 2 else " -> MISSED"))
    check = data.get("long", {}).get("check") or {}
    for key, value in check.items():
        if key.startswith("max_abs_diff"):
            worst = max(value.values())
            lines.append(f"- blocked vs unblocked {key.replace('max_abs_diff_', '')}, target 1e-4: "
                         f"max abs diff {worst:.2e}" + (" -> met" if worst <= 1e-4 else " -> MISSED"))
    if "T4096_blocked_over_unblocked" in check:
        ratio = check["T4096_blocked_over_unblocked"]
        lines.append(f"- blocked / unblocked time at T=4096, target <= 1.3: {ratio:.2f}"
                     + (" -> met" if ratio <= 1.3 else " -> MISSED"))
    for r in data.get("export", {}).get("rows", []):
        out.setdefault("export", []).append(
            f"- {r['format']} latency vs KerasHub-built, target ours <= KerasHub: "
            f"{r['ours_ms']:.3f} ms vs {r['hub_ms']:.3f} ms"
            + (" -> met" if r["ours_ms"] <= r["hub_ms"] else " -> MISSED"))
    return {name: lines for name, lines in out.items() if lines}


def section_body(name, table, data, provenance_line):
    """What run_all writes between section `name`'s markers."""
    parts = [provenance_line, "", table.strip("\n")]
    lines = targets({name: data}).get(name, []) if data is not None else []
    if lines:
        parts += ["", "Targets (issue 6):", "", *lines]
    if name in NOTES:
        parts += ["", "Notes:", "", *NOTES[name]]
    return "\n".join(parts)


def skeleton(plan):
    """A results file holding an empty, marked section per benchmark of `plan`."""
    text = ["# Benchmark results", "",
            "Written section by section by `python benchmarks/run_all.py`.", ""]
    for name in plan:
        text += [f"## {TITLES[name]}: `python benchmarks/run_all.py --only {name}`", "",
                 f"<!-- results:{name} -->", "Not run yet.", f"<!-- /results:{name} -->", ""]
    return "\n".join(text)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--only", nargs="+", choices=list(FULL))
    parser.add_argument("--output", help="default: benchmarks/RESULTS.md "
                                         "(RESULTS.quick.md with --quick), made if missing")
    args = parser.parse_args(argv)
    plan = QUICK if args.quick else FULL
    names = args.only or list(plan)
    output = args.output or os.path.join(HERE, "RESULTS.quick.md" if args.quick else "RESULTS.md")
    if not os.path.exists(output):
        with open(output, "w") as f:
            f.write(skeleton(plan))
    with open(output) as f:  # fail before an hour of benchmarks, not after
        text = f.read()
    for name in names:
        try:
            results_file.get_section(text, name)
        except ValueError as error:
            parser.error(f"{output}: {error}")

    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            md, js = os.path.join(tmp, name + ".md"), os.path.join(tmp, name + ".json")
            cmd = [sys.executable, os.path.join(HERE, f"bench_{name}.py"), *plan[name],
                   "--markdown", md, "--json", js]
            command = "python benchmarks/run_all.py" + (" --quick" if args.quick else "") + (
                f" --only {name}")
            line = results_file.provenance(command)
            print("running", " ".join(cmd[1:]), flush=True)
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode == 0 and os.path.exists(md):
                body = section_body(name, open(md).read(), json.load(open(js)), line)
            else:
                tail = "\n".join(proc.stderr.strip().splitlines()[-5:])
                body = f"{line}\n\nFAILED (exit {proc.returncode}):\n\n```\n{tail}\n```"
            print(body, flush=True)
            results_file.write_section(name, body, output)
    print("wrote", output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
