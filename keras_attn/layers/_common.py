"""Helpers shared by the attention layers: initializers, the call preamble, masks.

Their argument checks are `keras_attn.checks`; registration is
`keras_attn.saving.register`.
"""

import keras

from keras_attn import checks
from keras_attn.ops import masking
from keras_attn.ops import shapes


def clone_initializer(initializer):
    """A fresh copy of `initializer` for one more weight.

    Keras initializers are stateless: one unseeded instance gives the same
    values at every call, so sublayers sharing it (query, key and value
    projections) would start identical. As Keras and KerasHub, each sublayer
    gets its own copy; an explicitly seeded initializer stays deterministic.
    """
    return initializer.__class__.from_config(initializer.get_config())


def mask_tensors(*masks):
    """Masks given as Python lists or tuples, as tensors (as Keras accepts them)."""
    return tuple(
        keras.ops.convert_to_tensor(m) if isinstance(m, (list, tuple)) else m for m in masks
    )


def attention_call_preamble(layer_name, query, value, key, **masks):
    """The start of every attention layer's call: floating-point features
    (a TypeError naming the argument otherwise), and the masks given as
    Python lists as tensors. Returns the masks in the order given."""
    checks.check_float_features(layer_name, query=query, value=value, key=key)
    return mask_tensors(*masks.values())


def single_head_call_masks(layer_name, query, value, key, *, use_causal_mask=False,
                           feature_checks=(), **masks):
    """The preamble of `DotProductAttention` and `AdditiveAttention`:
    `(key_or_value, mask)` after `attention_call_preamble`, the batch,
    length and feature checks, and `merge_attention_masks`."""
    query_mask, value_mask, key_mask, attention_mask = attention_call_preamble(
        layer_name, query, value, key, **masks
    )
    key_or_value = value if key is None else key
    checks.check_attention_inputs(query, value, key_or_value, feature_checks=feature_checks)
    mask = merge_attention_masks(
        query, value, key, query_mask=query_mask, value_mask=value_mask, key_mask=key_mask,
        attention_mask=attention_mask, use_causal_mask=use_causal_mask, num_heads=1,
    )
    return key_or_value, mask.dense(shapes.dim(query, 1), shapes.dim(value, 1))


def merge_attention_masks(
    query,
    value,
    key=None,
    *,
    query_mask=None,
    value_mask=None,
    key_mask=None,
    attention_mask=None,
    use_causal_mask=False,
    num_heads=None,
    sliding_window=None,
):
    """Every mask source of an uncached call as one `keras_attn.ops.masking.AttentionMask`.

    Padding masks (Keras masks of the inputs, or given), the explicit
    `attention_mask` and the causal / sliding-window band combine by logical
    AND (`AttentionMask.dense` is the one boolean tensor). As in
    `keras.layers.MultiHeadAttention`, `key_mask` is ignored when `key` is
    None or is `value`, and `attention_mask` is `(B, T_q, T_k)` (or
    `(B, H, T_q, T_k)`); a rank-2 one is `(T_q, T_k)`, shared by the batch,
    whatever the batch size (`keras_attn.ops.normalize_attention_mask`).
    `sliding_window` is the band `|i - j| < sliding_window`
    (`keras_attn.ops.sliding_window_mask`). The band stays a description and
    `query_mask` stays apart (`AttentionMask.query_valid`), for the kernel.
    """
    if key is None or key is value:
        key_mask = None
        key = value
    checks.check_padding_mask("query_mask", query_mask, query, "query")
    checks.check_padding_mask("value_mask", value_mask, value, "value")
    checks.check_padding_mask("key_mask", key_mask, key, "key")
    key_valid = masking.combine_masks(value_mask, key_mask)
    return masking.AttentionMask(
        mask=masking.combine_masks(
            None if key_valid is None else masking.expand_bool(key_valid, (1, 2)),
            masking.normalize_attention_mask(
                attention_mask,
                batch_size=query.shape[0],
                query_length=query.shape[1],
                key_length=value.shape[1],
                num_heads=num_heads,
            ),
        ),
        is_causal=bool(use_causal_mask),
        sliding_window=sliding_window,
        query_valid=masking.as_bool(query_mask),
    )


def rms_normalize(x, epsilon):
    """`x / sqrt(mean(x^2) + epsilon)` over the last axis, without a scale, in
    float32 (Gemma 4's value norm); cast back to `x`'s dtype."""
    x32 = keras.ops.cast(x, "float32")
    mean_square = keras.ops.mean(keras.ops.square(x32), axis=-1, keepdims=True)
    return keras.ops.cast(x32 * keras.ops.rsqrt(mean_square + epsilon), x.dtype)
