"""Mask helpers shared by every attention layer.

All masks here are boolean: `True` means "may attend". Masks combine by
logical AND. Attention masks are normalised to rank 4, broadcastable to
`(batch, heads, T_q, T_k)`.

The causal and sliding-window masks are built from `arange` comparisons
(no `cumsum`/`tril`/strided slices), so they lower to TFLite builtin ops
and ONNX for any (dynamic) sequence length.
"""

import keras
from keras import ops


def keras_mask_of(x):
    """The Keras mask attached to `x` by an upstream layer, or None."""
    return getattr(x, "_keras_mask", None)


class hidden_keras_masks:
    """Detaches Keras masks from tensors for the duration of a `with` block.

    Attention layers consume the masks of their inputs themselves; hiding
    them keeps mask-unaware sublayers (projections) from warning that they
    drop a mask. The masks are put back on exit.
    """

    def __init__(self, *tensors):
        self._saved = []
        for x in tensors:
            mask = keras_mask_of(x)
            if mask is not None:
                self._saved.append((x, mask))

    def __enter__(self):
        for x, _ in self._saved:
            x._keras_mask = None
        return self

    def __exit__(self, *exc):
        for x, mask in self._saved:
            x._keras_mask = mask
        return False


def _as_bool(mask):
    if mask is None:
        return None
    if ops.dtype(mask) != "bool":
        mask = ops.cast(mask, "bool")
    return mask


def _expand_bool(mask, axes):
    """`ops.expand_dims` for boolean masks.

    Indexing a bool tensor with `None` lowers to a TF `StridedSlice` with
    `new_axis_mask`, which TFLite has no builtin kernel for (it needs Flex);
    `expand_dims` lowers to builtin ops. Same values either way.
    """
    return ops.expand_dims(mask, axes)


def padding_mask_to_attention_mask(query_mask=None, value_mask=None, key_mask=None):
    """Turns per-token padding masks into a `(B, 1, T_q|1, T_k|1)` mask.

    Args:
        query_mask: `(B, T_q)` mask of valid query positions, or None.
        value_mask: `(B, T_k)` mask of valid value/key positions, or None.
        key_mask: `(B, T_k)` mask of valid key positions, or None.

    Returns:
        A boolean tensor broadcastable to `(B, heads, T_q, T_k)`, or None
        when every argument is None.

    Example:

    >>> import numpy as np
    >>> m = padding_mask_to_attention_mask(value_mask=np.array([[1, 1, 0]]))
    >>> tuple(m.shape)
    (1, 1, 1, 3)
    """
    masks = []
    if query_mask is not None:
        q = _as_bool(query_mask)
        masks.append(_expand_bool(q, (1, 3)))
    for kv in (value_mask, key_mask):
        if kv is not None:
            masks.append(_expand_bool(_as_bool(kv), (1, 2)))
    return combine_masks(*masks)


def causal_mask(query_length, key_length=None, start_index=0, sliding_window=None):
    """Lower-triangular `(T_q, T_k)` mask: query `i` sees keys `j <= i + start_index`.

    `start_index` is the absolute position of the first query, as in cached
    decoding where the keys hold `start_index` earlier tokens. With
    `sliding_window=w`, query `i` also sees only keys `j > i + start_index - w`.

    Example:

    >>> m = causal_mask(3)
    >>> m.numpy().astype(int).tolist()
    [[1, 0, 0], [1, 1, 0], [1, 1, 1]]
    """
    key_length = query_length if key_length is None else key_length
    q_pos = ops.arange(query_length, dtype="int32") + ops.cast(start_index, "int32")
    k_pos = ops.arange(key_length, dtype="int32")
    mask = ops.greater_equal(q_pos[:, None], k_pos[None, :])
    if sliding_window is not None:
        mask = ops.logical_and(
            mask, ops.less(q_pos[:, None] - k_pos[None, :], sliding_window)
        )
    return mask


def sliding_window_mask(query_length, key_length=None, window=1, start_index=0):
    """Symmetric band `(T_q, T_k)`: `|i + start_index - j| < window` (as Keras MHA)."""
    key_length = query_length if key_length is None else key_length
    q_pos = ops.arange(query_length, dtype="int32") + ops.cast(start_index, "int32")
    k_pos = ops.arange(key_length, dtype="int32")
    return ops.less(ops.abs(q_pos[:, None] - k_pos[None, :]), window)


def combine_masks(*masks):
    """Logical AND of broadcastable boolean masks; None entries are ignored.

    Returns None when every mask is None.
    """
    result = None
    for mask in masks:
        if mask is None:
            continue
        mask = _as_bool(mask)
        result = mask if result is None else ops.logical_and(result, mask)
    return result


_MASK_DTYPE_PREFIXES = ("bool", "int", "uint", "float", "bfloat")


MASKED_LOGIT = -3.0e38
"""What masked logits become: far below any real logit, still finite in float32."""


def mask_to_bias(mask, row_visible=None):
    """Boolean mask -> float32 additive bias: 0 where attending, `MASKED_LOGIT` elsewhere.

    Rows of `row_visible` (`(..., T_q, 1)`, False = the row sees no key) get
    a zero bias, so their softmax stays finite; the caller zeroes their output.
    """
    bias = ops.where(mask, ops.cast(0.0, "float32"), ops.cast(MASKED_LOGIT, "float32"))
    if row_visible is not None:
        bias = ops.where(row_visible, bias, ops.cast(0.0, "float32"))
    return bias


def _check_mask_dtype(name, mask):
    dtype = getattr(mask, "dtype", None)
    try:
        # "bool" whatever the backend spells it ("torch.bool", "<dtype: 'bool'>").
        dtype = "bool" if dtype is None else keras.backend.standardize_dtype(dtype)
    except ValueError:  # not a Keras dtype at all, e.g. strings
        dtype = str(dtype)
    if not dtype.startswith(_MASK_DTYPE_PREFIXES):
        raise TypeError(
            f"Received an invalid `{name}` dtype: expected bool (True = attend) "
            f"or an integer/float 0/1 mask. Received: {name}.dtype={dtype}"
        )


def normalize_attention_mask(
    mask,
    batch_size=None,
    query_length=None,
    key_length=None,
    num_heads=None,
    name="attention_mask",
):
    """Brings an explicit attention mask to rank 4 `(B|1, H|1, T_q|1, T_k)`.

    Accepted shapes: `(B, T_k)` (key padding), `(T_q, T_k)`, `(B, T_q, T_k)`
    and `(B, H, T_q, T_k)`. A rank-2 mask is read as `(T_q, T_k)` only when its
    first dimension is statically equal to `query_length` and differs from
    `batch_size` (or the batch size is unknown); otherwise as `(B, T_k)`.
    Pass a rank-3 mask `(1, T_q, T_k)` to remove any doubt.

    Statically known dimensions that cannot broadcast to
    `(batch_size, num_heads, query_length, key_length)` raise a ValueError
    naming the mask and its shape.
    """
    if mask is None:
        return None
    if isinstance(mask, (list, tuple)):
        mask = ops.convert_to_tensor(mask)
    _check_mask_dtype(name, mask)
    shape = tuple(mask.shape)
    rank = len(shape)
    if rank not in (2, 3, 4):
        raise ValueError(
            f"Received an invalid `{name}`: expected rank 2 `(B, T_k)` or "
            "`(T_q, T_k)`, rank 3 `(B, T_q, T_k)` or rank 4 `(B, H, T_q, T_k)`. "
            f"Received: {name}.shape={shape}"
        )
    mask = _as_bool(mask)
    if rank == 4:
        full = shape
    elif rank == 3:
        mask = _expand_bool(mask, (1,))
        full = (shape[0], 1, shape[1], shape[2])
    else:
        first = shape[0]
        is_query_by_key = (
            first is not None
            and query_length is not None
            and first == query_length
            and (batch_size is None or batch_size != first)
        )
        if is_query_by_key:
            mask = _expand_bool(mask, (0, 1))
            full = (1, 1, shape[0], shape[1])
        else:
            mask = _expand_bool(mask, (1, 2))
            full = (shape[0], 1, 1, shape[1])
    expected = (batch_size, num_heads, query_length, key_length)
    for got, want in zip(full, expected):
        if got is None or want is None or got == 1 or got == want:
            continue
        raise ValueError(
            f"Received an invalid `{name}` shape: {shape} does not broadcast to "
            f"(batch={batch_size}, heads={num_heads}, T_q={query_length}, "
            f"T_k={key_length}). Expected one of (B, T_k), (T_q, T_k), "
            "(B, T_q, T_k) or (B, H, T_q, T_k)."
        )
    return mask
