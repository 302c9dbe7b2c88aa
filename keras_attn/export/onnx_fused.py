"""ONNX with onnxruntime's fused transformer kernels, written from the Keras weights.

tf2onnx turns a Transformer block into dozens of small ops (LayerNorm as
mean/variance arithmetic, attention as reshapes, transposes and matmuls)
that onnxruntime's transformer optimizer does not recognise: it matches the
shapes PyTorch's exporter emits. Instead of pattern-matching tf2onnx's
output, `fused_model_proto` walks the functional Keras model and writes
each supported layer as the op onnxruntime's optimizer would have fused it
into:

- `TransformerEncoderBlock` (post-norm or pre-norm LayerNorm, full
  multi-head self-attention with a padding mask, `mask_padded_queries`
  either way, optionally causal, GELU / tanh-GELU / ReLU feed-forward): `com.microsoft::Attention` (packed QKV projection,
  scaled dot product, 2-D raw key mask), the output projection as a
  `MatMul`, then `com.microsoft::SkipLayerNormalization` (residual add,
  bias and LayerNorm in one kernel; pre-norm: `LayerNormalization` and
  `Add`), the feed-forward as `MatMul` + `com.microsoft::BiasGelu`
  (erf GELU) or `FastGelu` (the tanh GELU, which is exactly what FastGelu
  computes) + `MatMul`.
- `TokenAndPositionEmbedding` (learned positions from 0, optional token
  types, optional LayerNorm): `Gather`s, `Add`s and `LayerNormalization`.
- `Dense`, `Dropout` (identity), `Identity`, `not_equal` / `equal`,
  first-token slicing `x[:, i, :]`.

Any other layer or configuration raises `NotFusableError` naming it;
`export_onnx(..., fused=True)` then falls back to tf2onnx with a warning.
The fused graph is verified against Keras like the plain one.
"""

import numpy as np

MS_DOMAIN = "com.microsoft"
_GELUS = {"gelu": "BiasGelu", "gelu_tanh": "FastGelu"}


class NotFusableError(ValueError):
    """The model has a layer or setting the fused writer does not cover."""


def activation_name(fn):
    """`"gelu"`, `"gelu_tanh"`, `"silu"`, `"relu"`, `"tanh"`, `"linear"` or None (unknown)."""
    from keras_attn.layers import activations

    import keras

    if fn is None or fn is keras.activations.linear:
        return "linear"
    for name in ("gelu", "gelu_tanh", "silu", "relu"):
        if fn is activations.ALIASES[name]:
            return name
    if fn is keras.activations.gelu:
        return "gelu"
    if fn is keras.activations.relu:
        return "relu"
    if fn is keras.activations.tanh:
        return "tanh"
    if fn is keras.activations.silu:
        return "silu"
    return None


class _Writer:
    def __init__(self, opset):
        self.nodes = []
        self.initializers = []
        self.opset = opset
        self._count = 0
        self.values = {}  # id(KerasTensor) -> ONNX value name
        self.constant_ints = {}  # ONNX value name -> python int (folded scalars)

    def fresh(self, hint):
        self._count += 1
        return f"{hint}_{self._count}"

    def const(self, array, hint):
        import onnx

        name = self.fresh(hint)
        self.initializers.append(onnx.numpy_helper.from_array(np.asarray(array), name))
        return name

    def node(self, op, inputs, hint, domain="", outputs=1, **attrs):
        import onnx

        names = [self.fresh(hint) for _ in range(outputs)]
        self.nodes.append(
            onnx.helper.make_node(op, inputs, names, name=self.fresh(op), domain=domain, **attrs)
        )
        return names[0] if outputs == 1 else names

    # -- building blocks ------------------------------------------------------

    def dense(self, x, kernel, bias, activation, hint):
        y = self.node("MatMul", [x, self.const(kernel, hint + "_kernel")], hint)
        if activation in _GELUS and bias is not None:
            return self.node(
                _GELUS[activation], [y, self.const(bias, hint + "_bias")], hint, domain=MS_DOMAIN
            )
        if bias is not None:
            y = self.node("Add", [y, self.const(bias, hint + "_bias")], hint)
        if activation == "linear":
            return y
        if activation == "relu":
            return self.node("Relu", [y], hint)
        if activation == "tanh":
            return self.node("Tanh", [y], hint)
        if activation == "gelu":
            return self.node("Gelu", [y], hint, domain=MS_DOMAIN)
        if activation == "gelu_tanh":
            return self.node("FastGelu", [y], hint, domain=MS_DOMAIN)
        raise NotFusableError(f"activation {activation!r} of {hint}")

    def layer_norm(self, x, gamma, beta, epsilon, hint):
        return self.node(
            "LayerNormalization",
            [x, self.const(gamma, hint + "_gamma"), self.const(beta, hint + "_beta")],
            hint, axis=-1, epsilon=float(epsilon),
        )

    def skip_layer_norm(self, x, skip, gamma, beta, bias, epsilon, hint):
        inputs = [x, skip, self.const(gamma, hint + "_gamma"), self.const(beta, hint + "_beta")]
        if bias is not None:
            inputs.append(self.const(bias, hint + "_bias"))
        return self.node(
            "SkipLayerNormalization", inputs, hint, domain=MS_DOMAIN, epsilon=float(epsilon)
        )


def _norm_weights(norm, name):
    """(gamma, beta, epsilon) of a plain last-axis LayerNorm, else NotFusableError."""
    import keras

    if not isinstance(norm, keras.layers.LayerNormalization):
        raise NotFusableError(f"{name}: {type(norm).__name__} is not a LayerNormalization")
    axes = norm.axis if isinstance(norm.axis, (list, tuple)) else [norm.axis]
    if list(axes) != [-1] or norm.rms_scaling or not (norm.center and norm.scale):
        raise NotFusableError(f"{name}: only a centred, scaled last-axis LayerNorm is fused")
    return np.asarray(norm.gamma), np.asarray(norm.beta), norm.epsilon


def _dense_weights(dense, name):
    kernel = np.asarray(dense.kernel)
    bias = np.asarray(dense.bias) if dense.use_bias else None
    activation = activation_name(dense.activation)
    if activation is None:
        raise NotFusableError(f"{name}: activation {dense.activation!r}")
    return kernel, bias, activation


def _emit_block(w, block, x, padding, rows, causal, hint):
    """One TransformerEncoderBlock: returns the output value name.

    `padding`: the int32 `(B, T)` key mask or None; `rows`: the float
    `(B, T, 1)` query mask, applied with `mask_padded_queries`; `causal`:
    `use_causal_mask`.
    """
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

    def attention(h):
        inputs = [
            h, w.const(np.concatenate(kernels, axis=1), hint + "_qkv_kernel"),
            w.const(np.concatenate(biases), hint + "_qkv_bias"),
        ]
        if padding is not None:
            inputs.append(padding)
        a = w.node(
            "Attention", inputs, hint + "_attention", domain=MS_DOMAIN, num_heads=heads,
            unidirectional=int(causal),
        )
        if padding is not None and block.mask_padded_queries:
            # As MultiHeadAttention: padded query rows are zeroed before the
            # output projection (they then hold its bias).
            a = w.node("Mul", [a, rows], hint + "_rows")
        return w.node("MatMul", [a, w.const(out_kernel, hint + "_out_kernel")], hint + "_out")

    att_gamma, att_beta, att_eps = _norm_weights(block.self_attention_layer_norm, block.name)
    ff_gamma, ff_beta, ff_eps = _norm_weights(block.feedforward_layer_norm, block.name)
    k1, b1, act = _dense_weights(block.feedforward_intermediate_dense, block.name)
    k2, b2, act2 = _dense_weights(block.feedforward_output_dense, block.name)
    if act2 != "linear":
        raise NotFusableError(f"{block.name}: activation on the feed-forward output")

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
    checks = {
        "position": layer.position == "learned",
        "mask_zero": not layer.mask_zero,
    }
    bad = [k for k, ok in checks.items() if not ok]
    if bad:
        raise NotFusableError(f"{layer.name}: unsupported settings {bad}")

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
        gamma, beta, eps = _norm_weights(layer.layer_norm, layer.name)
        x = w.layer_norm(x, gamma, beta, eps, hint + "_ln")
    return x


def _int_key(key):
    """`x[:, i, :]`-style keys: a tuple of full slices and ints, else None."""
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


def fused_model_proto(model, *, opset=17, check_ids="clamp"):
    """The model as ONNX with onnxruntime's fused contrib ops (see the module docstring).

    Inputs and outputs are named as `keras_attn.export.onnx.convert` names
    them. Raises `NotFusableError` (a ValueError) naming the first layer or
    setting it does not cover.
    """
    import keras
    import onnx

    from keras_attn.layers.token_and_position_embedding import TokenAndPositionEmbedding
    from keras_attn.layers.transformer_encoder_block import TransformerEncoderBlock

    if check_ids not in (None, "clamp"):
        raise NotFusableError(f"check_ids={check_ids!r} (only None and 'clamp' are fused)")
    if not hasattr(model, "_nodes_by_depth") or not hasattr(model, "output_names"):
        raise NotFusableError(f"{type(model).__name__} is not a functional Keras model")
    w = _Writer(opset)
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
    masks = {}  # bool mask value -> int32 raw mask for Attention

    def value(t):
        if id(t) not in w.values:
            raise NotFusableError(f"tensor {getattr(t, 'name', t)!r} comes from an unsupported op")
        return w.values[id(t)]

    for depth in sorted(model._nodes_by_depth, reverse=True):
        for node in model._nodes_by_depth[depth]:
            op = node.operation
            if node.is_input or isinstance(op, keras.layers.InputLayer):
                continue
            args, kwargs = node.arguments.args, node.arguments.kwargs
            outs = node.outputs
            kind = type(op).__name__
            hint = op.name
            if kwargs.get("training"):
                raise NotFusableError(f"{op.name} is called with training=True")
            if isinstance(op, TransformerEncoderBlock):
                extra = {k: v for k, v in kwargs.items() if v is not None and v is not False}
                extra.pop("padding_mask", None)
                causal = extra.pop("use_causal_mask", False)
                if extra or len(args) > 2 or not isinstance(causal, bool):
                    raise NotFusableError(f"{op.name}: called with {sorted(extra) or 'extra arguments'}")
                padding = kwargs.get("padding_mask", args[1] if len(args) > 1 else None)
                if padding is None and getattr(args[0], "_keras_mask", None) is not None:
                    raise NotFusableError(f"{op.name}: inherits a Keras mask")
                mask_value = rows = None
                if padding is not None:
                    bool_name = value(padding)
                    if bool_name not in masks:
                        masks[bool_name] = (
                            w.node("Cast", [bool_name], "mask_int", to=onnx.TensorProto.INT32),
                            w.node("Unsqueeze", [
                                w.node("Cast", [bool_name], "mask_float", to=onnx.TensorProto.FLOAT),
                                w.const(np.array([2], np.int64), "axis")], "rows"),
                        )
                    mask_value, rows = masks[bool_name]
                w.values[id(outs[0])] = _emit_block(w, op, value(args[0]), mask_value, rows, causal, hint)
            elif isinstance(op, TokenAndPositionEmbedding):
                extra = {k: v for k, v in kwargs.items() if k != "token_type_ids" and v not in (None, False, 0)}
                if extra or len(args) > 1:
                    raise NotFusableError(f"{op.name}: called with {sorted(extra) or 'extra arguments'}")
                types = kwargs.get("token_type_ids")
                w.values[id(outs[0])] = _emit_embedding(
                    w, op, value(args[0]), None if types is None else value(types), hint,
                    clamp=check_ids == "clamp",
                )
            elif isinstance(op, keras.layers.Dense):
                if len(args) != 1:
                    raise NotFusableError(f"{op.name}: called with extra arguments")
                kernel, bias, activation = _dense_weights(op, op.name)
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
                key = _int_key(args[1])
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
        w.nodes.append(onnx.helper.make_node("Identity", [value(tensor)], [name], name=w.fresh("out")))
        dims = ["batch"] + [
            (d if d is not None else f"{name}_dim{i + 1}") for i, d in enumerate(tensor.shape[1:])
        ]
        outputs.append(onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, dims))
    graph = onnx.helper.make_graph(w.nodes, model.name, graph_inputs, outputs, w.initializers)
    proto = onnx.helper.make_model(
        graph,
        opset_imports=[onnx.helper.make_opsetid("", opset), onnx.helper.make_opsetid(MS_DOMAIN, 1)],
        producer_name="keras_attn",
    )
    proto.ir_version = 8
    return proto


def convert_or_fallback(model, opset, check_ids, fused, convert):
    """`fused_model_proto(model)` when `fused`, else (or when it raises
    NotFusableError, with a warning naming why) `convert(model, ...)`."""
    if not isinstance(fused, bool):
        raise ValueError(
            f"Received an invalid value for argument `fused`, expected True or False. Received: fused={fused!r}"
        )
    if fused:
        try:
            return fused_model_proto(model, opset=opset, check_ids=check_ids)
        except NotFusableError as error:
            import warnings

            warnings.warn(
                f"fused=True: {error}; exporting the plain tf2onnx graph instead.", stacklevel=3
            )
    return convert(model, opset=opset, check_ids=check_ids)


def fused_op_counts(model_proto):
    """How many nodes of each onnxruntime fused op type the graph has."""
    names = ("Attention", "MultiHeadAttention", "SkipLayerNormalization", "LayerNormalization",
             "EmbedLayerNormalization", "BiasGelu", "FastGelu", "Gelu")
    counts = dict.fromkeys(names, 0)
    for node in model_proto.graph.node:
        if node.op_type in counts:
            counts[node.op_type] += 1
    return counts
