"""Every example at its default (documented) scale, run to the end, exports included.

The tests run the examples at small scales (tests/project/test_examples.py,
tests/project/test_image_examples.py, tests/project/test_mobile_example.py); the figures the
README quotes come from the default settings, which take minutes each on 2
CPU cores. This script runs each example once with its defaults in a
subprocess (one after the other), and prints its exit status, wall time, the
accuracy and export lines it printed and the summary JSON it wrote.

    python benchmarks/bench_examples.py                    # all (about an hour on 2 cores)
    python benchmarks/bench_examples.py translate_dates text_classification
    python benchmarks/bench_examples.py finetune_and_ship --write-results finetune_and_ship

`--write-results SECTION` writes the table of the one example that has one
(`TABLES`) into benchmarks/RESULTS.md.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import results_file  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = {
    # name: (extra arguments, summary JSON written in --output-dir or None)
    "quickstart": ([], None),
    "translate_dates": ([], None),
    "bahdanau_seq2seq": ([], None),
    "text_classification": ([], None),
    "distributed_training": ([], None),
    "image_self_attention": ([], "results.json"),
    "attend_and_caption": ([], "results.json"),
    "translate_dates_mobile": ([], "mobile_summary.json"),
    "finetune_and_ship": ([], "summary.json"),
    "semantic_search_mobile": ([], "summary.json"),
}
KEYS = ("accuracy", "exact", "agreement", "- Keras|", "export failed", "Error")


def run(name, directory):
    args, summary_file = EXAMPLES[name]
    out_dir = os.path.join(directory, name)
    command = [sys.executable, os.path.join(ROOT, "examples", f"{name}.py"), *args,
               "--output-dir", out_dir]
    if name not in ("image_self_attention", "attend_and_caption", "text_classification",
                    "distributed_training", "finetune_and_ship", "semantic_search_mobile"):
        command += ["--data-dir", os.path.join(directory, "tfds")]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               KERAS_BACKEND="tensorflow", TF_CPP_MIN_LOG_LEVEL="2")
    env.pop("TF_CONFIG", None)
    start = time.perf_counter()
    proc = subprocess.run(command, capture_output=True, text=True, env=env, cwd=directory)
    seconds = time.perf_counter() - start
    lines = [line for line in proc.stdout.splitlines() if any(k in line for k in KEYS)]
    summary = None
    if summary_file and os.path.exists(os.path.join(out_dir, summary_file)):
        with open(os.path.join(out_dir, summary_file)) as f:
            summary = json.load(f)
    return proc.returncode, seconds, lines, summary, proc.stderr[-2000:]


def finetune_table(summary, seconds):
    """Exact match of the base and of each adapter, in Keras and in each runtime."""
    runtimes = ("keras", "onnxruntime_genai", "litert_lm")
    lines = ["| model | answer form | Keras | ONNX Runtime GenAI | LiteRT-LM | runtime answers equal to Keras's |",
             "|---|---|---|---|---|---|"]
    for form, score in summary["base"].items():
        lines.append(f"| base (no adapter) | {form} | {score:.2f} | | | |")
    for form, adapter in summary["adapters"].items():
        scores = [adapter["keras"]] + [adapter[r]["exact_match"] for r in runtimes[1:]]
        equal = " / ".join(f"{adapter[r]['answers_equal_to_keras']:.0%}" for r in runtimes[1:])
        lines.append(f"| LoRA adapter `{form}` | {form} | "
                     + " | ".join(f"{v:.2f}" for v in scores) + f" | {equal} |")
    return ("Exact match on 100 held-out dates (`examples/finetune_and_ship.py` at its defaults: "
            "a 2-layer d=64 Llama-shaped base pretrained in the run, rank-16 PEFT-style LoRA on "
            "q/k/v/o per answer form, one base per runtime with one adapter file per fine-tune); "
            f"the whole run took {seconds / 60:.1f} min.\n\n" + "\n".join(lines))


TABLES = {"finetune_and_ship": finetune_table}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("names", nargs="*", help=f"examples to run (default all): {list(EXAMPLES)}")
    results_file.add_argument(parser)
    args = results_file.start(parser.parse_args(argv))
    names = args.names or list(EXAMPLES)
    unknown = sorted(set(names) - set(EXAMPLES))
    if unknown:
        sys.exit(f"unknown examples {unknown}; choose from {list(EXAMPLES)}")
    if args.write_results and (len(names) != 1 or names[0] not in TABLES):
        sys.exit(f"--write-results takes one example with a table: {sorted(TABLES)}")
    failed = []
    with tempfile.TemporaryDirectory(prefix="bench_examples_") as directory:
        for name in names:
            code, seconds, lines, summary, stderr = run(name, directory)
            print(f"== {name}: exit {code}, {seconds / 60:.1f} min", flush=True)
            for line in lines:
                print(f"   {line.strip()}")
            if summary is not None:
                figures = {k: v for k, v in summary.items()
                           if isinstance(v, (int, float)) and not isinstance(v, bool)}
                print(f"   summary: {json.dumps(figures)}")
            if code != 0:
                failed.append(name)
                print("   stderr tail: " + stderr.replace("\n", "\n   "))
            elif args.write_results:
                results_file.finish(args, TABLES[name](summary, seconds))
    print(f"examples that did not run to the end: {failed or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
