"""On a machine with GPUs: which attention kernels run, how fast against Keras /
KerasHub, and a MirroredStrategy fit over all GPUs. Prints what it measured.

No GPU was available where keras_attn was developed, so this script is the
check to run on one (TensorFlow backend; with JAX or torch, only the kernel
choice and the attention timings run):

    python benchmarks/gpu_check.py                # needs a GPU
    python benchmarks/gpu_check.py --allow-cpu    # smoke run anywhere (small sizes)
"""

import argparse
import os
import sys
import time

import _common  # noqa: F401  (sets the environment first)

import keras
import numpy as np


def _median_seconds(fn, repeats):
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        fn = tf.function(fn)  # graph mode, as the other benchmarks
    fn()  # trace / compile
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        keras.ops.convert_to_numpy(keras.tree.flatten(out)[0])
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def attention(lengths, batch, repeats):
    import keras_attn
    from keras_attn import ops as ka_ops

    print("\n## MultiHeadAttention forward, ours vs keras.layers.MultiHeadAttention")
    print("| T | kernel (auto) | ours ms | Keras ms | Keras / ours |")
    print("|---|---|---|---|---|")
    for t in lengths:
        x = np.random.default_rng(0).normal(size=(batch, t, 256)).astype("float32")
        peer = keras.layers.MultiHeadAttention(8, 32)
        peer(x, x)
        ours = keras_attn.layers.MultiHeadAttention.from_keras(peer)
        ours_s = _median_seconds(lambda: ours(x, x, use_causal_mask=True), repeats)
        kernel = ka_ops.last_kernel()
        peer_s = _median_seconds(lambda: peer(x, x, use_causal_mask=True), repeats)
        print(f"| {t} | {kernel} | {1e3 * ours_s:.2f} | {1e3 * peer_s:.2f} | {peer_s / ours_s:.2f}x |")


def blocks(length, batch, repeats):
    try:
        import keras_hub
    except ImportError:
        print("\n(keras-hub not installed: block comparison skipped)")
        return
    import keras_attn

    x = np.random.default_rng(0).normal(size=(batch, length, 256)).astype("float32")
    ours = keras_attn.layers.TransformerEncoderBlock(num_heads=8, intermediate_dim=1024)
    theirs = keras_hub.layers.TransformerEncoder(1024, 8)
    ours_s = _median_seconds(lambda: ours(x), repeats)
    theirs_s = _median_seconds(lambda: theirs(x), repeats)
    print("\n## Encoder block forward vs KerasHub TransformerEncoder")
    print(f"T={length}, batch {batch}: ours {1e3 * ours_s:.2f} ms, KerasHub "
          f"{1e3 * theirs_s:.2f} ms, KerasHub / ours {theirs_s / ours_s:.2f}x")


def mirrored_fit(length, steps):
    if keras.backend.backend() != "tensorflow":
        print("\n(MirroredStrategy fit needs the TensorFlow backend: skipped)")
        return
    import tensorflow as tf

    import keras_attn

    strategy = tf.distribute.MirroredStrategy()
    with strategy.scope():
        inputs = keras.Input((length, 64))
        h = keras_attn.layers.TransformerEncoderBlock(num_heads=4, intermediate_dim=128)(inputs)
        model = keras.Model(inputs, keras.layers.Dense(1)(keras.layers.GlobalAveragePooling1D()(h)))
        model.compile("adam", "mse")
    n = 32 * strategy.num_replicas_in_sync * steps
    x = np.random.default_rng(0).normal(size=(n, length, 64)).astype("float32")
    y = x.mean(axis=(1, 2))[:, None]
    start = time.perf_counter()
    history = model.fit(x, y, batch_size=32 * strategy.num_replicas_in_sync, epochs=2, verbose=0)
    print(f"\n## MirroredStrategy fit: {strategy.num_replicas_in_sync} replicas, "
          f"{2 * steps} steps in {time.perf_counter() - start:.1f} s, "
          f"loss {history.history['loss'][0]:.4f} -> {history.history['loss'][-1]:.4f}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--allow-cpu", action="store_true", help="run (small) without a GPU")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    import keras_attn

    device = keras_attn.config.get_device_type()
    print(f"backend {keras.backend.backend()}, device type {device}, "
          f"load average {os.getloadavg()}")
    if device != "gpu" and not args.allow_cpu:
        print("No GPU found: nothing to measure (use --allow-cpu for a smoke run).")
        return 0
    small = device != "gpu"
    print("Kernel choice (auto) for a (1, T, 8, 32) self-attention call:")
    for t in (512, 8192):
        q = np.zeros((1, t, 8, 32), "float32")
        print(f"  T={t}: {keras_attn.ops.explain_kernel(q, q, q)}")
    attention([128] if small else [512, 2048, 4096], 2 if small else 8, args.repeats)
    blocks(64 if small else 512, 2 if small else 16, args.repeats)
    mirrored_fit(16 if small else 256, 2 if small else 20)
    return 0


if __name__ == "__main__":
    sys.exit(main())
