"""Per-token decode latency: KV cache vs recomputing the prefix, Keras (XLA) and TFLite.

For each length n (default 32, 128, 512) it times, for batch 1:

- keras_attn cached step: `DecoderOnlyLM.call_with_cache` on one token at
  position n-1 with a cache of n positions, in a `tf.function(jit_compile=True)`;
- recompute: the full forward pass over n tokens (what decoding costs without a
  cache), also XLA-compiled;
- KerasHub (if `keras_hub` imports): the same sizes built from
  `keras_hub.layers.TransformerDecoder` with its own cache, XLA-compiled;
- TFLite: our exported `decode` signature vs a TFLite full forward over n
  tokens, and KerasHub's cached step converted with builtins only (reported
  as failed when the converter rejects it).

Not a test: the numbers depend on the machine and its load. Run:

    KERAS_BACKEND=tensorflow python benchmarks/bench_decode.py [--lengths 32 128 512]

The KerasHub peer needs `pip install -e ".[peers]"` (or `bash benchmarks/install_peers.sh`).
"""

import argparse

import _common  # first: it sets the environment
import results_file  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from keras_attn.generation import DecoderOnlyLM  # noqa: E402
from keras_attn.generation import cache as cache_lib  # noqa: E402
from keras_attn.runtimes import signatures as gen_export  # noqa: E402


def timeit(fn, repeats, warmup=2):
    # The minimum: on a shared machine it is the least disturbed estimate.
    return _common.time_ms(fn, repeats, warmup, statistic=min)


def _np(x):
    return x.numpy() if hasattr(x, "numpy") else x


class HubLM:
    """The same decoder-only LM from KerasHub layers, with KerasHub's cache."""

    def __init__(self, args, max_length):
        import keras_hub

        self.embedding = keras_hub.layers.TokenAndPositionEmbedding(
            args.vocab, max_length, args.hidden
        )
        self.blocks = [
            keras_hub.layers.TransformerDecoder(
                args.hidden * 4, args.heads, normalize_first=True
            )
            for _ in range(args.layers)
        ]
        self.norm = keras.layers.LayerNormalization(epsilon=1e-5)
        self.head = keras.layers.Dense(args.vocab)
        self.args = args
        self(np.zeros((1, 2), "int32"))

    def __call__(self, ids):
        x = self.embedding(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))

    def empty_cache(self, length):
        head_dim = self.args.hidden // self.args.heads
        shape = (self.args.layers, 1, 2, length, self.args.heads, head_dim)
        return tf.zeros(shape)

    def step(self, ids, cache, index):
        x = self.embedding(ids, start_index=index)
        caches = []
        for i, block in enumerate(self.blocks):
            x, c = block(x, self_attention_cache=cache[i], self_attention_cache_update_index=index)
            caches.append(c)
        return self.head(self.norm(x)), tf.stack(caches)


def tflite_runner(fn, signature, owner):
    from ai_edge_litert import interpreter as litert

    module = tf.Module()
    module.owner = owner
    concrete = fn.get_concrete_function(*signature)
    converter = tf.lite.TFLiteConverter.from_concrete_functions([concrete], module)
    converter.target_spec.supported_ops = [tf.lite.OpsSet.TFLITE_BUILTINS]
    interpreter = litert.Interpreter(model_content=converter.convert())
    # A model converted from one concrete function may carry no SignatureDef
    # (ai-edge-litert 2.3), so inputs are matched to the specs' names directly.
    interpreter.allocate_tensors()
    inputs = interpreter.get_input_details()
    out = interpreter.get_output_details()[0]
    names = [spec.name for spec in signature]

    def run(**kwargs):
        for position, detail in enumerate(inputs):
            name = next((n for n in names if n in detail["name"]), names[position])
            interpreter.set_tensor(detail["index"], kwargs[name])
        interpreter.invoke()
        return interpreter.get_tensor(out["index"])

    return run


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[32, 128, 512])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--position", default="learned", choices=["learned", "sinusoidal", "rotary"],
                        help="position encoding of our model (KerasHub's is learned)")
    parser.add_argument("--skip-tflite", action="store_true")
    parser.add_argument("--skip-keras-hub", action="store_true")
    parser.add_argument("--json", help="write the raw rows to this file")
    parser.add_argument("--markdown", help="write the table to this file")
    results_file.add_argument(parser, "decode")
    args = parser.parse_args(argv)
    results_file.start(args)
    keras.utils.set_random_seed(0)
    max_len = max(args.lengths)
    lm = DecoderOnlyLM(args.vocab, max_len, args.hidden, args.layers, args.heads, args.hidden * 4,
                       position=args.position)
    lm(np.zeros((1, 2), "int32"))
    hub = None
    if not args.skip_keras_hub:
        try:
            hub = HubLM(args, max_len)
        except ImportError as error:
            print(f"KerasHub not available ({error}); install with `pip install -e '.[peers]'`.")

    full = tf.function(lambda ids: lm(ids)[:, -1], jit_compile=True)
    # One stacked cache tensor in and out, like KerasHub's step below (and our
    # exported `decode` signatures): the per-layer list would cost a Python-side
    # argument conversion per tensor on every call, which is not attention work.
    def our_step(ids, stacked, index):
        logits, new_cache = lm.call_with_cache(ids, cache_lib.unstack_cache(stacked), index)
        return logits, cache_lib.stack_cache(new_cache)

    step = tf.function(our_step, jit_compile=True)
    if hub is not None:
        hub_step = tf.function(hub.step, jit_compile=True)
        hub_full = tf.function(lambda ids: hub(ids)[:, -1], jit_compile=True)
    rows = []
    for n in args.lengths:
        row = {"n": n}
        ids = tf.constant(np.random.default_rng(n).integers(1, args.vocab, (1, n)), tf.int32)
        token = ids[:, -1:]
        index = tf.constant(n - 1, tf.int32)
        cache = lm.init_cache(1, n)
        stacked_cache = cache_lib.stack_cache(cache)
        row["keras_cached"] = timeit(lambda: _np(step(token, stacked_cache, index)[0]), args.repeats)
        row["keras_recompute"] = timeit(lambda: _np(full(ids)), max(3, args.repeats // 4))
        if hub is not None:
            hub_cache = hub.empty_cache(n)
            row["hub_cached"] = timeit(lambda: _np(hub_step(token, hub_cache, index)[0]),
                                       args.repeats)
            row["hub_recompute"] = timeit(lambda: _np(hub_full(ids)), max(3, args.repeats // 4))
        if not args.skip_tflite:
            interp = gen_export.tflite_bytes(lm, max_length=n, batch_size=1, prompt_length=1)
            from ai_edge_litert import interpreter as litert

            decode = litert.Interpreter(model_content=interp).get_signature_runner("decode")
            stacked = np.asarray(cache_lib.stack_cache(cache))
            tok = token.numpy()
            row["tflite_cached"] = timeit(
                lambda: decode(token_ids=tok, cache=stacked, index=np.array(n - 1, np.int32)),
                args.repeats)
            lite_full = tflite_runner(tf.function(lambda ids: lm(ids)[:, -1]),
                                      [tf.TensorSpec((1, n), tf.int32, name="ids")], lm)
            row["tflite_recompute"] = timeit(lambda: lite_full(ids=ids.numpy()),
                                             max(3, args.repeats // 4))
            if hub is not None:
                try:
                    hub_lite = tflite_runner(
                        tf.function(lambda ids, cache, index: hub.step(ids, cache, index)[0]),
                        [tf.TensorSpec((1, 1), tf.int32, name="ids"),
                         tf.TensorSpec(hub_cache.shape, name="cache"),
                         tf.TensorSpec((), tf.int32, name="index")],
                        [hub.embedding, hub.norm, hub.head] + hub.blocks)
                    hub_np = hub_cache.numpy()
                    row["hub_tflite_cached"] = timeit(
                        lambda: hub_lite(ids=tok, cache=hub_np, index=np.array(n - 1, np.int32)),
                        args.repeats)
                except Exception as error:  # noqa: BLE001  report any converter failure
                    row["hub_tflite_cached"] = f"failed: {type(error).__name__}: " + str(
                        error).strip().splitlines()[0][:120]
        rows.append(row)
        print(row, flush=True)

    _common.emit(to_markdown(args, rows), args, rows=rows)
    return rows


def to_markdown(args, rows):
    def ms(v):
        return f"{v:.2f}" if isinstance(v, float) else ("-" if v is None else str(v))

    def ratio(a, b):
        return f"{a / b:.2f}x" if isinstance(a, float) and isinstance(b, float) else "-"

    header = ["n", "ours cached (XLA)", "ours recompute", "cached speed-up", "KerasHub cached (XLA)",
              "KerasHub / ours", "ours TFLite cached", "ours TFLite recompute", "TFLite speed-up",
              "KerasHub step in TFLite"]
    body = [
        [r["n"], ms(r["keras_cached"]), ms(r["keras_recompute"]),
         ratio(r["keras_recompute"], r["keras_cached"]), ms(r.get("hub_cached")),
         ratio(r.get("hub_cached"), r["keras_cached"]), ms(r.get("tflite_cached")),
         ms(r.get("tflite_recompute")), ratio(r.get("tflite_recompute"), r.get("tflite_cached")),
         ms(r.get("hub_tflite_cached"))]
        for r in rows
    ]
    return (f"Batch 1, hidden {args.hidden}, {args.layers} layers, {args.heads} heads, vocab "
            f"{args.vocab}, {args.position} positions (KerasHub's are learned); best-of-{args.repeats} "
            "ms per generated token. Both cached steps take and return one stacked cache tensor. "
            "Ratios > 1 mean ours is faster.\n\n" + _common.markdown_table(header, body))


if __name__ == "__main__":
    main()
