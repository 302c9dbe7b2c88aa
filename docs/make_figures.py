"""Draws the documentation's figures into docs/images/ (nothing is drawn by hand).

    python docs/make_figures.py                      # every figure (trains the demo model: minutes)
    python docs/make_figures.py --only memory architecture

- `dates_attention.png`: cross-attention of the demo's date translator, trained
  here with the demo's code (`keras_attn.training.quickstart`), drawn by
  `keras_attn.visualize.plot_attention`.
- `dates_heads.png`: every attention map of the same model for the same input
  (`attention_maps` + `plot_heads`): encoder self-attention, decoder self- and
  cross-attention, per head.
- `architecture.png`: the encoder-decoder the demo builds, layer by layer.
- `long_sequence_memory.png`: peak memory against sequence length, read from the
  long-sequence table of `benchmarks/RESULTS.md` (`benchmarks/bench_long.py`).
- `results_attention.png`, `results_runtimes.png` (`--only results`): the headline
  comparisons of the benchmarks page, read from the current tables of
  `benchmarks/RESULTS.md` (attention time against Keras by length; ONNX Runtime GenAI and
  LiteRT-LM tokens/s and peak memory beside the peers' exports).
"""

import argparse
import os
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
IMAGES = ROOT / "docs" / "images"
FIGURES = ("attention", "architecture", "memory", "results")
RESULTS_MD = ROOT / "benchmarks" / "RESULTS.md"


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def long_sequence_rows(results_md):
    """`[(T, pass, ours GiB, keras GiB or None)]` from the long-sequence table."""
    text = pathlib.Path(results_md).read_text()
    section = text.split("## Long sequences", 1)
    if len(section) < 2:
        raise ValueError(f"{results_md} has no '## Long sequences' section")
    rows = []
    for line in section[1].splitlines()[1:]:
        if line.startswith("## "):
            break
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 4 or not cells[0].isdigit():
            continue
        keras = float(cells[3]) if re.fullmatch(r"[0-9.]+", cells[3]) else None
        rows.append((int(cells[0]), cells[1], float(cells[2]), keras))
    if not rows:
        raise ValueError(f"no rows in the long-sequence table of {results_md}")
    return rows


def draw_memory(path, results_md=ROOT / "benchmarks" / "RESULTS.md"):
    plt = _pyplot()
    rows = long_sequence_rows(results_md)
    fig, ax = plt.subplots(figsize=(7, 4))
    for kind, style in (("fwd+bwd", "-"), ("fwd", "--")):
        mine = [(t, o) for t, p, o, _ in rows if p == kind]
        theirs = [(t, k) for t, p, _, k in rows if p == kind and k is not None]
        ax.plot(*zip(*mine), style, marker="o", color="tab:blue", label=f"keras_attn {kind}")
        if theirs:
            ax.plot(*zip(*theirs), style, marker="s", color="tab:red",
                    label=f"keras.layers.MultiHeadAttention {kind}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("sequence length T (batch 1, 8 heads, d=256)")
    ax.set_ylabel("peak RSS of the process (GiB)")
    ax.set_title("Memory of one attention layer (Keras not run where its scores alone exceed 9 GiB)",
                 fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def section_tables(name, results_md=RESULTS_MD):
    """`[(header, rows)]` of the tables in section `name` of the results file (its markers)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import results_file

    body = results_file.get_section(pathlib.Path(results_md).read_text(), name)
    tables, current = [], []
    for line in body.splitlines() + [""]:
        if line.startswith("|"):
            current.append([c.strip() for c in line.strip().strip("|").split("|")])
        elif current:
            tables.append((current[0], current[2:]))
            current = []
    if not tables:
        raise ValueError(f"section {name!r} of {results_md} has no table")
    return tables


def _number(cell):
    """The first number of a cell (`"1.21x"`, `"197 / 7.4"`, `"3.98 (was 5.86)"`)."""
    match = re.search(r"\d+(?:\.\d+)?", cell)
    if not match:
        raise ValueError(f"no number in table cell {cell!r}")
    return float(match.group(0))


def _pair(cell):
    """`(a, b)` of an `"a / b"` cell."""
    a, b = cell.split("/")
    return _number(a), _number(b)


def draw_results_attention(path, results_md=RESULTS_MD):
    """Keras MHA time / ours by case and length, and the long-sequence times by length."""
    plt = _pyplot()
    header, rows = section_tables("attention", results_md)[0]
    col = header.index("Keras / ours")
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    cases = list(dict.fromkeys(r[1] for r in rows))
    labels, width = [], 0.2
    for k, (length, step) in enumerate([(t, s) for t in ("128", "512") for s in ("forward", "fwd+bwd")]):
        values = [_number(next(r[col] for r in rows if r[:3] == [length, case, step])) for case in cases]
        xs = [i + (k - 1.5) * width for i in range(len(cases))]
        bars = left.bar(xs, values, width, label=f"T={length} {step}")
        left.bar_label(bars, labels=[f"{v:.2f}" for v in values], fontsize=6, rotation=90, padding=2)
        labels = cases
    left.axhline(1.0, color="black", linewidth=0.8)
    left.set_xticks(range(len(labels)), labels, fontsize=8)
    left.set_ylim(0, 1.8)
    left.set_ylabel("Keras MHA time / keras_attn time (> 1: ours faster)")
    left.set_title("MultiHeadAttention vs keras.layers.MultiHeadAttention\n(batch 8, d_model 256, 8 heads)",
                   fontsize=9)
    left.legend(fontsize=7, loc="upper left", ncol=2)

    header, rows = section_tables("long", results_md)[0]
    for kind, style in (("fwd+bwd", "-"), ("fwd", "--")):
        ours = [(int(r[0]), _number(r[4])) for r in rows if r[1] == kind]
        keras = [(int(r[0]), _number(r[5])) for r in rows if r[1] == kind and "not run" not in r[5]]
        right.plot(*zip(*ours), style, marker="o", color="tab:blue", label=f"keras_attn {kind}")
        right.plot(*zip(*keras), style, marker="s", color="tab:red", label=f"Keras MHA {kind}")
    right.set_xscale("log", base=2)
    right.set_yscale("log")
    right.set_xlabel("sequence length T")
    right.set_ylabel("seconds (one warm run)")
    right.set_title("Long sequences: time by length (batch 1, 8 heads, d=256;\n"
                    "Keras not run where its scores alone exceed 9 GiB)", fontsize=9)
    right.grid(True, alpha=0.3)
    right.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def draw_results_runtimes(path, results_md=RESULTS_MD):
    """Tokens/s and peak memory of our LLM-runtime exports beside the peers' exports."""
    plt = _pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    speed = {}  # (model, precision) -> ours prefill, ours decode, peer prefill, peer decode
    for name, model in (("genai_speed_qwen05b", "Qwen 0.5B"), ("genai_speed_llama1b", "Llama 1B"),
                        ("genai_speed_qwen15b", "Qwen 1.5B")):
        header, rows = section_tables(name, results_md)[0]
        if header[0] == "folder":  # bench_genai's own table: a row per folder, `<exporter>_<precision>`
            tok_s = {r[0]: (_number(r[1]), _number(r[2])) for r in rows}
            for folder in tok_s:
                if folder.startswith("keras_attn_"):
                    precision = folder[len("keras_attn_"):]
                    speed[(model, precision)] = (*tok_s[folder], *tok_s["builder_" + precision])
            continue
        for r in rows:
            precision = r[0].split()[0]
            speed[(model, precision)] = (*_pair(r[1]), *_pair(r[2]))
    keys = list(speed)
    labels = [f"{m}\n{p}" for m, p in keys]
    for ax, phase, (a, b) in ((axes[0][0], "prefill", (0, 2)), (axes[0][1], "decode", (1, 3))):
        xs = range(len(keys))
        for shift, column, label in ((-0.2, a, "keras_attn `export_onnx_genai`"), (0.2, b, "GenAI model builder")):
            values = [speed[k][column] for k in keys]
            bars = ax.bar([x + shift for x in xs], values, 0.4, label=label)
            ax.bar_label(bars, labels=[f"{v:g}" for v in values], fontsize=6, padding=1)
        ax.set_xticks(list(xs), labels, fontsize=7)
        ax.set_ylabel(f"{phase} tokens/s")
        ax.set_title(f"ONNX Runtime GenAI {phase}, same checkpoint, alternating rounds", fontsize=9)
        ax.legend(fontsize=7)

    header, rows = section_tables("genai_export", results_md)[0]
    ours_col = next(i for i, h in enumerate(header) if "process peak GB" in h)
    peer_col = header.index("builder: peak GB")
    ax = axes[1][0]
    labels = [f"{r[0].replace('Qwen2.5-', 'Qwen ').replace('Llama-3.2-', 'Llama ')}\n{r[1]}" for r in rows]
    xs = range(len(rows))
    for shift, column, label in ((-0.2, ours_col, "keras_attn (conversion + export + verification)"),
                                 (0.2, peer_col, "GenAI model builder (its whole run)")):
        values = [_number(r[column]) for r in rows]
        bars = ax.bar([x + shift for x in xs], values, 0.4, label=label)
        ax.bar_label(bars, labels=[f"{v:g}" for v in values], fontsize=6, padding=1)
    ax.set_xticks(list(xs), labels, fontsize=6)
    ax.set_ylabel("peak RSS of the process (GB)")
    ax.set_title("ONNX Runtime GenAI export: peak memory", fontsize=9)
    ax.legend(fontsize=7)

    header, rows = section_tables("litertlm_speed", results_md)[0]
    ax = axes[1][1]
    runs = [r[0] for r in rows]
    for k, (who, col) in enumerate((("keras_attn", 1), ("litert-torch", 2))):
        for j, phase in enumerate(("prefill", "decode")):
            values = [_pair(r[col])[j] for r in rows]
            xs = [j * (len(runs) + 1) + i + (k - 0.5) * 0.4 for i in range(len(runs))]
            bars = ax.bar(xs, values, 0.4, color=("tab:blue", "tab:orange")[k],
                          label=who if j == 0 else None)
            ax.bar_label(bars, labels=[f"{v:g}" for v in values], fontsize=6, padding=2)
    ax.set_xticks([j * (len(runs) + 1) + i for j in range(2) for i in range(len(runs))],
                  [f"{phase}\n{run}" for phase in ("prefill", "decode") for run in runs], fontsize=7)
    ax.set_ylabel("tokens/s")
    ax.set_title("LiteRT-LM, Qwen2.5-0.5B int8 bundles in one engine (two runs)", fontsize=9)
    ax.legend(fontsize=7)
    fig.suptitle("Drawn from benchmarks/RESULTS.md by docs/make_figures.py", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def draw_architecture(path):
    plt = _pyplot()
    from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

    fig, ax = plt.subplots(figsize=(8, 5.2))
    ax.set_xlim(0, 10)
    ax.set_ylim(0, 10)
    ax.axis("off")

    def box(x, y, text, color, w=3.6, h=0.8):
        ax.add_patch(FancyBboxPatch((x - w / 2, y - h / 2), w, h, boxstyle="round,pad=0.05",
                                    facecolor=color, edgecolor="black", linewidth=0.8))
        ax.text(x, y, text, ha="center", va="center", fontsize=8.5, family="monospace")

    def arrow(a, b):
        ax.add_patch(FancyArrowPatch(a, b, arrowstyle="-|>", mutation_scale=10, linewidth=0.8))

    enc, dec = 2.5, 7.5
    box(enc, 0.8, "encoder_inputs (characters)", "#eeeeee")
    box(enc, 2.4, "TokenAndPositionEmbedding", "#cfe2f3")
    box(enc, 4.2, "TransformerEncoderBlock\n(self-attention + FFN)", "#d9ead3", h=1.1)
    box(enc, 6.2, "TransformerEncoderBlock", "#d9ead3")
    box(dec, 0.8, "decoder_inputs (shifted ISO date)", "#eeeeee")
    box(dec, 2.4, "TokenAndPositionEmbedding", "#cfe2f3")
    box(dec, 4.2, "TransformerDecoderBlock\n(causal self-attn, cross-attn, FFN)", "#fce5cd", h=1.1)
    box(dec, 6.2, "TransformerDecoderBlock", "#fce5cd")
    box(dec, 7.8, "Dense -> logits", "#eeeeee")
    for x in (enc, dec):
        arrow((x, 1.2), (x, 2.0))
        arrow((x, 2.8), (x, 3.65))
        arrow((x, 4.75), (x, 5.8))
    arrow((dec, 6.6), (dec, 7.4))
    arrow((enc + 1.8, 6.2), (dec - 1.8, 4.4))
    arrow((enc + 1.8, 6.2), (dec - 1.8, 6.2))
    ax.text(5.0, 5.55, "cross-attention\n(keys, values)", ha="center", fontsize=8, style="italic")
    ax.text(5.0, 9.3, "The demo's date translator: every box is a keras_attn layer",
            ha="center", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def draw_attention(path, num_train=20_000, epochs=3):
    """Trains the demo's model (no export) and draws its cross-attention."""
    from keras_attn.training import quickstart

    parser = quickstart.add_dates_arguments(argparse.ArgumentParser(), epochs=epochs,
                                            num_train=num_train)
    args = parser.parse_args(["--output-dir", str(path.parent / "_figure_run"), "--verbose", "2"])
    import keras

    keras.utils.set_random_seed(args.seed)
    (train, validation, _), _, (source, target) = quickstart.load_dates_task(args)
    model, attention_model = quickstart.build_dates_model(args, source, target)
    model.fit(train, validation_data=validation, epochs=args.epochs, verbose=2, shuffle=False)
    text = quickstart.EXAMPLE_TEXTS[2]
    output, _ = quickstart.save_attention_heatmap(attention_model, source, target, text, str(path))
    print(f"{text!r} -> {output}")
    draw_heads(path.parent / "dates_heads.png", model, target, text, output)


def draw_heads(path, model, target, text, output):
    """Every attention map of the trained translator for `text` (plot_heads)."""
    import numpy as np

    from keras_attn.data import dates
    from keras_attn.data.pipelines import START_TOKEN, dates_arrays
    from keras_attn.visualize import attention_maps, plot_heads

    enc, _, _ = dates_arrays([(text, "0000-00-00")])
    start = target.token_to_id[START_TOKEN]
    dec = np.array([[start] + [target.token_to_id[c] for c in output[:-1]]], "int32")
    maps = attention_maps(model, [enc, dec])
    n = min(len(text), dates.MAX_INPUT_LENGTH)
    enc_tokens = list(text[:n]) + [""] * (enc.shape[1] - n)
    dec_tokens = ["<s>"] + list(output[:-1])
    fig = plot_heads([m for m in maps if "encoder" not in m.name], dec_tokens,
                     key_tokens=enc_tokens, cell_size=2.2)
    fig.savefig(path, dpi=90)
    print(f"{len(maps)} maps -> {path}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="+", choices=FIGURES, default=list(FIGURES))
    parser.add_argument("--out", default=str(IMAGES), help="folder for the PNGs")
    parser.add_argument("--num-train", type=int, default=20_000)
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args(argv)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if "memory" in args.only:
        draw_memory(out / "long_sequence_memory.png")
    if "architecture" in args.only:
        draw_architecture(out / "architecture.png")
    if "results" in args.only:
        draw_results_attention(out / "results_attention.png")
        draw_results_runtimes(out / "results_runtimes.png")
    if "attention" in args.only:
        sys.path.insert(0, str(ROOT))
        import keras_attn_cli

        keras_attn_cli.quiet()
        draw_attention(out / "dates_attention.png", args.num_train, args.epochs)
    for name in sorted(os.listdir(out)):
        if name.endswith(".png"):
            print(out / name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
