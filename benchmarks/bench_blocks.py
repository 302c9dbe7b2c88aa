"""Transformer blocks, ours vs KerasHub: forward and Adam train step, graph and XLA.

`TransformerEncoderBlock` vs `keras_hub.layers.TransformerEncoder` and
`TransformerDecoderBlock` vs `keras_hub.layers.TransformerDecoder`
(decoder-only: causal self-attention, no cross-attention), same sizes and
the same number of weights (checked), batch 8, 8 heads, FFN 4d, dropout 0,
float32. Ours and the peer run in this one process, interleaved, warm;
medians of `--repeats` rounds. FLOPs are counted as in benchmarks/README.md
and divided by the 2048^3 matmul rate measured in the same run.

    python benchmarks/bench_blocks.py --markdown blocks.md
"""

import argparse
import json
import sys

import _common  # noqa: F401  (sets the environment first)
import results_file  # noqa: E402

GRID = ((128, 256), (128, 512), (512, 256), (512, 512))
BATCH, HEADS = 8, 8


def flops_per_token(length, dim):
    """Forward matmul FLOPs per token: projections 8d^2, FFN 16d^2, attention 4Td."""
    return 24 * dim * dim + 4 * length * dim


def build(kind, impl, length, dim):
    import keras
    import keras_hub

    from keras_attn.layers import TransformerDecoderBlock
    from keras_attn.layers import TransformerEncoderBlock

    keras.utils.set_random_seed(0)
    if impl == "ours":
        cls = TransformerEncoderBlock if kind == "encoder" else TransformerDecoderBlock
        block = cls(num_heads=HEADS, intermediate_dim=4 * dim)
    else:
        cls = keras_hub.layers.TransformerEncoder if kind == "encoder" else keras_hub.layers.TransformerDecoder
        block = cls(intermediate_dim=4 * dim, num_heads=HEADS)
    block.build((BATCH, length, dim))
    return block


def step_functions(block, x, jit):
    import keras
    import tensorflow as tf

    optimizer = keras.optimizers.Adam(1e-4)
    optimizer.build(block.trainable_variables)

    def forward(x):
        out = block(x)
        return out[0] if isinstance(out, tuple) else out

    @tf.function(jit_compile=jit)
    def fwd(x):
        return forward(x)

    @tf.function(jit_compile=jit)
    def train(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(forward(x)))
        grads = tape.gradient(loss, block.trainable_variables)
        optimizer.apply(grads, block.trainable_variables)
        return loss

    return (lambda: fwd(x)), (lambda: train(x))


def matmuls_only(length, dim, train):
    """A function running only the matmuls of one block step (same shapes, same
    counted FLOPs): the best any implementation built on TensorFlow's matmul
    kernels could do, since softmax, LayerNorm, bias, activation and Adam cost
    time on top. Forward: 4 projections, 2 FFN matmuls, scores and weighted
    sum; a train step adds the two backward matmuls of each.
    """
    import numpy as np
    import tensorflow as tf

    rng = np.random.default_rng(0)
    head = dim // HEADS

    def t(*shape):
        return tf.constant(rng.normal(size=shape).astype("float32"))

    rows, bh = BATCH * length, BATCH * HEADS
    # (a, b) -> a @ b, for each forward matmul of the step.
    pairs = [(t(rows, dim), t(dim, dim)) for _ in range(4)]
    pairs += [(t(rows, dim), t(dim, 4 * dim)), (t(rows, 4 * dim), t(4 * dim, dim))]
    pairs += [(t(bh, length, head), t(bh, head, length)), (t(bh, length, length), t(bh, length, head))]
    if train:
        backward = []
        for a, b in pairs:
            out = tf.zeros(a.shape[:-1] + b.shape[-1:])
            backward.append((out, tf.linalg.matrix_transpose(b)))  # d_a = d_out @ b^T
            backward.append((tf.linalg.matrix_transpose(a), out))  # d_b = a^T @ d_out
        pairs += backward

    @tf.function
    def step(pairs):
        # One after the other, as in a real step (independent matmuls would run
        # two at a time and compete for the same two cores). The operands are
        # arguments, not captured constants, so Grappler cannot fold them.
        outs = [tf.zeros(())]
        for a, b in pairs:
            with tf.control_dependencies(outs[-1:]):
                outs.append(tf.matmul(a, b))
        return outs

    return lambda: step(pairs)


def run(grid, repeats, kinds=("encoder", "decoder"), modes=("graph", "xla")):
    import numpy as np
    import tensorflow as tf

    ceiling_call, ceiling_flops = _common.ceiling_fn()
    ceilings = []
    rows = []
    for kind in kinds:
        for length, dim in grid:
            x = tf.constant(np.random.default_rng(0).normal(size=(BATCH, length, dim)).astype("float32"))
            blocks = {impl: build(kind, impl, length, dim) for impl in ("ours", "keras_hub")}
            counts = {impl: b.count_params() for impl, b in blocks.items()}
            if counts["ours"] != counts["keras_hub"]:
                raise RuntimeError(f"weight counts differ: {counts}")
            tokens = BATCH * length
            calls = max(1, 2**20 // (tokens * dim))
            for mode in modes:
                fns = {}
                for impl, block in blocks.items():
                    fwd, train = step_functions(block, x, jit=(mode == "xla"))
                    fns[(impl, "forward")] = fwd
                    fns[(impl, "train")] = train
                for step in ("forward", "train"):
                    times = _common.interleaved(
                        {
                            "ours": fns[("ours", step)],
                            "keras_hub": fns[("keras_hub", step)],
                            "ceiling": ceiling_call,
                            "matmuls": matmuls_only(length, dim, step == "train"),
                        },
                        repeats=repeats,
                        calls=calls,
                    )
                    ceiling = ceiling_flops / times["ceiling"] / 1e9
                    ceilings.append(ceiling)
                    mult = 1 if step == "forward" else 3
                    flops = mult * tokens * flops_per_token(length, dim)
                    row = {
                        "block": kind, "T": length, "d": dim, "mode": mode, "step": step,
                        "params": counts["ours"],
                        "ours_tok_s": tokens / times["ours"],
                        "hub_tok_s": tokens / times["keras_hub"],
                        "ratio": times["keras_hub"] / times["ours"],
                        "ceiling_gflops": ceiling,
                        "ours_ceiling": flops / times["ours"] / 1e9 / ceiling,
                        "hub_ceiling": flops / times["keras_hub"] / 1e9 / ceiling,
                        "matmuls_ceiling": flops / times["matmuls"] / 1e9 / ceiling,
                    }
                    print(json.dumps(row), flush=True)
                    rows.append(row)
    ceiling = float(np.median(ceilings))
    return ceiling, rows


def to_markdown(ceiling, rows):
    header = ["block", "(T, d)", "mode", "step", "ours tok/s", "KerasHub tok/s", "ours / KerasHub",
              "ceiling GFLOP/s", "ours % ceiling", "KerasHub % ceiling", "matmuls only % ceiling"]
    body = [
        [r["block"], f"({r['T']}, {r['d']})", r["mode"], r["step"], f"{r['ours_tok_s']:.0f}",
         f"{r['hub_tok_s']:.0f}", f"{r['ratio']:.2f}x", f"{r['ceiling_gflops']:.0f}",
         f"{100 * r['ours_ceiling']:.0f}%",
         f"{100 * r['hub_ceiling']:.0f}%", f"{100 * r['matmuls_ceiling']:.0f}%"]
        for r in rows
    ]
    return (f"Matmul ceiling: a 2048^3 float32 matmul timed in the same rounds as each row "
            f"(median over rows {ceiling:.1f} GFLOP/s). "
            f"Batch {BATCH}, {HEADS} heads, FFN 4d, same weight counts. \"matmuls only\": "
            "the step's matmuls alone (same shapes and counted FLOPs, nothing else), timed in "
            "the same rounds: what TensorFlow's matmul kernels allow at these shapes.\n\n"
            + _common.markdown_table(header, body))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="(128, 256) only, graph mode")
    parser.add_argument("--json", help="write the raw rows to this file")
    parser.add_argument("--markdown")
    results_file.add_argument(parser, "blocks")
    args = parser.parse_args(argv)
    results_file.start(args)
    grid = GRID[:1] if args.quick else GRID
    modes = ("graph",) if args.quick else ("graph", "xla")
    ceiling, rows = run(grid, args.repeats, modes=modes)
    text = to_markdown(ceiling, rows)
    _common.emit(text, args, ceiling=ceiling, rows=rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
