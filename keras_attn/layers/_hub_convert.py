"""`TransformerEncoderBlock.from_keras_hub` / `TransformerDecoderBlock.from_keras_hub`.

KerasHub's blocks and ours have the same sublayers (our attention
sublayers are keras_attn `MultiHeadAttention`s with Keras's weights), under
slightly different names and in a different order, so weights are copied
sublayer by sublayer rather than with `set_weights(get_weights())`.
"""

import keras

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
