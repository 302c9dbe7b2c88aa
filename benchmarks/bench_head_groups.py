"""Attention in independent head groups: the unblocked core split 1/2/4/8 ways.

`keras_attn.ops.dot_product_attention` (unblocked path) with its head-group
split forced to 1 (none), 2, 4 and 8 groups, forward and forward+backward,
batch 8, 8 heads of 32, interleaved in one process; ratios are the
ungrouped time over each grouped time (> 1: grouping is faster). This is the
measurement behind `tf_kernels.head_groups` (benchmarks/README.md).

    python benchmarks/bench_head_groups.py --lengths 128 512 1024
"""

import argparse
import sys

import _common
import results_file  # noqa: E402

BATCH, HEADS, HEAD_DIM = 8, 8, 32
GROUPS = (1, 2, 4, 8)


def run(lengths, repeats, causal=False):
    import numpy as np
    import tensorflow as tf

    from keras_attn.ops import attention
    from keras_attn.ops import tf_kernels

    rows = []
    rng = np.random.default_rng(0)
    for length in lengths:
        q, k, v = (
            tf.constant(rng.normal(size=(BATCH, length, HEADS, HEAD_DIM)).astype("float32"))
            for _ in range(3)
        )
        for train in (False, True):
            fns = {}
            for groups in GROUPS:

                def step(groups=groups):
                    with tf.GradientTape() as tape:
                        tape.watch([q, k, v])
                        out = attention.dot_product_attention(q, k, v, is_causal=causal)
                    return tape.gradient(out, [q, k, v], output_gradients=out) if train else out

                saved = tf_kernels.head_groups
                tf_kernels.head_groups = lambda *a, groups=groups, **kw: groups
                try:
                    fn = tf.function(step)
                    fn.get_concrete_function()  # traced with this many groups
                finally:
                    tf_kernels.head_groups = saved
                fns[groups] = fn
            times = _common.interleaved(
                fns, repeats=repeats, calls=min(128, max(1, 2**24 // (BATCH * length * length)))
            )
            row = {"T": length, "pass": "fwd+bwd" if train else "forward",
                   "ms": {g: 1e3 * t for g, t in times.items()},
                   "chosen": tf_kernels.head_groups((BATCH, HEADS, length, length), HEADS)}
            row["speedup"] = {g: times[1] / t for g, t in times.items()}
            print(row, flush=True)
            rows.append(row)
    return rows


def to_markdown(rows):
    header = ["T", "pass", "1 group ms"] + [f"{g} groups: speed-up" for g in GROUPS[1:]] + [
        "groups chosen by default"]
    body = [[r["T"], r["pass"], f"{r['ms'][1]:.2f}"]
            + [f"{r['speedup'][g]:.2f}x" for g in GROUPS[1:]] + [r["chosen"]] for r in rows]
    return (f"Unblocked `dot_product_attention`, batch {BATCH}, {HEADS} heads of {HEAD_DIM}, "
            "float32, the head-group split forced to 1/2/4/8; speed-up = time with one group / "
            "time with n groups.\n\n" + _common.markdown_table(header, body))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 1024])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json")
    parser.add_argument("--markdown")
    results_file.add_argument(parser, "head_groups")
    args = parser.parse_args(argv)
    results_file.start(args)
    rows = run(args.lengths, args.repeats)
    _common.emit(to_markdown(rows), args, rows=rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
