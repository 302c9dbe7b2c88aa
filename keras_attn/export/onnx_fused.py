"""ONNX written straight from the Keras layers and weights (the direct writer).

tf2onnx traces the model into a TensorFlow graph, freezes its variables into
constants and rewrites that graph op by op: it holds the weights several
times over (a converted BERT-base passed 9 GB; benchmarks/RESULTS.md, "Real
sizes: encoder exports") and turns a Transformer block into dozens of small
ops (LayerNorm as mean/variance arithmetic, attention as reshapes,
transposes and matmuls) that onnxruntime's transformer optimizer does not
recognise. `direct_model_proto` instead walks the functional Keras model and
writes each supported layer from its weights, each weight once, straight
into the ModelProto. `export_onnx` uses it wherever it applies and tf2onnx
for the rest (`writer="auto"`).

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

Layers covered:
- `TransformerEncoderBlock` (post-norm or pre-norm LayerNorm, full
  multi-head self-attention with a padding mask, `mask_padded_queries`
  either way, optionally causal, GELU / tanh-GELU / ReLU feed-forward): the
  attention, the output projection as a `MatMul`, the residual LayerNorms
  (pre-norm: `LayerNormalization` and `Add`), the feed-forward as two
  `MatMul`s around the activation.
- `TokenAndPositionEmbedding` (learned positions from 0, optional token
  types, optional LayerNorm): `Gather`s, `Add`s and `LayerNormalization`.
- `Dense`, `Dropout` (identity), `Identity`, `not_equal` / `equal`,
  first-token slicing `x[:, i, :]`.

Any other layer or configuration raises `NotFusableError` naming it (then
`export_onnx` uses tf2onnx). The written graph is verified against Keras
like tf2onnx's.
"""

import numpy as np

from keras_attn.export.onnx_graph import MS_DOMAIN
from keras_attn.export.onnx_graph import Graph
from keras_attn.export.onnx_graph import NotFusableError
from keras_attn.layers.activations import canonical_name as activation_name  # noqa: F401

_GELUS = {"gelu": "BiasGelu", "gelu_tanh": "FastGelu"}
# What both encoder writers cover (`tflite_encoder` too): a model outside it
# goes to the traced writer from either.
_ACTIVATIONS = ("linear", "relu", "tanh", "gelu", "gelu_tanh")


class _Writer(Graph):
    """The encoder's `Graph`: every initializer streamed, given
    `weights_file`, into the model file itself (`external=False`), values
    named by `fresh`, and the encoder's ops.

    `fused`: onnxruntime's contrib ops (`com.microsoft`) for attention, the
    residual LayerNorms and GELU; otherwise the same arithmetic in standard
    ONNX ops, which any ONNX runtime runs.
    """

    def __init__(self, opset, fused, weights_file=None):
        super().__init__(weights_file)
        self.opset = opset
        self.fused = fused
        self._count = 0
        self.values = {}  # id(KerasTensor) -> ONNX value name

    def fresh(self, hint):
        self._count += 1
        return f"{hint}_{self._count}"

    def const(self, array, hint):
        return super().const(array, self.fresh(hint))

    def node(self, op, inputs, hint, domain="", outputs=1, **attrs):
        names = [self.fresh(hint) for _ in range(outputs)]
        return super().node(op, inputs, self.fresh(op), outputs=names, domain=domain, **attrs)

    def cached(self, kind, source, make):
        return self.once((kind, source), make)  # masks derived from one input

    # -- building blocks ------------------------------------------------------

    def dense(self, x, kernel, bias, activation, hint):
        if activation not in _ACTIVATIONS:
            raise NotFusableError(f"activation {activation!r} of {hint}")
        y = self.node("MatMul", [x, self.const(kernel, hint + "_kernel")], hint)
        if self.fused and activation in _GELUS and bias is not None:
            return self.node(
                _GELUS[activation], [y, self.const(bias, hint + "_bias")], hint, domain=MS_DOMAIN
            )
        if bias is not None:
            y = self.node("Add", [y, self.const(bias, hint + "_bias")], hint)
        return self.activation(y, hint, activation, standard=not self.fused)

    def layer_norm(self, x, gamma, beta, epsilon, hint):
        return self.node(
            "LayerNormalization",
            [x, self.const(gamma, hint + "_gamma"), self.const(beta, hint + "_beta")],
            hint, axis=-1, epsilon=float(epsilon),
        )

    def skip_layer_norm(self, x, skip, gamma, beta, bias, epsilon, hint):
        """LayerNorm(x + skip + bias)."""
        if not self.fused:
            y = x if bias is None else self.node("Add", [x, self.const(bias, hint + "_bias")], hint)
            return self.layer_norm(self.node("Add", [y, skip], hint), gamma, beta, epsilon, hint)
        inputs = [x, skip, self.const(gamma, hint + "_gamma"), self.const(beta, hint + "_beta")]
        if bias is not None:
            inputs.append(self.const(bias, hint + "_bias"))
        return self.node(
            "SkipLayerNormalization", inputs, hint, domain=MS_DOMAIN, epsilon=float(epsilon)
        )

    def attention(self, h, kernel, bias, padding, heads, causal, hint):
        """Multi-head self-attention of `h` (B, T, D) with the packed `(D, 3 H d)`
        QKV projection, before the output projection; `padding`: the bool
        `(B, T)` key mask's value name or None. Returns `(B, T, H d)`."""
        if self.fused:
            inputs = [h, self.const(kernel, hint + "_qkv_kernel"), self.const(bias, hint + "_qkv_bias")]
            if padding is not None:
                inputs.append(self.cached("int", padding, lambda: self.node(
                    "Cast", [padding], "mask_int", to=_onnx_type("int32"))))
            context = self.node("Attention", inputs, hint, domain=MS_DOMAIN, num_heads=heads,
                                unidirectional=int(causal))
            return self._zero_unseeing_rows(context, h, padding, causal, hint)
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
        lowest = self.const(np.float32(np.finfo(np.float32).min), hint + "_lowest")
        if padding is not None:
            keys = self.cached("keys", padding, lambda: self.node("Unsqueeze", [
                self.node("Cast", [padding], "mask_bool", to=_onnx_type("bool")),
                self.const(np.array([1, 2], np.int64), "axes")], "key_mask"))
            scores = self.node("Where", [keys, scores, lowest], hint + "_masked")
        if causal:
            def lower_triangle():
                length = self.node("Shape", [h], "length", start=1, end=2)
                square = self.node("Concat", [length, length], "square", axis=0)
                ones = self.node("ConstantOfShape", [square], "ones",
                                 value=_onnx_tensor(np.ones(1, np.float32)))
                return self.node("Cast", [self.node("Trilu", [ones], "causal", upper=0)], "causal",
                                 to=_onnx_type("bool"))
            scores = self.node("Where", [self.cached("causal", h, lower_triangle), scores, lowest],
                               hint + "_causal")
        probs = self.node("Softmax", [scores], hint + "_probs", axis=-1)
        context = self.node("Transpose", [self.node("MatMul", [probs, v], hint)], hint, perm=[0, 2, 1, 3])
        context = self.node("Reshape", [context, self.const(np.array([0, 0, width], np.int64), hint + "_merge")],
                            hint + "_context")
        return self._zero_unseeing_rows(context, h, padding, causal, hint)

    def _zero_unseeing_rows(self, context, h, padding, causal, hint):
        """`context` (B, T, W) with the rows of queries that see no key (every
        key padded, or none left of a causal query) set to zero, as Keras's
        attention gives them; a softmax over only masked scores would average
        every value instead."""
        if padding is None:
            return context  # a query always sees itself (or every key)

        def seeing():
            keys = self.node("Cast", [padding], "seeing_keys", to=_onnx_type("float32"))  # (B, T)
            keys = self.node("Unsqueeze", [keys, self.const(np.array([1], np.int64), "seeing_axis")],
                             "seeing_keys")  # (B, 1, T)
            if causal:  # query t sees keys [0, t]: the mask times the lower triangle
                length = self.node("Shape", [h], "seeing_length", start=1, end=2)
                square = self.node("Concat", [length, length], "seeing_square", axis=0)
                ones = self.node("ConstantOfShape", [square], "seeing_ones",
                                 value=_onnx_tensor(np.ones(1, np.float32)))
                keys = self.node("Mul", [keys, self.node("Trilu", [ones], "seeing_causal", upper=0)],
                                 "seeing_keys")  # (B, T, T)
            # (B, 1 or T, 1): 1 where a key is seen. (`axes` is an input from opset 18.)
            if self.opset >= 18:
                return self.node("ReduceMax", [keys, self.const(np.array([-1], np.int64), "seeing_last")],
                                 "seeing", keepdims=1)
            return self.node("ReduceMax", [keys], "seeing", keepdims=1, axes=[-1])

        return self.node("Mul", [context, self.cached("seeing", (padding, causal), seeing)], hint + "_seen")


def _onnx_type(dtype):
    import onnx

    return onnx.helper.np_dtype_to_tensor_dtype(np.dtype(dtype))


def _onnx_tensor(array):
    import onnx

    return onnx.numpy_helper.from_array(array)


def norm_weights(norm, name):
    """(gamma, beta, epsilon) of a plain last-axis LayerNorm, else NotFusableError."""
    import keras

    if not isinstance(norm, keras.layers.LayerNormalization):
        raise NotFusableError(f"{name}: {type(norm).__name__} is not a LayerNormalization")
    axes = norm.axis if isinstance(norm.axis, (list, tuple)) else [norm.axis]
    if list(axes) != [-1] or norm.rms_scaling or not (norm.center and norm.scale):
        raise NotFusableError(f"{name}: only a centred, scaled last-axis LayerNorm is fused")
    return np.asarray(norm.gamma), np.asarray(norm.beta), norm.epsilon


def dense_weights(dense, name):
    kernel = np.asarray(dense.kernel)
    bias = np.asarray(dense.bias) if dense.use_bias else None
    activation = activation_name(dense.activation)
    if activation is None:
        raise NotFusableError(f"{name}: activation {dense.activation!r}")
    return kernel, bias, activation


def block_weights(block):
    """A `TransformerEncoderBlock`'s weights as NumPy, in the layout both
    direct writers take: `kernels`/`biases` of the query, key and value as
    `(D, H d)`/`(H d,)`, `out_kernel` `(H d, D)` and `out_bias` (or None),
    `attention_norm`/`feedforward_norm` `(gamma, beta, epsilon)`, the
    feed-forward `(kernel, bias, activation)` pairs `ffn1`/`ffn2`, and
    `heads`, `head` (the head size). Settings they do not cover raise
    `NotFusableError` naming them."""
    import types

    mha = block.self_attention
    checks = {
        "normalization": block.normalization == "layer_norm",
        "use_gated_feedforward": not block.use_gated_feedforward,
        "rotary_embedding": block.rotary_embedding is None,
        "sliding_window": block.sliding_window is None,
        "use_qk_norm": not block.use_qk_norm,
        "use_sandwich_norm": not block.use_sandwich_norm,
        "logit_soft_cap": block.logit_soft_cap is None,
        "num_key_value_heads": mha.num_key_value_heads == mha.num_heads,
        "use_gate": not mha.use_gate,
        "key_dim == value_dim": mha.key_dim == mha.value_dim,
        "attention_axes": getattr(mha, "_attention_axes", None) in (None, (1,), [1]),
    }
    bad = [k for k, ok in checks.items() if not ok]
    if bad:
        raise NotFusableError(f"{block.name}: unsupported settings {bad}")
    heads, head = mha.num_heads, mha.key_dim
    q, k, v = mha.query_dense, mha.key_dense, mha.value_dense
    features = q.kernel.shape[0]
    kernels = [np.reshape(np.asarray(d.kernel), (features, heads * head)) for d in (q, k, v)]
    if mha.use_bias:
        biases = [np.reshape(np.asarray(d.bias), (heads * head,)) for d in (q, k, v)]
    else:
        biases = [np.zeros(heads * head, "float32")] * 3
    out = mha.output_dense
    out_kernel = np.reshape(np.asarray(out.kernel), (heads * head, -1))
    out_bias = np.asarray(out.bias) if mha.output_use_bias else None
    if out_kernel.shape[1] != features:
        raise NotFusableError(f"{block.name}: attention output size differs from the input's")
    ffn2 = dense_weights(block.feedforward_output_dense, block.name)
    if ffn2[2] != "linear":
        raise NotFusableError(f"{block.name}: activation on the feed-forward output")
    return types.SimpleNamespace(
        heads=heads, head=head, kernels=kernels, biases=biases, out_kernel=out_kernel,
        out_bias=out_bias, attention_norm=norm_weights(block.self_attention_layer_norm, block.name),
        feedforward_norm=norm_weights(block.feedforward_layer_norm, block.name),
        ffn1=dense_weights(block.feedforward_intermediate_dense, block.name), ffn2=ffn2)


def layer_calls(model):
    """`(layer, node)` of each call in the functional `model`, inputs first
    (what the direct writers walk); a call with `training=True` raises
    `NotFusableError`."""
    import keras

    for depth in sorted(model._nodes_by_depth, reverse=True):
        for node in model._nodes_by_depth[depth]:
            op = node.operation
            if node.is_input or isinstance(op, keras.layers.InputLayer):
                continue
            if node.arguments.kwargs.get("training"):
                raise NotFusableError(f"{op.name} is called with training=True")
            yield op, node


def block_call(op, node):
    """`(inputs, padding_mask or None, use_causal_mask)` of a
    `TransformerEncoderBlock`'s call in a functional graph (Keras tensors),
    else `NotFusableError`."""
    args, kwargs = node.arguments.args, node.arguments.kwargs
    extra = {k: v for k, v in kwargs.items() if v is not None and v is not False}
    extra.pop("padding_mask", None)
    causal = extra.pop("use_causal_mask", False)
    if extra or len(args) > 2 or not isinstance(causal, bool):
        raise NotFusableError(f"{op.name}: called with {sorted(extra) or 'extra arguments'}")
    padding = kwargs.get("padding_mask", args[1] if len(args) > 1 else None)
    if padding is None and getattr(args[0], "_keras_mask", None) is not None:
        raise NotFusableError(f"{op.name}: inherits a Keras mask")
    return args[0], padding, causal


def embedding_call(op, node):
    """`(ids, token_type_ids or None)` of a `TokenAndPositionEmbedding`'s
    call (Keras tensors), else `NotFusableError` (also for the layer
    settings the direct writers do not cover)."""
    args, kwargs = node.arguments.args, node.arguments.kwargs
    extra = {k: v for k, v in kwargs.items() if k != "token_type_ids" and v not in (None, False, 0)}
    if extra or len(args) > 1:
        raise NotFusableError(f"{op.name}: called with {sorted(extra) or 'extra arguments'}")
    checks = {
        "position": op.position == "learned",
        "mask_zero": not op.mask_zero,
    }
    bad = [k for k, ok in checks.items() if not ok]
    if bad:
        raise NotFusableError(f"{op.name}: unsupported settings {bad}")
    return args[0], kwargs.get("token_type_ids")


def _emit_block(w, block, x, padding, rows, causal, hint):
    """One TransformerEncoderBlock: returns the output value name.

    `padding`: the `(B, T)` key mask (bool or int) or None; `rows`: the float
    `(B, T, 1)` query mask, applied with `mask_padded_queries`; `causal`:
    `use_causal_mask`.
    """
    weights = block_weights(block)
    heads, kernels, biases = weights.heads, weights.kernels, weights.biases
    out_kernel, out_bias = weights.out_kernel, weights.out_bias

    def attention(h):
        a = w.attention(h, np.concatenate(kernels, axis=1), np.concatenate(biases), padding, heads,
                        causal, hint + "_attention")
        if padding is not None and block.mask_padded_queries:
            # As MultiHeadAttention: padded query rows are zeroed before the
            # output projection (they then hold its bias).
            a = w.node("Mul", [a, rows], hint + "_rows")
        return w.node("MatMul", [a, w.const(out_kernel, hint + "_out_kernel")], hint + "_out")

    att_gamma, att_beta, att_eps = weights.attention_norm
    ff_gamma, ff_beta, ff_eps = weights.feedforward_norm
    k1, b1, act = weights.ffn1
    k2, b2, _ = weights.ffn2

    def ffn(h):
        h = w.dense(h, k1, b1, act, hint + "_ffn1")
        return w.node("MatMul", [h, w.const(k2, hint + "_ffn2_kernel")], hint + "_ffn2")

    if block.normalize_first:
        # x + f(LN(x)) + bias
        def residual(x, norm, fn, bias, name):
            gamma, beta, eps = norm
            y = fn(w.layer_norm(x, gamma, beta, eps, name))
            if bias is not None:
                y = w.node("Add", [y, w.const(bias, name + "_bias")], name)
            return w.node("Add", [x, y], name)

        x = residual(x, (att_gamma, att_beta, att_eps), attention, out_bias, hint + "_attn_res")
        return residual(x, (ff_gamma, ff_beta, ff_eps), ffn, b2, hint + "_ffn_res")
    x = w.skip_layer_norm(attention(x), x, att_gamma, att_beta, out_bias, att_eps, hint + "_ln1")
    return w.skip_layer_norm(ffn(x), x, ff_gamma, ff_beta, b2, ff_eps, hint + "_ln2")


def _emit_embedding(w, layer, ids, type_ids, hint, clamp):
    def lookup(table, index, name):
        table = np.asarray(table)
        if clamp:
            index = w.node(
                "Clip", [index, w.const(np.int32(0), name + "_lo"),
                         w.const(np.int32(table.shape[0] - 1), name + "_hi")], name,
            )
        return w.node("Gather", [w.const(table, name + "_table"), index], name, axis=0)

    x = lookup(layer.token_embedding.embeddings, ids, hint + "_tokens")
    positions = np.asarray(layer.position_embedding.position_embeddings)
    length = w.node("Shape", [ids], hint + "_shape", start=1, end=2)
    pos = w.node(
        "Slice", [w.const(positions, hint + "_positions"), w.const(np.array([0], np.int64), hint + "_zero"),
                  length, w.const(np.array([0], np.int64), hint + "_axis")],
        hint + "_pos",
    )
    x = w.node("Add", [x, pos], hint + "_sum")
    if layer.token_type_embedding is not None:
        if type_ids is None:
            row = np.asarray(layer.token_type_embedding.embeddings)[0]
            x = w.node("Add", [x, w.const(row, hint + "_type0")], hint + "_sum")
        else:
            t = lookup(layer.token_type_embedding.embeddings, type_ids, hint + "_types")
            x = w.node("Add", [x, t], hint + "_sum")
    if layer.layer_norm is not None:
        gamma, beta, eps = norm_weights(layer.layer_norm, layer.name)
        x = w.layer_norm(x, gamma, beta, eps, hint + "_ln")
    return x


def int_key(key):
    """`x[:, i, :]`-style keys: a tuple of full slices and ints, else None.
    A list is such a tuple: a `.keras` file stores the key as a list, and
    Keras's `GetItem` reads it back as the tuple."""
    if isinstance(key, list):
        key = tuple(key)
    if not isinstance(key, tuple):
        key = (key,)
    out = []
    for item in key:
        if isinstance(item, slice) and item == slice(None):
            out.append(None)
        elif isinstance(item, (int, np.integer)) and not isinstance(item, bool):
            out.append(int(item))
        else:
            return None
    return out


def direct_model_proto(model, *, opset=17, check_ids="clamp", fused=False, weights_file=None):
    """The model as ONNX, written from its layers and weights (see the module docstring).

    `fused`: onnxruntime's contrib ops (the file then runs only in
    onnxruntime); otherwise standard ONNX ops of `opset`. Inputs and outputs
    are named as `keras_attn.export.onnx.convert` names them.

    `weights_file`: a binary file open for writing. Each initializer is then
    written there, serialized, as soon as it is made (as a ModelProto piece
    holding only it), and the returned proto has none: writing the returned
    proto's serialization after them completes the model file, which parses
    as one ModelProto (protobuf merges concatenated messages). The weights are
    then never all in memory at once, nor serialized a second time.

    Raises `NotFusableError` (a ValueError) naming the first layer or setting
    it does not cover (some initializers may have been written already).
    """
    import keras
    import onnx

    from keras_attn.layers.token_and_position_embedding import TokenAndPositionEmbedding
    from keras_attn.layers.transformer_encoder_block import TransformerEncoderBlock

    if check_ids not in (None, "clamp"):
        raise NotFusableError(f"check_ids={check_ids!r} (only None and 'clamp' are fused)")
    if not hasattr(model, "_nodes_by_depth") or not hasattr(model, "output_names"):
        raise NotFusableError(f"{type(model).__name__} is not a functional Keras model")
    w = _Writer(opset, fused, weights_file)
    graph_inputs = []
    for tensor in model.inputs:
        name = tensor.name
        if tensor.dtype not in ("int32", "float32"):
            raise NotFusableError(f"input {name} of dtype {tensor.dtype}")
        dims = ["batch"] + [
            (d if d is not None else f"{name}_dim{i + 1}") for i, d in enumerate(tensor.shape[1:])
        ]
        elem = onnx.TensorProto.INT32 if tensor.dtype == "int32" else onnx.TensorProto.FLOAT
        graph_inputs.append(onnx.helper.make_tensor_value_info(name, elem, dims))
        w.values[id(tensor)] = name

    def value(t):
        if id(t) not in w.values:
            raise NotFusableError(f"tensor {getattr(t, 'name', t)!r} comes from an unsupported op")
        return w.values[id(t)]

    for op, node in layer_calls(model):
        args = node.arguments.args
        outs = node.outputs
        kind = type(op).__name__
        hint = op.name
        if isinstance(op, TransformerEncoderBlock):
            x, padding, causal = block_call(op, node)
            mask_value = rows = None
            if padding is not None:
                mask_value = value(padding)
                rows = w.cached("rows", mask_value, lambda: w.node("Unsqueeze", [
                    w.node("Cast", [mask_value], "mask_float", to=onnx.TensorProto.FLOAT),
                    w.const(np.array([2], np.int64), "axis")], "rows"))
            w.values[id(outs[0])] = _emit_block(w, op, value(x), mask_value, rows, causal, hint)
        elif isinstance(op, TokenAndPositionEmbedding):
            ids, types = embedding_call(op, node)
            w.values[id(outs[0])] = _emit_embedding(
                w, op, value(ids), None if types is None else value(types), hint,
                clamp=check_ids == "clamp",
            )
        elif isinstance(op, keras.layers.Dense):
            if len(args) != 1:
                raise NotFusableError(f"{op.name}: called with extra arguments")
            kernel, bias, activation = dense_weights(op, op.name)
            w.values[id(outs[0])] = w.dense(value(args[0]), kernel, bias, activation, hint)
        elif isinstance(op, (keras.layers.Dropout, keras.layers.Identity)):
            w.values[id(outs[0])] = value(args[0])
        elif kind in ("NotEqual", "Equal") and len(args) == 2:
            x, other = args
            if isinstance(other, keras.KerasTensor) or not np.isscalar(other):
                raise NotFusableError(f"{op.name}: only a comparison with a scalar is fused")
            x = value(x)
            scalar = w.const(np.asarray(other, dtype=args[0].dtype), hint + "_scalar")
            y = w.node("Equal", [x, scalar], hint)
            w.values[id(outs[0])] = w.node("Not", [y], hint) if kind == "NotEqual" else y
        elif kind == "GetItem" and len(args) == 2:
            key = int_key(args[1])
            if key is None or len(key) != len(args[0].shape):
                raise NotFusableError(f"{op.name}: only keys of ints and full slices are fused")
            x = value(args[0])
            for axis in reversed(range(len(key))):
                if key[axis] is not None:
                    x = w.node("Gather", [x, w.const(np.int64(key[axis]), hint + "_index")], hint, axis=axis)
            w.values[id(outs[0])] = x
        else:
            raise NotFusableError(f"layer {op.name!r} ({kind}) has no fused form")
    outputs = []
    for tensor, name in zip(model.outputs, model.output_names):
        if tensor.dtype != "float32":
            raise NotFusableError(f"output {name} of dtype {tensor.dtype}")
        w.graph.node.append(onnx.helper.make_node("Identity", [value(tensor)], [name], name=w.fresh("out")))
        dims = ["batch"] + [
            (d if d is not None else f"{name}_dim{i + 1}") for i, d in enumerate(tensor.shape[1:])
        ]
        outputs.append(onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, dims))
    w.graph.name = model.name
    w.graph.input.extend(graph_inputs)
    w.graph.output.extend(outputs)
    proto = w.proto
    proto.opset_import.append(onnx.helper.make_opsetid("", opset))
    if fused:
        proto.opset_import.append(onnx.helper.make_opsetid(MS_DOMAIN, 1))
    proto.producer_name = "keras_attn"
    proto.ir_version = 8
    return proto


def fused_model_proto(model, *, opset=17, check_ids="clamp"):
    """`direct_model_proto(..., fused=True)`: onnxruntime's fused contrib ops."""
    return direct_model_proto(model, opset=opset, check_ids=check_ids, fused=True)


def fused_op_counts(model_proto):
    """How many nodes of each onnxruntime fused op type the graph has."""
    names = ("Attention", "MultiHeadAttention", "SkipLayerNormalization", "LayerNormalization",
             "EmbedLayerNormalization", "BiasGelu", "FastGelu", "Gelu")
    counts = dict.fromkeys(names, 0)
    for node in model_proto.graph.node:
        if node.op_type in counts:
            counts[node.op_type] += 1
    return counts
