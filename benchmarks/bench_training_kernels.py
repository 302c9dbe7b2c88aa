"""The kernels of one LoRA training step, TensorFlow beside torch, float32 and
bfloat16 (issue 52: why our bfloat16 1 x 2048 rows train slower than PEFT).

For a model's published shape (bench_real_size.MODELS) at one sequence
length, each framework times in its own fresh process, on the same random
inputs:

- `matmul`: a projection's forward, `(T, hidden) @ (hidden, intermediate)`,
  and its input gradient, `(T, intermediate) @ (intermediate, hidden)^T`;
- `attention`: causal grouped-query attention, forward and the gradients of
  query, key and value (TensorFlow: `keras_attn.ops.dot_product_attention`
  on the kernel `--attention` names, each its own row; torch:
  `F.scaled_dot_product_attention(is_causal=True, enable_gqa=True)`, what
  transformers' `sdpa` runs in PEFT's rows);
- `scores`: the `(heads, T, D) x (heads, D, T)` batch matmul that forms
  the logits, and `softmax`: the `(heads, T, T)` softmax alone (the steps
  of an attention that holds its scores, which scale with T^2).

The table gives the median milliseconds and TensorFlow / torch time ratios
(above 1: TensorFlow slower).

    python benchmarks/bench_training_kernels.py --model qwen2.5-0.5b --length 2048
"""

import argparse
import json
import os
import subprocess
import sys

import _common  # first: it sets the environment
import results_file  # noqa: E402

import bench_real_size  # noqa: E402

DTYPES = ("float32", "bfloat16")


def _inputs(shape, length, seed=0):
    import numpy as np

    rng = np.random.default_rng(seed)
    config = shape["config"]
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim", hidden // heads)

    def draw(*dims):
        return rng.normal(scale=0.5, size=dims).astype("float32")

    return dict(
        x=draw(length, hidden), w=draw(hidden, inter), dy=draw(length, inter),
        q=draw(1, length, heads, head_dim), k=draw(1, length, kv_heads, head_dim),
        v=draw(1, length, kv_heads, head_dim), do=draw(1, length, heads, head_dim),
        s=draw(heads, length, length), qh=draw(heads, length, head_dim),
    )


def _tensorflow_rows(arrays, dtypes, kernels, repeats):
    import tensorflow as tf

    from keras_attn import config
    from keras_attn.ops import dot_product_attention

    forward = tf.function(lambda x, w: tf.matmul(x, w))
    backward = tf.function(lambda dy, w: tf.matmul(dy, w, transpose_b=True))
    softmax = tf.function(lambda s: tf.nn.softmax(s, axis=-1))
    scores = tf.function(lambda q, k: tf.matmul(q, k, transpose_b=True))
    rows = []
    for dtype in dtypes:
        t = {name: tf.constant(a, dtype=dtype) for name, a in arrays.items()}
        rows.append(("matmul forward", dtype, "tensorflow",
                     _common.time_ms(lambda t=t: forward(t["x"], t["w"]).numpy(), repeats)))
        rows.append(("matmul input gradient", dtype, "tensorflow",
                     _common.time_ms(lambda t=t: backward(t["dy"], t["w"]).numpy(), repeats)))
        rows.append(("scores (heads, T, D) x (heads, D, T)", dtype, "tensorflow",
                     _common.time_ms(lambda t=t: scores(t["qh"], t["qh"]).numpy(), repeats)))
        rows.append(("softmax (heads, T, T)", dtype, "tensorflow",
                     _common.time_ms(lambda t=t: softmax(t["s"]).numpy(), repeats)))
        for kernel in kernels:
            with config.attention_implementation(kernel):
                @tf.function
                def step(q, k, v, do):
                    with tf.GradientTape() as tape:
                        tape.watch([q, k, v])
                        out = dot_product_attention(q, k, v, is_causal=True)
                    return tape.gradient(out, [q, k, v], output_gradients=do)

                run = lambda t=t, step=step: [g.numpy() for g in step(t["q"], t["k"], t["v"], t["do"])]  # noqa: E731
                rows.append(("attention forward + backward", dtype, f"tensorflow ({kernel})",
                             _common.time_ms(run, repeats)))
    return rows


def _torch_rows(arrays, dtypes, repeats):
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(os.cpu_count())
    rows = []
    for dtype in dtypes:
        t = {name: torch.from_numpy(a).to(getattr(torch, dtype)) for name, a in arrays.items()}
        with torch.no_grad():
            rows.append(("matmul forward", dtype, "torch", _common.time_ms(lambda t=t: t["x"] @ t["w"], repeats)))
            rows.append(("matmul input gradient", dtype, "torch",
                         _common.time_ms(lambda t=t: t["dy"] @ t["w"].T, repeats)))
            rows.append(("scores (heads, T, D) x (heads, D, T)", dtype, "torch",
                         _common.time_ms(lambda t=t: t["qh"] @ t["qh"].transpose(1, 2), repeats)))
            rows.append(("softmax (heads, T, T)", dtype, "torch",
                         _common.time_ms(lambda t=t: torch.softmax(t["s"], dim=-1), repeats)))
        # transformers' sdpa path: (B, H, T, D), the key/value heads repeated by the kernel.
        q, k, v, do = (t[n].transpose(1, 2).contiguous() for n in ("q", "k", "v", "do"))

        def step(q=q, k=k, v=v, do=do):
            leaves = [a.detach().requires_grad_() for a in (q, k, v)]
            out = F.scaled_dot_product_attention(*leaves, is_causal=True, enable_gqa=True)
            return torch.autograd.grad(out, leaves, grad_outputs=do)

        rows.append(("attention forward + backward", dtype, "torch (sdpa)", _common.time_ms(step, repeats)))
    return rows


def run_child(args, framework):
    command = [sys.executable, os.path.abspath(__file__), "--child", framework, "--model", args.model,
               "--length", str(args.length), "--dtypes", args.dtypes, "--attention", args.attention,
               "--repeats", str(args.repeats)]
    out = subprocess.run(command, capture_output=True, text=True, check=False)
    lines = [line for line in out.stdout.splitlines() if line.startswith("[")]
    if out.returncode or not lines:
        raise SystemExit(f"the {framework} child failed:\n{out.stderr[-3000:]}")
    return json.loads(lines[-1])


def table(rows):
    """One line per TensorFlow row, beside torch's time for the same kernel and dtype."""
    torch_ms = {(op, dtype): (side, ms) for op, dtype, side, ms in rows if side.startswith("torch")}
    lines = ["| kernel | dtype | TensorFlow | ms | torch | ms | TensorFlow / torch |",
             "|---|---|---|---|---|---|---|"]
    for op, dtype, side, ms in rows:
        if side.startswith("tensorflow"):
            peer, peer_ms = torch_ms[(op, dtype)]
            lines.append(f"| {op} | {dtype} | {side} | {ms:.1f} | {peer} | {peer_ms:.1f} | {ms / peer_ms:.2f} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen2.5-0.5b", help="from bench_real_size.MODELS")
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--dtypes", default=",".join(DTYPES))
    parser.add_argument("--attention", default="auto,blocked",
                        help="comma-separated keras_attn attention kernels for the TensorFlow rows")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    results_file.add_argument(parser)
    args = parser.parse_args(argv)
    dtypes, kernels = args.dtypes.split(","), args.attention.split(",")
    from keras_attn import config

    _common.check_known(parser, (([args.model], bench_real_size.MODELS, "--model"), (dtypes, DTYPES, "--dtypes"),
                                 (kernels, config.IMPLEMENTATIONS, "--attention")))
    if args.child:
        arrays = _inputs(bench_real_size.MODELS[args.model], args.length)
        rows = (_tensorflow_rows(arrays, dtypes, kernels, args.repeats) if args.child == "tensorflow"
                else _torch_rows(arrays, dtypes, args.repeats))
        print(json.dumps(rows))
        return
    results_file.start(args)
    rows = run_child(args, "tensorflow") + run_child(args, "torch")
    heading = (f"{args.model} shapes at T = {args.length}, batch 1; median of {args.repeats} calls, each "
               f"framework in a fresh process with {os.cpu_count()} threads; load average "
               f"{os.getloadavg()[0]:.1f} at the start")
    _common.emit("\n".join([heading, "", table(rows)]), args, rows=rows)


if __name__ == "__main__":
    main()
