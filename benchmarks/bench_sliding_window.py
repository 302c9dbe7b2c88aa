"""A sliding-window layer at long lengths on the blocked path: peak memory and time.

Every configuration runs in a fresh subprocess (peak RSS, `VmHWM`, is its own):
batch 1, d_model 256, 8 heads, causal self-attention with
`sliding_window=W` (default 512), float32, graph mode. "fwd+bwd" is the
forward pass and the gradients w.r.t. the input and every weight. The
blocked path builds the window per block and skips the blocks outside it, so
memory stays O(T) and time O(T W); the printed ratio compares the window
against full causal attention at the same length (both blocked).

    python benchmarks/bench_sliding_window.py                # T=16384, W=512
    python benchmarks/bench_sliding_window.py --lengths 4096 16384 --window 256
"""

import argparse
import json
import os
import subprocess
import sys

import results_file

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

D_MODEL, HEADS = 256, 8
LIMIT_GIB = 2.0


def _child(length, window, mode, repeats):
    import keras
    import numpy as np
    import tensorflow as tf

    import _common  # this directory: the script's own
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from keras_attn import ops as ka_ops
    from keras_attn.layers import MultiHeadAttention

    keras.utils.set_random_seed(0)
    layer = MultiHeadAttention(
        HEADS, D_MODEL // HEADS, sliding_window=window or None, chunk_size=(1024, 1024)
    )
    x = tf.constant(np.random.default_rng(0).normal(size=(1, length, D_MODEL)).astype("float32"))
    layer(x[:, :8], x[:, :8])

    seconds = _common.time_self_attention(layer, x, mode, repeats, use_causal_mask=True)
    print(json.dumps({
        "seconds": seconds,
        "peak_gib": _common.peak_rss_kib() / 2**20,
        "kernel": ka_ops.last_kernel(),
    }))


def _run(length, window, mode, repeats):
    cmd = [sys.executable, __file__, "--child", str(length), str(window), mode, str(repeats)]
    result = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        return {"error": result.stderr.strip().splitlines()[-1:]}
    return json.loads(result.stdout.strip().splitlines()[-1])


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        _child(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], int(sys.argv[5]))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[16384])
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--modes", nargs="+", default=["fwd+bwd"], choices=["fwd", "fwd+bwd"])
    parser.add_argument("--no-full", action="store_true",
                        help="skip the full causal comparison (window 0)")
    results_file.add_argument(parser, "sliding_window")
    args = parser.parse_args()
    results_file.start(args)
    with results_file.recording(args):
        print(f"load average at start: {os.getloadavg()}\n")
        print("| T | W | mode | kernel | peak RSS GiB | under 2 GiB | seconds | time vs full causal |")
        print("|---|---|---|---|---|---|---|---|")
        for length in args.lengths:
            for mode in args.modes:
                windowed = _run(length, args.window, mode, args.repeats)
                full = None if args.no_full else _run(length, 0, mode, args.repeats)
                for w, r in ((args.window, windowed), ("full", full)):
                    if r is None:
                        continue
                    if "error" in r:
                        print(f"| {length} | {w} | {mode} | - | error: {r['error']} | | | |")
                        continue
                    ratio = ""
                    if w != "full" and full and "error" not in full:
                        ratio = f"{r['seconds'] / full['seconds']:.2f}"
                    print(f"| {length} | {w} | {mode} | {r['kernel']} | {r['peak_gib']:.2f} | "
                          f"{'yes' if r['peak_gib'] < LIMIT_GIB else 'NO'} | {r['seconds']:.2f} | {ratio} |")
        print(f"\nload average at end: {os.getloadavg()}")


if __name__ == "__main__":
    main()
