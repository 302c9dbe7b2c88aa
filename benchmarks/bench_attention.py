"""MultiHeadAttention, ours vs keras.layers.MultiHeadAttention (and torch, optional).

Forward pass (graph mode, `tf.function`) and forward+backward, batch 8,
d_model 256, 8 heads, float32, for self-attention (plain, causal, padded) and
padded cross-attention at T in {128, 512}. Our layer is made with
`MultiHeadAttention.from_keras(peer)`, so both have the same weights. With
PyTorch installed, `torch.nn.MultiheadAttention` (forward, `torch.no_grad`,
its SDPA fast path) is timed in the same rounds as a second peer.

    python benchmarks/bench_attention.py --markdown attention.md
"""

import argparse
import json
import sys

import _common  # noqa: F401  (sets the environment first)
import results_file  # noqa: E402

BATCH, DIM, HEADS = 8, 256, 8
LENGTHS = (128, 512)
CASES = ("self", "self_causal", "self_padded", "cross_padded")


def _torch_peer(x_np, y_np, valid_np, case):
    try:
        import torch
    except ImportError:
        return None
    torch.set_num_threads(2)
    mha = torch.nn.MultiheadAttention(DIM, HEADS, batch_first=True).eval()
    x = torch.from_numpy(x_np)
    kv = torch.from_numpy(y_np) if case.startswith("cross") else x
    kwargs = {"need_weights": False}
    if case.endswith("padded"):
        kwargs["key_padding_mask"] = torch.from_numpy(~valid_np)
    if case == "self_causal":
        t = x.shape[1]
        kwargs["attn_mask"] = torch.ones(t, t, dtype=torch.bool).triu(1)
        kwargs["is_causal"] = True

    class Done:
        def __init__(self, out):
            self.out = out

        def numpy(self):
            return self.out

    def run():
        with torch.no_grad():
            return Done(mha(x, kv, kv, **kwargs)[0])

    return run


def run(lengths, repeats, with_torch=True):
    import keras
    import numpy as np
    import tensorflow as tf

    from keras_attn.layers import MultiHeadAttention

    ceiling_call, ceiling_flops = _common.ceiling_fn()
    rows = []
    for length in lengths:
        rng = np.random.default_rng(0)
        x_np = rng.normal(size=(BATCH, length, DIM)).astype("float32")
        y_np = rng.normal(size=(BATCH, length, DIM)).astype("float32")
        valid_np = np.ones((BATCH, length), bool)
        valid_np[:, (3 * length) // 4 :] = False
        x, y, valid = tf.constant(x_np), tf.constant(y_np), tf.constant(valid_np)
        keras.utils.set_random_seed(0)
        peer = keras.layers.MultiHeadAttention(HEADS, DIM // HEADS)
        peer(x, x)
        ours = MultiHeadAttention.from_keras(peer)
        for case in CASES:
            kv = y if case.startswith("cross") else x
            kwargs = {}
            if case == "self_causal":
                kwargs["use_causal_mask"] = True
            if case.endswith("padded"):
                kwargs["query_mask"] = valid
                kwargs["value_mask"] = valid
            fns = {}
            for name, layer in (("ours", ours), ("keras", peer)):

                @tf.function
                def fwd(layer=layer):
                    return layer(x, kv, **kwargs)

                @tf.function
                def fwd_bwd(layer=layer):
                    with tf.GradientTape() as tape:
                        loss = tf.reduce_sum(tf.square(layer(x, kv, **kwargs)))
                    return tape.gradient(loss, layer.trainable_variables)

                fns[(name, "forward")] = fwd
                fns[(name, "fwd+bwd")] = fwd_bwd
            # Padded query rows see no key: ours gives zeros there, Keras an
            # average of the values; compare the valid rows.
            rows_ok = valid_np if case.endswith("padded") else np.ones_like(valid_np)
            _common.tolerance.assert_close(
                fns[("ours", "forward")]().numpy()[rows_ok],
                fns[("keras", "forward")]().numpy()[rows_ok],
                terms=x_np.shape[1] * x_np.shape[-1], err_msg=f"{case} ours vs Keras",
            )
            torch_fn = _torch_peer(x_np, y_np, valid_np, case) if with_torch else None
            for step in ("forward", "fwd+bwd"):
                group = {"ours": fns[("ours", step)], "keras": fns[("keras", step)], "ceiling": ceiling_call}
                if step == "forward" and torch_fn is not None:
                    group["torch"] = torch_fn
                calls = 4 if length <= 128 else 1
                times = _common.interleaved(group, repeats=repeats, calls=calls)
                row = {
                    "T": length, "case": case, "step": step,
                    "ours_ms": 1e3 * times["ours"], "keras_ms": 1e3 * times["keras"],
                    "ratio_vs_keras": times["keras"] / times["ours"],
                    "ceiling_gflops": ceiling_flops / times["ceiling"] / 1e9,
                }
                if "torch" in times:
                    row["torch_ms"] = 1e3 * times["torch"]
                    row["ratio_vs_torch"] = times["torch"] / times["ours"]
                print(json.dumps(row), flush=True)
                rows.append(row)
    return rows


def to_markdown(rows):
    header = ["T", "case", "pass", "ours ms", "Keras ms", "Keras / ours", "torch ms", "torch / ours",
              "ceiling GFLOP/s"]
    body = []
    for r in rows:
        body.append([
            r["T"], r["case"], r["step"], f"{r['ours_ms']:.2f}", f"{r['keras_ms']:.2f}",
            f"{r['ratio_vs_keras']:.2f}x",
            f"{r['torch_ms']:.2f}" if "torch_ms" in r else "-",
            f"{r['ratio_vs_torch']:.2f}x" if "ratio_vs_torch" in r else "-",
            f"{r['ceiling_gflops']:.0f}",
        ])
    return (f"Batch {BATCH}, d_model {DIM}, {HEADS} heads; padded = last quarter of each "
            "sequence masked; ratios > 1 mean ours is faster.\n\n" + _common.markdown_table(header, body))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS))
    parser.add_argument("--no-torch", action="store_true")
    parser.add_argument("--json", help="write the raw rows to this file")
    parser.add_argument("--markdown")
    results_file.add_argument(parser, "attention")
    args = parser.parse_args(argv)
    results_file.start(args)
    rows = run(args.lengths, args.repeats, with_torch=not args.no_torch)
    text = to_markdown(rows)
    _common.emit(text, args, rows=rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
