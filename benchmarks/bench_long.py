"""Long sequences: peak resident memory and time, ours vs keras.layers.MultiHeadAttention.

Every configuration runs in a fresh subprocess (so peak RSS, `VmHWM`, is
that configuration's own), batch 1, d_model 256, 8 heads, self-attention,
float32, graph mode (`tf.function`). "fwd" is one forward pass, "fwd+bwd" the
forward pass and the gradients w.r.t. the input and every weight. The time
is the median of `--repeats` warm runs. Keras configurations whose score
tensors alone would exceed `--keras-limit-gib` are not started (reported with
the estimate), so the benchmark cannot take the machine down.

A separate check (`--check`) compares the blocked and the unblocked path at
T=2048 (outputs and gradients, max abs difference) and times both at T=4096.

    python benchmarks/bench_long.py --markdown out.md
"""

import argparse
import json
import os
import subprocess
import sys
import time

import results_file  # no environment of its own: the workers' stays theirs

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

D_MODEL, HEADS = 256, 8
LENGTHS = (2048, 4096, 8192, 16384, 32768)


def _child(impl, mode, length, repeats):
    import keras
    import numpy as np
    import tensorflow as tf

    import _common  # this directory: the script's own
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from keras_attn.layers import MultiHeadAttention

    keras.utils.set_random_seed(0)
    if impl == "ours":
        layer = MultiHeadAttention(HEADS, D_MODEL // HEADS)  # chunk_size=None: automatic
    else:
        layer = keras.layers.MultiHeadAttention(HEADS, D_MODEL // HEADS)
    x = tf.constant(np.random.default_rng(0).normal(size=(1, length, D_MODEL)).astype("float32"))
    layer(x[:, :8], x[:, :8])

    seconds = _common.time_self_attention(layer, x, mode, repeats)
    print(json.dumps({"seconds": seconds, "peak_gib": _common.peak_rss_kib() / 2**20}))


def _check():
    """Blocked vs unblocked at T=2048 (values) and T=4096 (time), batch 1, d=256, 8 heads."""
    import keras
    import numpy as np
    import tensorflow as tf

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from keras_attn.ops import chunked
    from keras_attn.ops import dot_product_attention

    rng = np.random.default_rng(0)
    result = {}
    head = D_MODEL // HEADS

    def grads(length, chunk, causal):
        q, k, v = (tf.constant(rng.normal(size=(1, length, HEADS, head)).astype("float32")) for _ in range(3))

        @tf.function
        def run(q, k, v):
            with tf.GradientTape() as tape:
                tape.watch([q, k, v])
                out = dot_product_attention(q, k, v, is_causal=causal, chunk_size=chunk)
                loss = tf.reduce_sum(out * tf.sin(out))
            return [out] + tape.gradient(loss, [q, k, v])

        return run, (q, k, v)

    for causal in (False, True):
        run_b, args = grads(2048, chunked.DEFAULT_CHUNK_SIZE, causal)
        run_u, _ = grads(2048, 0, causal)
        a = run_b(*args)
        b = run_u(*args)
        result[f"max_abs_diff_T2048_causal={causal}"] = {
            name: float(np.max(np.abs(x.numpy() - y.numpy())))
            for name, x, y in zip(("out", "dq", "dk", "dv"), a, b)
        }
    q, k, v = (tf.constant(rng.normal(size=(1, 4096, HEADS, head)).astype("float32")) for _ in range(3))
    fns = {
        chunk: tf.function(lambda q, k, v, c=chunk: dot_product_attention(q, k, v, chunk_size=c))
        for chunk in (0, 512, chunked.DEFAULT_CHUNK_SIZE)
    }
    times = {c: [] for c in fns}
    for c, f in fns.items():
        f(q, k, v).numpy()
    order = list(fns)
    for r in range(7):
        for c in order[r % len(order):] + order[: r % len(order)]:
            f = fns[c]
            start = time.perf_counter()
            f(q, k, v).numpy()
            times[c].append(time.perf_counter() - start)
    med = {c: float(np.median(t)) for c, t in times.items()}
    default = chunked.DEFAULT_CHUNK_SIZE
    result["T4096_forward_seconds"] = {
        "unblocked": med[0],
        "blocked_512": med[512],
        f"blocked_{default}_default": med[default],
    }
    # The target is about the library's default blocks (what chunk_size=None
    # picks above the threshold); 512-blocks are shown for comparison.
    result["T4096_blocked_over_unblocked"] = med[default] / med[0]
    del keras
    return result


def _estimate_keras_gib(length, mode):
    # One float32 (heads, T, T) tensor; the forward keeps ~2 of them alive,
    # training ~4 (logits, probabilities, their gradients).
    one = 4 * HEADS * length * length / 2**30
    return one * (2 if mode == "fwd" else 4)


def run(lengths, repeats, keras_limit_gib, max_train_length=16384):
    rows = []
    for length in lengths:
        for mode in ("fwd", "fwd+bwd"):
            if mode == "fwd+bwd" and length > max_train_length:
                continue
            for impl in ("ours", "keras"):
                row = {"T": length, "mode": mode, "impl": impl}
                estimate = _estimate_keras_gib(length, mode)
                if impl == "keras" and estimate > keras_limit_gib:
                    row["status"] = f"not run: score tensors alone ~{estimate:.0f} GiB"
                    rows.append(row)
                    continue
                cmd = [sys.executable, __file__, "--child", impl, mode, str(length), str(repeats)]
                proc = subprocess.run(cmd, capture_output=True, text=True)
                lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
                if proc.returncode == 0 and lines:
                    row.update(json.loads(lines[-1]))
                    row["status"] = "ok"
                else:
                    tail = (proc.stderr.strip().splitlines() or ["?"])[-1][:80]
                    row["status"] = f"failed (rc={proc.returncode}): {tail}"
                print(json.dumps(row), flush=True)
                rows.append(row)
    return rows


def to_markdown(rows, check):
    lines = [
        "| T | pass | ours peak RSS (GiB) | Keras peak RSS (GiB) | ours time (s) | Keras time (s) | Keras / ours time |",
        "|---|---|---|---|---|---|---|",
    ]
    by = {(r["T"], r["mode"], r["impl"]): r for r in rows}
    for length in sorted({r["T"] for r in rows}):
        for mode in ("fwd", "fwd+bwd"):
            o, k = by.get((length, mode, "ours")), by.get((length, mode, "keras"))
            if o is None:
                continue

            def cell(r, key, fmt):
                if r is None:
                    return "-"
                if r.get("status") != "ok":
                    return r.get("status", "-")
                return fmt.format(r[key])

            ratio = "-"
            if o.get("status") == "ok" and k is not None and k.get("status") == "ok":
                ratio = f"{k['seconds'] / o['seconds']:.2f}x"
            lines.append(
                f"| {length} | {mode} | {cell(o, 'peak_gib', '{:.2f}')} | {cell(k, 'peak_gib', '{:.2f}')} "
                f"| {cell(o, 'seconds', '{:.2f}')} | {cell(k, 'seconds', '{:.2f}')} | {ratio} |"
            )
    if check:
        lines += ["", "Blocked vs unblocked path (`keras_attn.ops.dot_product_attention`, batch 1, 8 heads, head size 32):", ""]
        for key, value in check.items():
            if isinstance(value, dict):
                value = ", ".join(f"{k}={v:.3g}" for k, v in value.items())
            else:
                value = f"{value:.2f}"
            lines.append(f"- {key}: {value}")
    return "\n".join(lines) + "\n"


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--child":
        _child(argv[1], argv[2], int(argv[3]), int(argv[4]))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS))
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--keras-limit-gib", type=float, default=9.0)
    parser.add_argument("--max-train-length", type=int, default=16384,
                        help="longest T for forward+backward")
    parser.add_argument("--no-check", action="store_true")
    parser.add_argument("--json", help="write the raw rows to this file")
    parser.add_argument("--markdown", help="write the table to this file")
    results_file.add_argument(parser, "long")
    args = parser.parse_args(argv)
    results_file.start(args)
    check = None if args.no_check else _check()
    if check:
        print(json.dumps(check), flush=True)
    rows = run(args.lengths, args.repeats, args.keras_limit_gib, args.max_train_length)
    text = to_markdown(rows, check)
    import _common  # the parent only: workers keep their own environment

    _common.emit(text, args, rows=rows, check=check)
    return 0


if __name__ == "__main__":
    sys.exit(main())
