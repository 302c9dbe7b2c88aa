"""Peers' trained layers as ours, weights copied: `MultiHeadAttention.from_keras`
/ `from_torch` and the blocks' `from_keras_hub`.

Whole pretrained checkpoints (Hugging Face) are `keras_attn.convert`'s; this
module ports single layers. KerasHub's blocks and ours have the same
sublayers (our attention sublayers are keras_attn `MultiHeadAttention`s with
Keras's weights), under slightly different names and in a different order,
so weights are copied sublayer by sublayer rather than with
`set_weights(get_weights())`.
"""

import keras
import numpy as np


def mha_from_keras(cls, layer):
    """See `MultiHeadAttention.from_keras`."""
    if not isinstance(layer, (keras.layers.MultiHeadAttention, keras.layers.GroupQueryAttention)):
        raise TypeError(
            "`from_keras` expects a keras.layers.MultiHeadAttention or "
            f"GroupQueryAttention. Received: {type(layer).__name__}"
        )
    if not layer.built:
        raise ValueError(
            "`from_keras` needs a built layer (call it once, or `build` it), "
            f"so its weights exist. Received an unbuilt layer: {layer.name}"
        )
    config = layer.get_config()
    rank = 3
    if isinstance(layer, keras.layers.GroupQueryAttention):
        kwargs = {
            "num_heads": config["num_query_heads"],
            "key_dim": config["head_dim"],
            "num_key_value_heads": config["num_key_value_heads"],
            "dropout": config["dropout"],
            "use_bias": config["use_bias"],
            "use_gate": config.get("use_gate", False),
            "dtype": config.get("dtype"),
        }
    else:
        # The query projection's equation spells the input rank ("abc,..." = 3).
        rank = len(layer._query_dense.equation.split(",")[0])
        kwargs = {
            k: config[k]
            for k in (
                "num_heads", "key_dim", "value_dim", "dropout", "use_bias", "output_shape",
                "attention_axes", "kernel_initializer", "bias_initializer",
                "kernel_regularizer", "bias_regularizer", "activity_regularizer",
                "kernel_constraint", "bias_constraint", "seed", "use_gate",
                "sliding_window", "dtype",
            )
            if k in config
        }
    kwargs["flash_attention"] = getattr(layer, "_flash_attention", None)
    new = cls(**kwargs)

    def shape(dense):
        return (None,) * (rank - 1) + (dense.kernel.shape[0],)

    new.build(shape(layer._query_dense), shape(layer._value_dense), shape(layer._key_dense))
    names = ["_query_dense", "_key_dense", "_value_dense", "_output_dense"]
    if new.use_gate:
        names.append("_gate_dense")
    for name in names:
        getattr(new, name).set_weights(getattr(layer, name).get_weights())
    return new


def mha_from_torch(cls, module, **kwargs):
    """See `MultiHeadAttention.from_torch`."""
    try:
        import torch
    except ImportError as error:  # pragma: no cover - torch is in the test extra
        raise ImportError("`from_torch` needs PyTorch installed.") from error
    if not isinstance(module, torch.nn.MultiheadAttention):
        raise TypeError(
            "`from_torch` expects a torch.nn.MultiheadAttention. Received: "
            f"{type(module).__name__}"
        )
    if module.bias_k is not None or module.add_zero_attn:
        raise ValueError(
            "`from_torch` supports neither `add_bias_kv` nor `add_zero_attn` (extra "
            f"key/value positions). Received: add_bias_kv={module.bias_k is not None}, "
            f"add_zero_attn={module.add_zero_attn}"
        )
    for name in ("num_heads", "key_dim", "value_dim", "use_bias"):
        if name in kwargs:
            raise ValueError(
                f"`{name}` comes from the torch module; do not pass it to `from_torch`. "
                f"Received: {name}={kwargs[name]!r}"
            )

    def numpy(t):
        return t.detach().cpu().float().numpy()

    heads, embed = module.num_heads, module.embed_dim
    head_dim = embed // heads
    if module._qkv_same_embed_dim:
        w_q, w_k, w_v = np.split(numpy(module.in_proj_weight), 3, axis=0)
    else:
        w_q, w_k, w_v = (numpy(getattr(module, f"{n}_proj_weight")) for n in "qkv")
    use_bias = module.in_proj_bias is not None
    b_q = b_k = b_v = None
    if use_bias:
        b_q, b_k, b_v = np.split(numpy(module.in_proj_bias), 3)
    if kwargs.get("dropout") is None:
        kwargs["dropout"] = float(module.dropout)
    new = cls(num_heads=heads, key_dim=head_dim, use_bias=use_bias, **kwargs)
    new.build((None, None, embed), (None, None, module.vdim), (None, None, module.kdim))

    def in_kernel(w):  # torch (heads * size, features) -> Keras (features, heads, size)
        return w.T.reshape(w.shape[1], heads, head_dim)

    for dense, w, b in (
        (new._query_dense, w_q, b_q),
        (new._key_dense, w_k, b_k),
        (new._value_dense, w_v, b_v),
    ):
        dense.set_weights([in_kernel(w)] + ([b.reshape(heads, head_dim)] if use_bias else []))
    w_o = numpy(module.out_proj.weight)  # (embed, heads * size)
    weights = [w_o.T.reshape(heads, head_dim, embed)]
    if use_bias:
        weights.append(numpy(module.out_proj.bias))
    new._output_dense.set_weights(weights)
    return new


# (ours, KerasHub's) sublayer attribute names.
_COMMON = (
    ("self_attention_layer_norm", "_self_attention_layer_norm"),
    ("feedforward_layer_norm", "_feedforward_layer_norm"),
    ("feedforward_intermediate_dense", "_feedforward_intermediate_dense"),
    ("feedforward_output_dense", "_feedforward_output_dense"),
)
_CROSS = (("cross_attention_layer_norm", "_cross_attention_layer_norm"),)
_MHA_DENSES = ("_query_dense", "_key_dense", "_value_dense", "_output_dense")


def _check(layer, kind):
    try:
        import keras_hub
    except ImportError as error:  # pragma: no cover - keras-hub is a test extra
        raise ImportError("`from_keras_hub` needs keras-hub installed.") from error
    expected = getattr(keras_hub.layers, kind)
    if not isinstance(layer, expected):
        raise TypeError(
            f"`from_keras_hub` expects a keras_hub.layers.{kind}. Received: "
            f"{type(layer).__name__}"
        )
    if not layer.built:
        raise ValueError(
            "`from_keras_hub` needs a built layer (call it once, or `build` it), so "
            f"its weights exist. Received an unbuilt layer: {layer.name}"
        )


def _config(layer):
    return dict(
        num_heads=layer.num_heads,
        intermediate_dim=layer.intermediate_dim,
        dropout=float(layer.dropout),
        activation=keras.activations.serialize(layer.activation),
        layer_norm_epsilon=layer.layer_norm_epsilon,
        normalize_first=bool(layer.normalize_first),
        kernel_initializer=keras.initializers.serialize(layer.kernel_initializer),
        bias_initializer=keras.initializers.serialize(layer.bias_initializer),
        dtype=layer.dtype_policy,
    )


def _copy(ours, theirs, pairs):
    for mine, hub in pairs:
        getattr(ours, mine).set_weights(getattr(theirs, hub).get_weights())


def _copy_attention(ours, theirs):
    if theirs._query_dense.kernel.shape[1:] != ours._query_dense.kernel.shape[1:]:
        raise ValueError(
            "The attention heads differ: KerasHub's query kernel is "
            f"{tuple(theirs._query_dense.kernel.shape)}, ours "
            f"{tuple(ours._query_dense.kernel.shape)}."
        )
    _copy(ours, theirs, [(n, n) for n in _MHA_DENSES])


def encoder_from_keras_hub(cls, layer):
    _check(layer, "TransformerEncoder")
    hidden = layer._self_attention_layer._query_dense.kernel.shape[0]
    new = cls(**_config(layer))
    new.build((None, None, hidden))
    _copy_attention(new.self_attention, layer._self_attention_layer)
    _copy(new, layer, _COMMON)
    return new


def decoder_from_keras_hub(cls, layer):
    _check(layer, "TransformerDecoder")
    hidden = layer._self_attention_layer._query_dense.kernel.shape[0]
    cross = layer._cross_attention_layer
    encoder_shape = None if cross is None else (None, None, cross._key_dense.kernel.shape[0])
    new = cls(**_config(layer))
    new.build((None, None, hidden), encoder_shape)
    _copy_attention(new.self_attention, layer._self_attention_layer)
    _copy(new, layer, _COMMON)
    if cross is not None:
        _copy_attention(new.cross_attention, cross)
        _copy(new, layer, _CROSS)
    return new
