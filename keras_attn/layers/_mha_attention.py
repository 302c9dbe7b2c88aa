"""The steps of `MultiHeadAttention.call` between its projections.

`prepare_uncached` is the uncached twin of `_kv_cache.prepare_cached`: both
turn the call's inputs and masks into projected `(q, k, v, gate)` and one
boolean mask, so that every call then goes through the same
`_compute_attention` and output projection. `compute_attention` is the body
of the layer's default `_compute_attention` (Keras's override point).
"""

import keras
from keras import ops

from keras_attn.layers import _common
from keras_attn.layers import _mha_projections as proj
from keras_attn.ops import attention as attention_ops
from keras_attn.ops import masking
from keras_attn.ops import shapes


def check_inputs(layer, query, value, key):
    """Rank and feature sizes of an uncached call against what `layer` was built for."""
    d_q, d_v, d_k = layer._feature_dims
    checks = (("query", query, d_q), ("value", value, d_v), ("key", key, d_k))
    if layer._nd is None:
        _common.check_attention_inputs(query, value, key, feature_checks=checks)
        return
    proj.check_shapes(query.shape, value.shape, key.shape)
    for name, x, expected in checks:
        if len(x.shape) != len(query.shape) or x.shape[-1] not in (None, expected):
            raise ValueError(
                f"The layer was built for `{name}` of rank {len(query.shape)} with "
                f"{expected} features. Received: {name}.shape={tuple(x.shape)}"
            )


def project_inputs(layer, query, key, value):
    """`(q, k, v, gate)`: the projections of each input tensor computed
    together (`project`): one matmul for self-attention, query and gate in
    one and key and value in another for cross-attention. An input given as
    None (and the gate without `use_gate`) gives None."""
    denses = (
        layer._query_dense,
        layer._key_dense,
        layer._value_dense,
        layer._gate_dense if layer.use_gate else None,
    )
    groups = {}
    for x, dense in zip((query, key, value, query), denses):
        if x is not None and dense is not None:
            groups.setdefault(id(x), (x, []))[1].append(dense)
    results = {}
    for x, group in groups.values():
        results.update(zip(map(id, group), proj.project(x, group)))
    return tuple(results.get(id(dense)) for dense in denses)


def prepare_uncached(
    layer,
    query,
    value,
    key,
    *,
    query_mask,
    value_mask,
    key_mask,
    attention_mask,
    use_causal_mask,
    return_attention_scores,
    overridden,
    start_index,
):
    """`(q, k, v, gate, mask, rows, kwargs)` of an uncached call of `layer`.

    `rows` is a `(B, T_q)` query padding mask to apply to the output (None
    when it is part of `mask`), `kwargs` the causal / window arguments for
    `_compute_attention`. With the layer's own `_compute_attention`, the
    causal and window masks are left to the kernel (built block by block on
    the blocked path); an overriding subclass gets them in `mask`, as Keras
    gives them.
    """
    key_or_value = value if key is None else key
    check_inputs(layer, query, value, key_or_value)
    rows, kwargs = None, {}
    if layer._nd is not None:
        mask = proj.nd_mask(
            query, value, query_mask, value_mask, key_mask, attention_mask,
            use_causal_mask, layer.sliding_window,
        )
    else:
        # A query padding mask only zeroes whole output rows: applied to the
        # `(B, T_q, H, D)` output it leaves a key-only mask, which the
        # attention core folds into the logits for free.
        if query_mask is not None and not (return_attention_scores or overridden):
            _common.check_padding_mask("query_mask", query_mask, query, "query")
            rows, query_mask = masking._as_bool(query_mask), None
        if use_causal_mask and not overridden:
            kwargs["use_causal_mask"] = True
        if layer.sliding_window is not None and not overridden:
            kwargs["sliding_window"] = layer.sliding_window
        mask = _common.merge_attention_masks(
            query, value, key, query_mask=query_mask, value_mask=value_mask,
            key_mask=key_mask, attention_mask=attention_mask,
            use_causal_mask=use_causal_mask and overridden,
            num_heads=layer.num_heads,
            sliding_window=layer.sliding_window if overridden else None,
        )
    # query = [B, T_q, H, key_dim]; key = [B, T_k, H_kv, key_dim]
    with masking.hidden_keras_masks(query, value, key_or_value):
        q, k, v, gate = project_inputs(layer, query, key_or_value, value)
    if layer.rotary_embedding is not None:
        q = layer.rotary_embedding(q, start_index=start_index)
        k = layer.rotary_embedding(k, start_index=start_index)
    return q, k, v, gate, mask, rows, kwargs


def compute_attention(
    layer,
    query,
    key,
    value,
    attention_mask=None,
    training=None,
    return_attention_scores=False,
    use_causal_mask=False,
    attention_bias=None,
    sliding_window=None,
):
    """`(output, scores or None)` of the projected tensors; see
    `MultiHeadAttention._compute_attention`."""
    if layer._flash_attention and return_attention_scores:
        raise ValueError(
            "Returning attention scores is not supported when flash "
            "attention is enabled. Please disable flash attention to access"
            " attention scores."
        )
    # Called directly (an override calling super()), inputs may be NumPy.
    query, key, value = (ops.convert_to_tensor(x) for x in (query, key, value))
    if attention_mask is not None:
        attention_mask = ops.convert_to_tensor(attention_mask)
        masking._check_mask_dtype("attention_mask", attention_mask)
        attention_mask = masking._as_bool(attention_mask)
    if len(query.shape) > 4:
        return _compute_nd_attention(
            layer, query, key, value, attention_mask, training, return_attention_scores,
            use_causal_mask,
        )
    if attention_mask is not None:
        while len(attention_mask.shape) < 4:
            attention_mask = ops.expand_dims(attention_mask, -3)
    if layer._flash_attention:
        return _flash_attention(
            layer, query, key, value, attention_mask, use_causal_mask, attention_bias,
            sliding_window,
        ), None
    result = attention_ops.dot_product_attention(
        query,
        key,
        value,
        attention_mask=attention_mask,
        bias=attention_bias,
        is_causal=bool(use_causal_mask),
        dropout_rate=layer.dropout,
        training=bool(training),
        seed=layer.seed_generator,
        return_attention_scores=return_attention_scores,
        chunk_size=layer.chunk_size,
        sliding_window=sliding_window,
    )
    return result if return_attention_scores else (result, None)


def _flash_attention(layer, query, key, value, mask, causal, bias, sliding_window):
    # Keras's op has no window or grouped heads: both are spelled out.
    if sliding_window is not None:
        band = masking.position_mask(
            shapes.dim(query, 1), shapes.dim(key, 1), is_causal=False,
            sliding_window=sliding_window,
        )
        mask = masking.combine_masks(mask, band)
    heads = layer.num_heads // layer.num_key_value_heads
    if heads > 1:
        key, value = ops.repeat(key, heads, axis=2), ops.repeat(value, heads, axis=2)
    return ops.dot_product_attention(
        query, key, value, bias=bias, mask=mask, scale=layer.key_dim**-0.5,
        is_causal=bool(causal), flash_attention=layer._flash_attention,
    )


def _compute_nd_attention(layer, query, key, value, mask, training, return_scores, causal):
    # Folded to (B', T_q', H, D) with the attention axes flattened, then back.
    layout = layer._nd or proj.NDLayout(len(query.shape), layer._attention_axes)
    if causal:
        mask = proj.nd_mask(query, value, None, None, None, mask, True, None)
    q, batch, q_seq = layout.fold(query)
    k, _, k_seq = layout.fold(key)
    v, _, _ = layout.fold(value)
    if mask is not None:
        mask = layout.fold_mask(mask, batch, q_seq, k_seq)
    output, scores = compute_attention(layer, q, k, v, mask, training, return_scores)
    output = layout.unfold_output(output, batch, q_seq)
    if scores is not None:
        scores = layout.unfold_scores(scores, batch, q_seq, k_seq)
    return output, scores


def output_spec(layer, query, value, key, return_attention_scores, cache):
    """The `KerasTensor`s a call of `layer` returns (`compute_output_spec`)."""
    shapes_in = [None if x is None else x.shape for x in (query, value, key)]
    result = (keras.KerasTensor(layer.compute_output_shape(*shapes_in), dtype=layer.compute_dtype),)
    if return_attention_scores:
        shape = proj.scores_shape(
            query.shape, None if cache is not None else value.shape,
            layer._attention_axes, layer.num_heads,
            None if cache is None else cache[0].shape[1],
        )
        result += (keras.KerasTensor(shape, dtype=layer.compute_dtype),)
    if cache is not None:
        result += (tuple(keras.KerasTensor(c.shape, dtype=c.dtype) for c in cache),)
    return result if len(result) > 1 else result[0]
