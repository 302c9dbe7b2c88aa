"""Helpers shared by the layers: registration, argument checks, masks."""

import keras

from keras_attn.layers import _dtype_checks
from keras_attn.layers.checks import PACKAGE  # noqa: F401
from keras_attn.layers.checks import check_bool  # noqa: F401
from keras_attn.layers.checks import check_block_switches  # noqa: F401
from keras_attn.layers.checks import check_choice  # noqa: F401
from keras_attn.layers.checks import check_positive_float  # noqa: F401
from keras_attn.layers.checks import check_positive_int  # noqa: F401
from keras_attn.layers.checks import register  # noqa: F401
from keras_attn.ops import dispatch
from keras_attn.ops import masking
from keras_attn.ops import shapes
from keras_attn.ops.attention import check_dropout  # noqa: F401  (re-export)


def clone_initializer(initializer):
    """A fresh copy of `initializer` for one more weight.

    Keras initializers are stateless: one unseeded instance gives the same
    values at every call, so sublayers sharing it (query, key and value
    projections) would start identical. As Keras and KerasHub, each sublayer
    gets its own copy; an explicitly seeded initializer stays deterministic.
    """
    return initializer.__class__.from_config(initializer.get_config())


def check_chunk_size(chunk_size, dropout):
    """Validates a layer's `chunk_size` (0, None, an int or a pair) against
    its (validated) `dropout`: the blocked path never builds the attention
    probabilities, so an explicit block size and dropout on them exclude each
    other (None picks the blocked path only when dropout is inactive).

    Returns it with a pair as a list, so that `get_config` survives a JSON
    round trip unchanged.
    """
    if chunk_size != 0:
        dispatch.check_chunk_size(chunk_size)
    if chunk_size not in (0, None) and dropout > 0.0:
        raise ValueError(
            "An explicit `chunk_size` (the blocked attention path) cannot be "
            "combined with attention dropout: the blocked path never builds "
            "the probabilities that dropout would drop. Use chunk_size=None "
            "(blocked only when dropout is inactive, e.g. at inference) or "
            f"dropout=0. Received: chunk_size={chunk_size!r}, dropout={dropout!r}"
        )
    return list(chunk_size) if isinstance(chunk_size, tuple) else chunk_size


def check_num_key_value_heads(num_key_value_heads, num_heads):
    """None or a positive divisor of `num_heads`."""
    check_positive_int("num_key_value_heads", num_key_value_heads, allow_none=True)
    if num_key_value_heads is not None and num_heads % num_key_value_heads:
        raise ValueError(
            "Received an invalid value for argument `num_key_value_heads`, "
            f"expected a divisor of num_heads={num_heads}. Received: "
            f"num_key_value_heads={num_key_value_heads}"
        )
    return num_key_value_heads


def mask_tensors(*masks):
    """Masks given as Python lists or tuples, as tensors (as Keras accepts them)."""
    return tuple(
        keras.ops.convert_to_tensor(m) if isinstance(m, (list, tuple)) else m for m in masks
    )


def check_activation(name, value):
    try:
        keras.activations.get(value)
    except (ValueError, TypeError) as error:
        raise ValueError(
            f"Received an invalid value for argument `{name}`, expected the "
            "name of a Keras activation (e.g. 'relu', 'gelu') or a callable. "
            f"Received: {name}={value!r}"
        ) from error
    return value


def check_shape_rank(name, shape, rank, layout):
    if shape is None or len(shape) != rank:
        raise ValueError(
            f"Expected `{name}` of rank {rank} {layout}. Received: "
            f"{name}_shape={None if shape is None else tuple(shape)}"
        )


def check_padding_mask(name, mask, tensor, tensor_name):
    """A padding mask must be `(B, T)` matching `tensor`'s batch and length."""
    if mask is None:
        return
    masking._check_mask_dtype(name, mask)
    shape = tuple(mask.shape)
    expected = tuple(tensor.shape[:2])
    ok = len(shape) == 2 and all(
        g is None or w is None or g == w for g, w in zip(shape, expected)
    )
    if not ok:
        raise ValueError(
            f"Received an invalid `{name}`: expected shape (batch, seq) = "
            f"{expected} to match `{tensor_name}`. Received: {name}.shape={shape}"
        )


def check_attention_inputs(query, value, key, feature_checks=()):
    """Checks batch and sequence agreement between query, value and key."""
    for name, x in (("query", query), ("value", value), ("key", key)):
        if len(x.shape) != 3:
            raise ValueError(
                f"Expected `{name}` of rank 3 (batch, seq, features). Received: "
                f"{name}.shape={tuple(x.shape)}"
            )
    batches = [x.shape[0] for x in (query, value, key) if x.shape[0] is not None]
    if len(set(batches)) > 1:
        raise ValueError(
            "`query`, `value` and `key` must have the same batch size. Received: "
            f"query.shape={tuple(query.shape)}, value.shape={tuple(value.shape)}, "
            f"key.shape={tuple(key.shape)}"
        )
    if (
        value.shape[1] is not None
        and key.shape[1] is not None
        and value.shape[1] != key.shape[1]
    ):
        raise ValueError(
            "`value` and `key` must have the same sequence length. Received: "
            f"value.shape={tuple(value.shape)}, key.shape={tuple(key.shape)}"
        )
    for name, x, expected in feature_checks:
        if expected is not None and x.shape[-1] is not None and x.shape[-1] != expected:
            raise ValueError(
                f"`{name}` has {x.shape[-1]} features but the layer was built "
                f"for {expected}. Received: {name}.shape={tuple(x.shape)}"
            )


def attention_call_preamble(layer_name, query, value, key, **masks):
    """The start of every attention layer's call: floating-point features
    (a TypeError naming the argument otherwise), and the masks given as
    Python lists as tensors. Returns the masks in the order given."""
    _dtype_checks.check_float_features(layer_name, query=query, value=value, key=key)
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
    check_attention_inputs(query, value, key_or_value, feature_checks=feature_checks)
    mask = merge_attention_masks(
        query, value, key, query_mask=query_mask, value_mask=value_mask, key_mask=key_mask,
        attention_mask=attention_mask, use_causal_mask=use_causal_mask, num_heads=1,
    )
    return key_or_value, mask


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
    """One `(B|1, H|1, T_q, T_k)` boolean mask from every mask source of an
    uncached call (`keras_attn.ops.masking.mask_from_positions`).

    Padding masks (Keras masks of the inputs, or given), the explicit
    `attention_mask` and the causal / sliding-window masks combine by
    logical AND. As in `keras.layers.MultiHeadAttention`, `key_mask` is
    ignored when `key` is None or is `value`, and `attention_mask` is
    `(B, T_q, T_k)` (or `(B, H, T_q, T_k)`); a rank-2 one is `(T_q, T_k)`,
    shared by the batch, whatever the batch size
    (`keras_attn.ops.normalize_attention_mask`). `sliding_window` is the
    band `|i - j| < sliding_window` (`keras_attn.ops.sliding_window_mask`).
    """
    if key is None or key is value:
        key_mask = None
        key = value
    check_padding_mask("query_mask", query_mask, query, "query")
    check_padding_mask("value_mask", value_mask, value, "value")
    check_padding_mask("key_mask", key_mask, key, "key")
    return masking.mask_from_positions(
        keras.ops.arange(shapes.dim(query, 1), dtype="int32"),
        keras.ops.arange(shapes.dim(value, 1), dtype="int32"),
        is_causal=bool(use_causal_mask),
        sliding_window=sliding_window,
        query_valid=query_mask,
        key_valid=masking.combine_masks(value_mask, key_mask),
        attention_mask=masking.normalize_attention_mask(
            attention_mask,
            batch_size=query.shape[0],
            query_length=query.shape[1],
            key_length=value.shape[1],
            num_heads=num_heads,
        ),
    )
