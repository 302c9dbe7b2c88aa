"""`MultiHeadAttention.from_keras` / `from_torch`: peers' trained weights."""

import keras
import numpy as np


def from_keras(cls, layer):
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


def from_torch(cls, module, **kwargs):
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
