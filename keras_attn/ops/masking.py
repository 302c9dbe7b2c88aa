"""Mask helpers shared by every attention layer.

All masks here are boolean: `True` means "may attend". Masks combine by
logical AND. Attention masks are normalised to rank 4, broadcastable to
`(batch, heads, T_q, T_k)`. One attention call's masks travel as one
`AttentionMask`: the boolean mask, the causal / sliding-window band as a
description (built by the kernel, `band`), and the padded query rows.

The causal and sliding-window masks are built from `arange` comparisons
(no `cumsum`/`tril`/strided slices), so they lower to TFLite builtin ops
and ONNX for any (dynamic) sequence length.
"""

from typing import NamedTuple

from keras import ops

from keras_attn.checks import check_mask_dtype


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


def as_bool(mask):
    """`mask` (bool, or a 0/1 integer or float mask) as a boolean tensor; None stays None."""
    if mask is None:
        return None
    if ops.dtype(mask) != "bool":
        mask = ops.cast(mask, "bool")
    return mask


def expand_bool(mask, axes):
    """`ops.expand_dims` for boolean masks (use it rather than `None`-indexing).

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
        q = as_bool(query_mask)
        masks.append(expand_bool(q, (1, 3)))
    for kv in (value_mask, key_mask):
        if kv is not None:
            masks.append(expand_bool(as_bool(kv), (1, 2)))
    return combine_masks(*masks)


def band(query_positions, key_positions, *, is_causal=False, sliding_window=None):
    """The causal / sliding-window band between positions, or None.

    The one place these masks are written: the layers' masks, the cache's
    masks and the blocked kernel's per-block masks all come from here.

    Args:
        query_positions: int `(..., T_q)`, the absolute position of each query.
        key_positions: int `(..., T_k)`, the absolute position of each key.
        is_causal: query at position `p` sees keys at positions `<= p`.
        sliding_window: query at `p` sees keys at `k` with `|p - k| < window`
            (with `is_causal`, the last `window` positions).

    Returns:
        Boolean `(..., T_q, T_k)` (True = attend), or None when neither
        `is_causal` nor `sliding_window` is set.
    """
    if not is_causal and sliding_window is None:
        return None
    diff = ops.expand_dims(ops.cast(query_positions, "int32"), -1) - ops.expand_dims(
        ops.cast(key_positions, "int32"), -2
    )
    mask = ops.greater_equal(diff, 0) if is_causal else None
    if sliding_window is not None:
        near = ops.less(ops.abs(diff), sliding_window)
        mask = near if mask is None else ops.logical_and(mask, near)
    return mask


def mask_from_positions(query_positions, key_positions, *, is_causal=False, sliding_window=None,
                        query_valid=None, key_valid=None, attention_mask=None):
    """One boolean `(B|1, H|1, T_q, T_k)` attention mask from positions, or None.

    What the attention layers turn every mask source into: the band of
    `band` between `query_positions` `(T_q,)` and `key_positions` `(T_k,)`,
    the validity of each query row `(B, T_q)` and of each key `(B|1, T_k)`
    (padding, empty cache slots), and an explicit rank-4 `attention_mask`,
    combined by logical AND.
    """
    positional = band(query_positions, key_positions, is_causal=is_causal,
                      sliding_window=sliding_window)
    parts = [None if positional is None else expand_bool(positional, (0, 1))]
    if query_valid is not None:
        parts.append(expand_bool(as_bool(query_valid), (1, 3)))
    if key_valid is not None:
        parts.append(expand_bool(as_bool(key_valid), (1, 2)))
    parts.append(attention_mask)
    return combine_masks(*parts)


def _positions(length, start_index=0):
    return ops.arange(length, dtype="int32") + ops.cast(start_index, "int32")


def causal_mask(query_length, key_length=None, start_index=0, sliding_window=None):
    """Lower-triangular `(T_q, T_k)` mask: query `i` sees keys `j <= i + start_index`.

    `start_index` is the absolute position of the first query, as in cached
    decoding where the keys hold `start_index` earlier tokens. With
    `sliding_window=w`, the band of `sliding_window_mask` too: query `i`
    sees the last `w` keys `i + start_index - w < j <= i + start_index`.

    Example:

    >>> m = causal_mask(3)
    >>> m.numpy().astype(int).tolist()
    [[1, 0, 0], [1, 1, 0], [1, 1, 1]]
    """
    key_length = query_length if key_length is None else key_length
    return band(_positions(query_length, start_index), _positions(key_length),
                is_causal=True, sliding_window=sliding_window)


def sliding_window_mask(query_length, key_length=None, window=1, start_index=0):
    """Band `(T_q, T_k)`: query `i` sees key `j` when `|i + start_index - j| < window`.

    This is what `sliding_window` means everywhere in keras_attn (ops and
    layers, as Keras MHA): a symmetric band, which with a causal mask leaves
    the last `window` keys, as in the ring-buffer generation caches.
    """
    key_length = query_length if key_length is None else key_length
    return band(_positions(query_length, start_index), _positions(key_length),
                sliding_window=window)


def position_mask(query_length, key_length, *, is_causal=False, sliding_window=None,
                  start_index=0):
    """The `(1, 1, T_q, T_k)` causal and/or sliding-window mask, or None."""
    mask = band(_positions(query_length, start_index), _positions(key_length),
                is_causal=is_causal, sliding_window=sliding_window)
    return None if mask is None else expand_bool(mask, (0, 1))


def combine_masks(*masks):
    """Logical AND of broadcastable boolean masks; None entries are ignored.

    Returns None when every mask is None.
    """
    result = None
    for mask in masks:
        if mask is None:
            continue
        mask = as_bool(mask)
        result = mask if result is None else ops.logical_and(result, mask)
    return result


class AttentionMask(NamedTuple):
    """Every mask of one attention call, as one value that the kernels take.

    Built once where a call enters keras_attn (`MultiHeadAttention`'s
    `_attention_mask`, `keras_attn.layers`' `merge_attention_masks`, or
    `dot_product_attention` from its arguments) and handed down as it is.
    The causal / sliding-window band travels as a description, so that each
    kernel builds it where it is cheapest (`band`; the blocked kernel block
    by block, skipping the blocks outside it), and the padded query rows
    travel apart: a row mask only zeroes whole output rows, which leaves a
    key-only `mask` that the TensorFlow CPU kernel folds into the logits for
    free.

    Attributes:
        mask: boolean (True = attend), broadcastable to `(B, H, T_q, T_k)`
            at rank 4, or None: key padding, explicit masks, and a band
            between any other positions (a cache's keys). (For inputs of rank
            > 3 of `MultiHeadAttention`, Keras's N-D layout.)
        is_causal: query `i` sees keys `j <= i + start_index`.
        sliding_window: None, or query `i` sees keys
            `|i + start_index - j| < sliding_window`.
        start_index: the position of the first query; keys are at
            positions `0 .. T_k - 1`.
        query_valid: boolean `(B, T_q)` or None: the query rows that are not
            padding. The others give zero outputs (and zero scores).

    Example:

    >>> import numpy as np
    >>> m = AttentionMask(is_causal=True, query_valid=np.array([[True, True, False]]))
    >>> m.dense(3, 3).numpy().astype(int)[0, 0].tolist()
    [[1, 0, 0], [1, 1, 0], [0, 0, 0]]
    """

    mask: object = None
    is_causal: bool = False
    sliding_window: object = None
    start_index: object = 0
    query_valid: object = None

    @property
    def every_row_sees_a_key(self):
        """True when no query row can be fully masked by `logits_mask`: a
        causal band alone always leaves key 0 visible (`start_index >= 0`)."""
        return self.is_causal and self.mask is None and self.sliding_window is None

    def logits_mask(self, query_length, key_length):
        """`mask` and the band as one boolean `(B|1, H|1, T_q, T_k)`, or
        None: what a kernel applies to the logits (the padded query rows are
        zeroed on the output instead, `zero_padded_rows`)."""
        return combine_masks(self.mask, position_mask(
            query_length, key_length, is_causal=self.is_causal,
            sliding_window=self.sliding_window, start_index=self.start_index,
        ))

    def dense(self, query_length, key_length):
        """Every part, the padded query rows included, as one boolean
        `(B|1, H|1, T_q, T_k)`, or None (what Keras's `_compute_attention`
        and `keras_attn.visualize` take)."""
        return combine_masks(self.logits_mask(query_length, key_length), self._rows())

    def with_query_rows_in_mask(self):
        """The same mask with the padded query rows folded into `mask` (a
        kernel that returns the scores zeroes their rows there too)."""
        if self.query_valid is None:
            return self
        return self._replace(mask=combine_masks(self.mask, self._rows()), query_valid=None)

    def zero_padded_rows(self, output):
        """`output` `(B, T_q, H, D)` with the padded query rows set to zero."""
        if self.query_valid is None:
            return output
        return output * ops.cast(expand_bool(as_bool(self.query_valid), (2, 3)), output.dtype)

    def _rows(self):
        if self.query_valid is None:
            return None
        return expand_bool(as_bool(self.query_valid), (1, 3))


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


def _to_tensor(mask, name):
    if isinstance(mask, (list, tuple)):
        mask = ops.convert_to_tensor(mask)
    check_mask_dtype(name, mask)
    return mask


def _check_broadcast(name, shape, full, expected, accepted):
    batch_size, num_heads, query_length, key_length = expected
    for got, want in zip(full, expected):
        if got is None or want is None or got == 1 or got == want:
            continue
        raise ValueError(
            f"Received an invalid `{name}` shape: {shape} does not broadcast to "
            f"(batch={batch_size}, heads={num_heads}, T_q={query_length}, "
            f"T_k={key_length}). Expected {accepted}."
        )


def normalize_attention_mask(
    mask,
    batch_size=None,
    query_length=None,
    key_length=None,
    num_heads=None,
    name="attention_mask",
):
    """A layer's `attention_mask` (as Keras MHA) at rank 4 `(B|1, H|1, T_q|1, T_k)`.

    Accepted shapes: `(B, T_q, T_k)` (Keras' documented shape),
    `(B, H, T_q, T_k)`, and `(T_q, T_k)`, shared by the whole batch (as Keras
    MHA broadcasts it). A rank-2 mask is always `(T_q, T_k)`, whatever the
    batch size; key padding is a `(B, T_k)` `value_mask`/`key_mask` (or
    `key_padding_mask=` in `keras_attn.ops.dot_product_attention`).

    Statically known dimensions that cannot broadcast to
    `(batch_size, num_heads, query_length, key_length)` raise a ValueError
    naming the mask and its shape.
    """
    if mask is None:
        return None
    mask = _to_tensor(mask, name)
    shape = tuple(mask.shape)
    rank = len(shape)
    if rank not in (2, 3, 4):
        raise ValueError(
            f"Received an invalid `{name}`: expected rank 2 `(T_q, T_k)`, "
            "rank 3 `(B, T_q, T_k)` or rank 4 `(B, H, T_q, T_k)`. "
            f"Received: {name}.shape={shape}"
        )
    mask = as_bool(mask)
    if rank == 3:
        mask = expand_bool(mask, (1,))
    elif rank == 2:
        mask = expand_bool(mask, (0, 1))
    full = tuple(mask.shape)
    _check_broadcast(
        name, shape, full, (batch_size, num_heads, query_length, key_length),
        "one of (T_q, T_k), (B, T_q, T_k) or (B, H, T_q, T_k)",
    )
    return mask


def broadcast_attention_mask(mask, scores_shape, name="attention_mask"):
    """An ops-level mask at rank 4: right-aligned broadcasting against
    `scores_shape = (B, H, T_q, T_k)`, as `keras.ops.dot_product_attention`
    and PyTorch's `scaled_dot_product_attention` read it (rank 2 is
    `(T_q, T_k)`, rank 3 `(H, T_q, T_k)`). Checked on its static shape."""
    if mask is None:
        return None
    mask = _to_tensor(mask, name)
    shape = tuple(mask.shape)
    if not 1 <= len(shape) <= 4:
        raise ValueError(
            f"Received an invalid `{name}`: expected rank 1 to 4, broadcastable "
            f"to (B, H, T_q, T_k). Received: {name}.shape={shape}"
        )
    mask = as_bool(mask)
    if len(shape) < 4:
        mask = expand_bool(mask, tuple(range(4 - len(shape))))
    _check_broadcast(
        name, shape, tuple(mask.shape), tuple(scores_shape),
        "a shape broadcastable to (B, H, T_q, T_k) (for a (B, T_q, T_k) mask, "
        "add the head axis: expand_dims(mask, 1); for key padding, use "
        "`key_padding_mask`)",
    )
    return mask


def key_padding_mask_to_attention_mask(key_padding_mask, batch_size=None, key_length=None,
                                       name="key_padding_mask"):
    """A `(B, T_k)` key padding mask (True = a real key) as `(B, 1, 1, T_k)`."""
    if key_padding_mask is None:
        return None
    mask = _to_tensor(key_padding_mask, name)
    shape = tuple(mask.shape)
    if len(shape) != 2 or any(
        g is not None and w is not None and g not in (1, w)
        for g, w in zip(shape, (batch_size, key_length))
    ):
        raise ValueError(
            f"Received an invalid `{name}`: expected shape (batch, T_k) = "
            f"({batch_size}, {key_length}). Received: {name}.shape={shape}"
        )
    return expand_bool(as_bool(mask), (1, 2))
