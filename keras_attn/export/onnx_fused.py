"""ONNX written straight from the Keras layers and weights (the direct writer).

tf2onnx traces the model into a TensorFlow graph, freezes its variables into
constants and rewrites that graph op by op: it holds the weights several
times over (a converted BERT-base passed 9 GB; benchmarks/RESULTS.md, "Real
sizes: encoder exports") and turns a Transformer block into dozens of small
ops (LayerNorm as mean/variance arithmetic, attention as reshapes,
transposes and matmuls) that onnxruntime's transformer optimizer does not
recognise. `direct_model_proto` instead reads the model's description
(`keras_attn.description.read_encoder`) and writes each step from its
weights, each weight once, straight into the ModelProto. `export_onnx` uses
it wherever it applies and tf2onnx for the rest (`writer="auto"`).

Two op sets, the same arithmetic:
- standard ONNX (`fused=False`, any runtime): attention as MatMul / Softmax
  with the packed QKV projection split in three, `LayerNormalization`,
  GELU as `Erf` (or its tanh form) arithmetic;
- onnxruntime's fused contrib ops (`fused=True`, the ops onnxruntime's
  optimizer would have fused them into; the file runs only in
  onnxruntime): `com.microsoft::Attention` (packed QKV projection, scaled
  dot product, 2-D raw key mask), `SkipLayerNormalization` (residual add,
  bias and LayerNorm in one kernel), `BiasGelu` (erf GELU) or `FastGelu`
  (the tanh GELU, which is exactly what FastGelu computes).

A block with rotary positions, a window, grouped key/value heads or QK-norm
(ModernBERT, EuroBERT, NomicBERT, Gemma 3's text encoder) has its attention
in standard ops in both op sets (`_Writer.grouped_attention`): the angles
computed from the positions `0 .. T - 1` as `RotaryEmbedding` computes them,
the window the symmetric band `|i - j| < window`. A sentence embedding's
pooling is masked sums over the tokens (`CumSum` of the mask picks the
first and last token). What the writer covers is the capability table's
(`keras_attn.export.capabilities`, "onnx_encoder"); anything else raises
`NotFusableError` with its reason (then `export_onnx` uses tf2onnx).
"""

import collections

import numpy as np

from keras_attn import description as description_lib
from keras_attn.export import capabilities
from keras_attn.export.onnx_graph import MS_DOMAIN
from keras_attn.export.onnx_graph import Graph
from keras_attn.layers.sentence_pooling import MIN_COUNT

_GELUS = {"gelu": "BiasGelu", "gelu_tanh": "FastGelu"}


class _Writer(Graph):
    """The encoder's `Graph`: every initializer streamed, given
    `weights_file`, into the model file itself (`external=False`), values
    named by `fresh`; `fused`: the contrib op set (see the module docstring)."""

    def __init__(self, opset, fused, weights_file=None):
        super().__init__(weights_file)
        self.opset = opset
        self.fused = fused
        self._count = 0

    def fresh(self, hint):
        self._count += 1
        return f"{hint}_{self._count}"

    def const(self, array, hint):
        return super().const(array, self.fresh(hint))

    def node(self, op, inputs, hint, domain="", outputs=1, **attrs):
        names = [self.fresh(hint) for _ in range(outputs)]
        return super().node(op, inputs, self.fresh(op), outputs=names, domain=domain, **attrs)

    # -- building blocks ------------------------------------------------------

    def dense(self, x, kernel, bias, activation, hint):
        y = self.node("MatMul", [x, self.const(kernel, hint + "_kernel")], hint)
        if self.fused and activation in _GELUS and bias is not None:
            return self.node(_GELUS[activation], [y, self.const(bias, hint + "_bias")], hint, domain=MS_DOMAIN)
        if bias is not None:
            y = self.node("Add", [y, self.const(bias, hint + "_bias")], hint)
        return self.activation(y, hint, activation, standard=not self.fused)

    def norm(self, x, norm, hint):
        """A described `Norm` over the last axis: LayerNorm (with or without
        its bias) or RMSNorm."""
        if norm.kind == "rms":
            return self.rms_norm(x, self.const(norm.scale.read(), hint + "_scale"), norm.epsilon, self.opset,
                                 lambda part: f"{hint}_{part}")
        inputs = [x, self.const(norm.scale.read(), hint + "_gamma")]
        if norm.bias is not None:
            inputs.append(self.const(norm.bias.read(), hint + "_beta"))
        return self.node("LayerNormalization", inputs, hint, axis=-1, epsilon=float(norm.epsilon))

    def skip_layer_norm(self, x, skip, norm, bias, hint):
        """`norm(x + skip + bias)` (`bias` None: none); onnxruntime's
        SkipLayerNormalization when fused and `norm` a LayerNorm with a bias."""
        if not (self.fused and norm.kind == "layer" and norm.bias is not None):
            y = x if bias is None else self.node("Add", [x, self.const(bias, hint + "_bias")], hint)
            return self.norm(self.node("Add", [y, skip], hint), norm, hint)
        inputs = [x, skip, self.const(norm.scale.read(), hint + "_gamma"), self.const(norm.bias.read(), hint + "_beta")]
        if bias is not None:
            inputs.append(self.const(bias, hint + "_bias"))
        return self.node("SkipLayerNormalization", inputs, hint, domain=MS_DOMAIN, epsilon=float(norm.epsilon))

    def positions(self, h):
        """The int64 positions `0 .. T - 1` of `h` `(B, T, ...)`."""
        def make():
            length = self.node("Squeeze", [self.node("Shape", [h], "length", start=1, end=2)], "length")
            return self.node("Range", [self.const(np.int64(0), "start"), length, self.const(np.int64(1), "delta")],
                             "positions")
        return self.once("positions", make)

    def rotary(self, rotary, h):
        """`(cos, sin)` `(1, T, 1, rotary_dim / 2)` of a described `Rotary` at
        the positions of `h`, as `RotaryEmbedding.call` computes them (float32
        angles `position / scaling_factor * frequency`, then cos and sin; no
        attention factor: only LongRoPE has one, which the table refuses here)."""
        layer = rotary.layer

        def make():
            angles = self.node("Cast", [self.positions(h)], "positions_float", to=_onnx_type("float32"))
            if layer.scaling_factor != 1.0:
                angles = self.node("Div", [angles, self.const(np.float32(layer.scaling_factor), "scaling")],
                                   "scaled_positions")
            frequencies = description_lib.array_of(layer.inverse_frequencies(rotary.head_dim)).reshape(1, -1)
            angles = self.node("Mul", [self.node("Unsqueeze", [angles, self.const(np.array([1], np.int64), "axis")],
                                                 "column"), self.const(frequencies, "frequencies")], "angles")
            axes = self.const(np.array([0, 2], np.int64), "axes")
            return tuple(self.node("Unsqueeze", [self.node(op, [angles], op), axes], op)
                         for op in ("Cos", "Sin"))

        return self.once(("rotary", id(layer)), make)

    def key_mask(self, padding, h, causal, window):
        """The bool `(B|1, 1, T|1, T)` mask of the keys each query sees: the
        `(B, T)` `padding`'s (None: all), within the causal triangle and the
        symmetric band `|i - j| < window` (one `(T, T)` band per window, shared
        by the layers); None when every key is seen."""
        def make():
            mask = None
            if causal or window is not None:
                positions = self.positions(h)
                query = self.node("Unsqueeze", [positions, self.const(np.array([1], np.int64), "axis")], "query")
                key = self.node("Unsqueeze", [positions, self.const(np.array([0], np.int64), "axis")], "key")
                if causal:
                    mask = self.node("LessOrEqual", [key, query], "causal")
                if window is not None:
                    distance = self.node("Abs", [self.node("Sub", [query, key], "distance")], "distance")
                    near = self.node("Less", [distance, self.const(np.int64(window), "window")], "band")
                    mask = near if mask is None else self.node("And", [mask, near], "band")
            if padding is not None:
                keys = self.node("Unsqueeze", [self.node("Cast", [padding], "mask_bool", to=_onnx_type("bool")),
                                               self.const(np.array([1, 2], np.int64), "axes")], "key_mask")
                mask = keys if mask is None else self.node("And", [keys, mask], "key_mask")
            return mask
        return self.once(("key_mask", padding, causal, window), make)

    def mask_bias(self, mask):
        """The float32 bias of the bool `mask` (0 where it is true, the
        lowest float32 where false), made once and added to every layer's
        scores: onnxruntime adds a broadcast bias faster than it selects
        with `Where` (a tenth of ModernBERT-base's time at 512 tokens went
        to the selects). A seen key's score is unchanged and an unseen one's
        weight is exp(lowest) = 0, as with the select; a query that sees no
        key is zeroed after the softmax (`_zero_unseeing_rows` and
        `grouped_attention`)."""
        return self.once(("mask_bias", mask), lambda: self.node("Where", [
            mask, self.const(np.float32(0), "seen"),
            self.const(np.float32(np.finfo(np.float32).min), "lowest")], "mask_bias"))

    def grouped_attention(self, h, a, padding, causal, hint):
        """Self-attention of `h` (B, T, D) as the described `Attention` `a`
        (grouped heads, rotary positions, a window, biases or none) in
        standard ops, before the output projection; `padding`: the `(B, T)`
        key mask or None. Returns `(B, T, H d)`, zero on the rows of queries
        that see no key (as Keras's attention gives them)."""
        heads, kv_heads, d = a.num_heads, a.num_key_value_heads, a.head_dim
        group = heads // kv_heads
        qkv = self.node("MatMul", [h, self.const(a.packed_kernel(), hint + "_qkv_kernel")], hint + "_qkv")
        bias = a.packed_bias()
        if bias is not None:
            qkv = self.node("Add", [qkv, self.const(bias, hint + "_qkv_bias")], hint + "_qkv")
        widths = self.const(np.array([heads * d, kv_heads * d, kv_heads * d], np.int64), hint + "_split")
        q, k, v = self.node("Split", [qkv, widths], hint + "_split", outputs=3, axis=2)
        q, k, v = (self.node("Reshape", [t, self.const(np.array([0, 0, n, d], np.int64), hint + "_heads")], hint)
                   for t, n in ((q, heads), (k, kv_heads), (v, kv_heads)))  # (B, T, H, d)
        if a.query_norm is not None:  # QK-norm: over each head, before the rotation
            q, k = self.norm(q, a.query_norm, hint + "_q_norm"), self.norm(k, a.key_norm, hint + "_k_norm")
        if a.rotary is not None:
            cos, sin = self.rotary(a.rotary, h)
            q, k = (self.rotate_half(t, cos, sin, d, a.rotary.rotary_dim, lambda part: f"{hint}_{part}")
                    for t in (q, k))
        q = self.node("Mul", [q, self.const(np.float32(1 / np.sqrt(d)), hint + "_scale")], hint)
        # (B, T, H_kv, G, d) -> (B, H_kv, G, T, d) -> (B, H_kv, G T, d)
        q = self.node("Reshape", [q, self.const(np.array([0, 0, kv_heads, group, d], np.int64), hint)], hint)
        q = self.node("Transpose", [q], hint, perm=[0, 2, 3, 1, 4])
        q = self.node("Reshape", [q, self.const(np.array([0, kv_heads, -1, d], np.int64), hint)], hint)
        k = self.node("Transpose", [k], hint, perm=[0, 2, 3, 1])  # (B, H_kv, d, T)
        scores = self.node("MatMul", [q, k], hint + "_scores")  # (B, H_kv, G T, T)
        mask = self.key_mask(padding, h, causal, a.window)
        if mask is not None:
            bias = self.mask_bias(mask)
            if group > 1 and (causal or a.window is not None):  # a mask per query row: per group too
                bias = self.once(("grouped_bias", bias, group), lambda: self.node(
                    "Tile", [bias, self.const(np.array([1, 1, group, 1], np.int64), "group")], "mask_bias"))
            scores = self.node("Add", [scores, bias], hint + "_masked")
        probs = self.node("Softmax", [scores], hint + "_probs", axis=-1)
        v = self.node("Transpose", [v], hint, perm=[0, 2, 1, 3])  # (B, H_kv, T, d)
        out = self.node("MatMul", [probs, v], hint + "_context")  # (B, H_kv, G T, d)
        out = self.node("Reshape", [out, self.const(np.array([0, kv_heads, group, -1, d], np.int64), hint)], hint)
        out = self.node("Transpose", [out], hint, perm=[0, 3, 1, 2, 4])  # (B, T, H_kv, G, d)
        out = self.node("Reshape", [out, self.const(np.array([0, 0, heads * d], np.int64), hint)], hint + "_context")
        if padding is None:
            return out  # a query always sees itself
        return self._zero_unseeing_rows(out, mask, hint)

    def attention(self, h, kernel, bias, padding, heads, causal, hint):
        """Multi-head self-attention of `h` (B, T, D) with the packed `(D, 3 H d)`
        QKV projection, before the output projection; `padding`: the bool
        `(B, T)` key mask's value name or None. Returns `(B, T, H d)`."""
        if self.fused:
            inputs = [h, self.const(kernel, hint + "_qkv_kernel"), self.const(bias, hint + "_qkv_bias")]
            if padding is not None:
                inputs.append(self.once(("int", padding), lambda: self.node(
                    "Cast", [padding], "mask_int", to=_onnx_type("int32"))))
            context = self.node("Attention", inputs, hint, domain=MS_DOMAIN, num_heads=heads,
                                unidirectional=int(causal))
        else:
            width = kernel.shape[1] // 3
            head = width // heads
            qkv = self.node("MatMul", [h, self.const(kernel, hint + "_qkv_kernel")], hint + "_qkv")
            qkv = self.node("Add", [qkv, self.const(bias, hint + "_qkv_bias")], hint + "_qkv")
            split = self.const(np.array([width] * 3, np.int64), hint + "_split")
            q, k, v = self.node("Split", [qkv, split], hint + "_split", outputs=3, axis=2)
            heads_shape = self.const(np.array([0, 0, heads, head], np.int64), hint + "_heads")
            # q: (B, H, T, d), k: (B, H, d, T), v: (B, H, T, d)
            q, k, v = (self.node("Transpose", [self.node("Reshape", [t, heads_shape], hint)], hint, perm=perm)
                       for t, perm in ((q, [0, 2, 1, 3]), (k, [0, 2, 3, 1]), (v, [0, 2, 1, 3])))
            q = self.node("Mul", [q, self.const(np.float32(1 / np.sqrt(head)), hint + "_scale")], hint)
            scores = self.node("MatMul", [q, k], hint + "_scores")  # (B, H, T, T)
            if padding is not None:
                keys = self.key_mask(padding, h, causal=False, window=None)
                scores = self.node("Add", [scores, self.mask_bias(keys)], hint + "_masked")
            if causal:
                seen = self.key_mask(None, h, causal=True, window=None)
                scores = self.node("Add", [scores, self.mask_bias(seen)], hint + "_causal")
            probs = self.node("Softmax", [scores], hint + "_probs", axis=-1)
            context = self.node("Transpose", [self.node("MatMul", [probs, v], hint)], hint, perm=[0, 2, 1, 3])
            context = self.node("Reshape", [context, self.const(np.array([0, 0, width], np.int64), hint + "_merge")],
                                hint + "_context")
        if padding is None:
            return context  # a query always sees itself
        return self._zero_unseeing_rows(context, self.key_mask(padding, h, causal, None), hint)

    def _zero_unseeing_rows(self, out, mask, hint):
        """`out` `(B, T, W)` zero on the rows of queries that see no key of
        the bool `mask` (`key_mask`'s: every key padded, or none left of a
        causal query), as Keras's attention gives them; a softmax over only
        masked scores would average every value instead."""
        def seeing():  # (B, T|1, 1): 1 where a query sees a key
            seen = _reduce(self, "ReduceMax", self.node("Cast", [mask], "seeing", to=_onnx_type("float32")),
                           -1, 1, "seeing")
            return self.node("Squeeze", [seen, self.const(np.array([1], np.int64), "axis")], "seeing")

        return self.node("Mul", [out, self.once(("seeing_rows", mask), seeing)], hint + "_seen")


def _onnx_type(dtype):
    import onnx

    return onnx.helper.np_dtype_to_tensor_dtype(np.dtype(dtype))


def _emit_block(w, step, x, padding, rows, hint):
    """One `BlockStep`: returns the output value name.

    `padding`: the `(B, T)` key mask (bool or int) or None; `rows`: the float
    `(B, T, 1)` query mask, applied with `mask_padded_queries`.
    """
    layer = step.layer
    a, f = layer.attention, layer.feedforward
    plain = (a.rotary is None and a.window is None and a.num_key_value_heads == a.num_heads
             and a.query_norm is None)

    def attention(h):
        if plain:  # BERT's: onnxruntime's fused Attention where fused
            kernel, bias = a.packed_kernel(), a.packed_bias()
            if bias is None:  # both attention forms (`_Writer.attention`) take a bias: zeros
                bias = np.zeros(kernel.shape[1], np.float32)
            out = w.attention(h, kernel, bias, padding, a.num_heads, step.causal, hint + "_attention")
        else:
            out = w.grouped_attention(h, a, padding, step.causal, hint + "_attention")
        if padding is not None and step.mask_padded_queries:
            # As MultiHeadAttention: padded query rows are zeroed before the
            # output projection (they then hold its bias).
            out = w.node("Mul", [out, rows], hint + "_rows")
        return w.node("MatMul", [out, w.const(a.output.kernel.read(), hint + "_out_kernel")], hint + "_out")

    def ffn(h):
        if f.gate is not None:
            def dense(x, part, described):  # the down projection's bias joins the residual
                bias = None if part == "down" else described.read_bias()
                return w.dense(x, described.kernel.read(), bias, "linear", f"{hint}_ffn_{part}")
            return w.feedforward(h, f, dense, lambda part: f"{hint}_ffn_{part}", standard=not w.fused)
        h = w.dense(h, f.up.kernel.read(), f.up.read_bias(), f.activation, hint + "_ffn1")
        return w.node("MatMul", [h, w.const(f.down.kernel.read(), hint + "_ffn2_kernel")], hint + "_ffn2")

    branches = ((attention, layer.attention_norm, layer.attention_post_norm, a.output.read_bias(),
                 "_attn_res", "_ln1"),
                (ffn, layer.feedforward_norm, layer.feedforward_post_norm, f.down.read_bias(), "_ffn_res", "_ln2"))
    for fn, norm, post_norm, out_bias, pre, post in branches:
        if step.normalize_first:  # x + post_norm(f(norm(x)) + bias) (a missing norm: none)
            y = fn(x if norm is None else w.norm(x, norm, hint + pre))
            if out_bias is not None:
                y = w.node("Add", [y, w.const(out_bias, hint + pre + "_bias")], hint + pre)
            if post_norm is not None:  # Gemma's sandwich norm
                y = w.norm(y, post_norm, hint + pre + "_post")
            x = w.node("Add", [x, y], hint + pre)
        else:  # norm(f(x) + bias + x)
            x = w.skip_layer_norm(fn(x), x, norm, out_bias, hint + post)
    return x


def _lookup(w, table, index, name, clamp):
    """Rows of `table` at `index`, clamped into it with `clamp`."""
    if clamp:
        index = w.node(
            "Clip", [index, w.const(np.int32(0), name + "_lo"),
                     w.const(np.int32(table.shape[0] - 1), name + "_hi")], name,
        )
    return w.node("Gather", [w.const(table, name + "_table"), index], name, axis=0)


def _emit_embedding(w, step, ids, type_ids, clamp):
    hint = step.name
    x = _lookup(w, step.tokens.read(), ids, hint + "_tokens", clamp)
    length = w.node("Shape", [ids], hint + "_shape", start=1, end=2)
    pos = w.node(
        "Slice", [w.const(step.positions.table.read(), hint + "_positions"),
                  w.const(np.array([0], np.int64), hint + "_zero"),
                  length, w.const(np.array([0], np.int64), hint + "_axis")],
        hint + "_pos",
    )
    x = w.node("Add", [x, pos], hint + "_sum")
    if step.types is not None:
        if type_ids is None:
            x = w.node("Add", [x, w.const(step.types.read()[0], hint + "_type0")], hint + "_sum")
        else:
            x = w.node("Add", [x, _lookup(w, step.types.read(), type_ids, hint + "_types", clamp)], hint + "_sum")
    if step.norm is not None:
        x = w.norm(x, step.norm, hint + "_ln")
    return x


def _reduce(w, op, x, axis, keepdims, hint):
    """`op` (ReduceSum, ReduceMax) over `axis`; `axes` is an input from
    opset 13 (ReduceSum) or 18 (the others)."""
    if w.opset >= (13 if op == "ReduceSum" else 18):
        return w.node(op, [x, w.const(np.array([axis], np.int64), hint + "_axis")], hint, keepdims=keepdims)
    return w.node(op, [x], hint, keepdims=keepdims, axes=[axis])


def _emit_pooling(w, step, hidden, mask):
    """A `PoolingStep` (modes of `capabilities.POOLING_MODES`) as masked sums
    over the tokens, as `SentencePooling` computes them."""
    hint = step.name
    float32 = _onnx_type("float32")
    tokens = w.node("Cast", [w.node("Cast", [mask], hint + "_kept", to=_onnx_type("bool"))], hint + "_kept",
                    to=float32)  # (B, T), 1.0 on a token
    def axis2(x):  # (B, T) -> (B, T, 1)
        return w.node("Unsqueeze", [x, w.const(np.array([2], np.int64), hint + "_axis2")], hint)

    def take(selected):  # the token where `selected` (B, T) is 1 (zeros where none is)
        return _reduce(w, "ReduceSum", w.node("Mul", [hidden, axis2(selected)], hint), 1, 0, hint)

    def equal(a, b):
        return w.node("Cast", [w.node("Equal", [a, b], hint)], hint, to=float32)

    axis = w.const(np.array(1, np.int32), hint + "_cumsum_axis")
    counted = w.node("CumSum", [tokens, axis], hint + "_counted")  # tokens up to each position
    count = _reduce(w, "ReduceSum", tokens, 1, 1, hint + "_count")  # (B, 1)
    vectors = []
    for mode in step.modes:
        if mode == "cls":  # the first token; token 0 in a row without one
            one = w.const(np.float32(1.0), hint + "_one")
            selected = w.node("Mul", [equal(counted, one), tokens], hint + "_cls")
            none = w.node("Sub", [one, _reduce(w, "ReduceMax", selected, 1, 1, hint)], hint + "_none")
            ones = w.node("Add", [w.node("Mul", [tokens, w.const(np.float32(0.0), hint + "_zero")], hint), one],
                          hint + "_ones")
            position0 = equal(w.node("CumSum", [ones, axis], hint), one)
            vectors.append(take(w.node("Add", [selected, w.node("Mul", [none, position0], hint)], hint)))
        elif mode == "lasttoken":  # the last token; zeros in a row without one
            vectors.append(take(w.node("Mul", [equal(counted, count), tokens], hint + "_last")))
        else:  # "mean", "mean_sqrt_len_tokens"
            total = _reduce(w, "ReduceSum", w.node("Mul", [hidden, axis2(tokens)], hint), 1, 0, hint + "_total")
            divisor = w.node("Max", [count, w.const(np.float32(MIN_COUNT), hint + "_min_count")], hint)
            if mode == "mean_sqrt_len_tokens":
                divisor = w.node("Sqrt", [divisor], hint)
            vectors.append(w.node("Div", [total, divisor], hint + "_mean"))
    return vectors[0] if len(vectors) == 1 else w.node("Concat", vectors, hint, axis=-1)


def _emit_normalize(w, step, x):
    """`x * min(rsqrt(sum(x ** 2)), 1 / epsilon)` over the last axis."""
    hint = step.name
    squares = _reduce(w, "ReduceSum", w.node("Mul", [x, x], hint), -1, 1, hint + "_squares")
    inverse = w.node("Reciprocal", [w.node("Sqrt", [squares], hint)], hint)
    inverse = w.node("Min", [inverse, w.const(np.float32(1.0 / step.epsilon), hint + "_limit")], hint)
    return w.node("Mul", [x, inverse], hint)


def _dims(tensor):
    """ONNX dims of an input or output: `batch`, then its sizes or `<name>_dim<i>`."""
    return ["batch"] + [d if d is not None else f"{tensor.name}_dim{i + 1}"
                        for i, d in enumerate(tensor.shape[1:])]


def direct_model_proto(model, *, opset=17, check_ids="clamp", fused=False, weights_file=None):
    """The model as ONNX, written from its description (see the module docstring).

    `fused`: onnxruntime's contrib ops (the file then runs only in
    onnxruntime); otherwise standard ONNX ops of `opset`. Inputs and outputs
    are named as `keras_attn.export.onnx.convert` names them.

    `weights_file`: a binary file open for writing. Each initializer is then
    written there as soon as it is made (`onnx_graph`: never all in memory,
    nor serialized twice) and the returned proto has none: its serialization
    written after them completes the model file.

    Raises `NotFusableError` (a ValueError) with the capability table's
    reason (`keras_attn.export.capabilities`, writer "onnx_encoder") before
    anything is written.
    """
    import onnx

    encoder = capabilities.checked(model, "onnx_encoder", options=[("check_ids", check_ids, (None, "clamp"))])
    w = _Writer(opset, fused, weights_file)
    elements = {"int32": onnx.TensorProto.INT32, "float32": onnx.TensorProto.FLOAT}
    graph_inputs = [onnx.helper.make_tensor_value_info(t.name, elements[t.dtype], _dims(t))
                    for t in encoder.inputs]
    v = {t.value: t.name for t in encoder.inputs}  # the description's value names -> ONNX value names
    for step in encoder.steps:
        hint = step.name
        if isinstance(step, description_lib.BlockStep):
            mask = rows = None
            if step.padding is not None:
                mask = v[step.padding]
                rows = w.once(("rows", mask), lambda: w.node("Unsqueeze", [
                    w.node("Cast", [mask], "mask_float", to=onnx.TensorProto.FLOAT),
                    w.const(np.array([2], np.int64), "axis")], "rows"))
            v[step.output] = _emit_block(w, step, v[step.input], mask, rows, hint)
        elif isinstance(step, description_lib.EmbeddingStep):
            v[step.output] = _emit_embedding(w, step, v[step.input], v.get(step.type_ids),
                                             clamp=check_ids == "clamp")
        elif isinstance(step, description_lib.LookupStep):
            v[step.output] = _lookup(w, step.table.read(), v[step.input], hint, clamp=check_ids == "clamp")
        elif isinstance(step, description_lib.ArithmeticStep):
            other = v[step.other] if step.other is not None else w.const(np.float32(step.scalar), hint + "_scalar")
            v[step.output] = w.node({"add": "Add", "multiply": "Mul"}[step.op], [v[step.input], other], hint)
        elif isinstance(step, description_lib.NormStep):
            v[step.output] = w.norm(v[step.input], step.norm, hint)
        elif isinstance(step, description_lib.DenseStep):
            v[step.output] = w.dense(v[step.input], step.dense.kernel.read(), step.dense.read_bias(),
                                     step.activation, hint)
        elif isinstance(step, description_lib.CompareStep):
            y = w.node("Equal", [v[step.input], w.const(step.scalar, hint + "_scalar")], hint)
            v[step.output] = y if step.equal else w.node("Not", [y], hint)
        elif isinstance(step, description_lib.PoolingStep):
            v[step.output] = _emit_pooling(w, step, v[step.input], v[step.mask])
        elif isinstance(step, description_lib.NormalizeStep):
            v[step.output] = _emit_normalize(w, step, v[step.input])
        elif isinstance(step, description_lib.TruncateStep):
            v[step.output] = w.node("Slice", [v[step.input], w.const(np.array([0], np.int64), hint + "_start"),
                                              w.const(np.array([step.size], np.int64), hint + "_stop"),
                                              w.const(np.array([-1], np.int64), hint + "_axis")], hint)
        elif isinstance(step, description_lib.GetItemStep):
            x = v[step.input]
            for axis in reversed(range(len(step.key))):
                if step.key[axis] is not None:
                    x = w.node("Gather", [x, w.const(np.int64(step.key[axis]), hint + "_index")], hint, axis=axis)
            v[step.output] = x
        else:  # a Step as it is
            v[step.output] = v[step.input]
    for t in encoder.outputs:
        w.graph.node.append(onnx.helper.make_node("Identity", [v[t.value]], [t.name], name=w.fresh("out")))
    outputs = [onnx.helper.make_tensor_value_info(t.name, onnx.TensorProto.FLOAT, _dims(t))
               for t in encoder.outputs]
    opsets = [("", opset)] + ([(MS_DOMAIN, 1)] if fused else [])
    return w.finish(encoder.name, graph_inputs, outputs, opsets, ir_version=8)


def fused_model_proto(model, *, opset=17, check_ids="clamp"):
    """`direct_model_proto(..., fused=True)`: onnxruntime's fused contrib ops."""
    return direct_model_proto(model, opset=opset, check_ids=check_ids, fused=True)


def fused_op_counts(model_proto):
    """How many nodes of each onnxruntime fused op type the graph has."""
    found = collections.Counter(node.op_type for node in model_proto.graph.node)
    return {name: found[name] for name in ("Attention", "MultiHeadAttention", "SkipLayerNormalization",
                                           "LayerNormalization", "EmbedLayerNormalization", "BiasGelu",
                                           "FastGelu", "Gelu")}
