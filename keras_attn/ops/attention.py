"""The attention core: scores, masking, softmax and the weighted sum.

Every layer in keras_attn goes through `attend_from_logits` (directly, or via
`dot_product_attention`), so masking and numerics cannot differ between code
paths: with or without dropout, with or without returned scores.

Tensors use the layout `(batch, seq, heads, head_dim)`.
"""

import math

import keras
from keras import ops

from keras_attn.ops import chunked
from keras_attn.ops import masking

_LOW_PRECISION = ("float16", "bfloat16")


def _dyn_dim(x, axis):
    dim = x.shape[axis]
    return dim if dim is not None else ops.shape(x)[axis]


def _check_rank(name, x, rank):
    if len(x.shape) != rank:
        raise ValueError(
            f"Expected `{name}` of rank {rank} (batch, seq, heads, head_dim). "
            f"Received: {name}.shape={tuple(x.shape)}"
        )


def check_dropout(name, rate):
    """Validates a dropout rate: a finite float in [0, 1)."""
    if isinstance(rate, bool) or not isinstance(rate, (int, float)):
        raise TypeError(
            f"Received an invalid value for argument `{name}`, expected a float "
            f"in [0, 1). Received: {name}={rate!r}"
        )
    if not (math.isfinite(rate) and 0.0 <= rate < 1.0):
        raise ValueError(
            f"Received an invalid value for argument `{name}`, expected a float "
            f"in [0, 1). Received: {name}={rate!r}"
        )
    return float(rate)


def attend_from_logits(
    logits,
    value,
    *,
    mask=None,
    bias=None,
    dropout_rate=0.0,
    training=False,
    seed=None,
    return_attention_scores=False,
    every_row_sees_a_key=False,
):
    """Masked softmax over keys and the weighted sum of values.

    Args:
        logits: `(B, H, T_q, T_k)` attention logits, any float dtype; the
            softmax runs in float32.
        value: `(B, T_k, H_kv, D_v)`; `H` must be a multiple of `H_kv`
            (grouped-query attention without repeating `value`).
        mask: boolean, broadcastable to `(B, H, T_q, T_k)`; True = attend.
        bias: additive, broadcastable to `(B, H, T_q, T_k)`.
        every_row_sees_a_key: the caller guarantees that no query row is
            fully masked (e.g. a plain causal mask: key 0 is always visible),
            so the pass that zeroes such rows is skipped.

    Returns:
        `(B, T_q, H, D_v)` in `value`'s dtype, and the `(B, H, T_q, T_k)`
        probabilities when `return_attention_scores`. Query rows with no
        visible key give zeros (outputs, scores and gradients).
    """
    logits = ops.cast(logits, "float32")
    if bias is not None:
        logits = logits + ops.cast(bias, "float32")
    row_visible = None
    if mask is not None:
        mask = masking._as_bool(mask)
        if not every_row_sees_a_key:
            row_visible = _rows_with_a_key(mask)
    return _attend(
        logits,
        value,
        mask=mask,
        row_visible=row_visible,
        dropout_rate=dropout_rate,
        training=training,
        seed=seed,
        return_attention_scores=return_attention_scores,
    )


def _rows_with_a_key(mask):
    """`(B|1, H|1, T_q|1, 1)`: does the query row see at least one key?"""
    return ops.any(mask, axis=-1, keepdims=True)


def _attend(
    logits,
    value,
    *,
    mask,
    row_visible,
    dropout_rate,
    training,
    seed,
    return_attention_scores,
):
    """`attend_from_logits` after the bias: float32 `logits`, boolean `mask`
    (applied here with a `where`, or None when already folded into the
    logits) and `row_visible` (None when every row sees a key)."""
    out_dtype = value.dtype
    _check_static_heads(logits, value)
    dropout_active = training and dropout_rate > 0.0
    if not return_attention_scores and not dropout_active and _HAS_CUSTOM_GRADIENT:
        output = _softmax_weighted_sum(logits, value, mask)
    else:
        probs = _masked_softmax(logits, mask)
        if row_visible is not None and return_attention_scores:
            probs = probs * ops.cast(row_visible, probs.dtype)
        weights = probs
        if dropout_active:
            weights = keras.random.dropout(weights, dropout_rate, seed=seed)
        output = _weighted_sum(ops.cast(weights, out_dtype), value)
    if row_visible is not None:
        # (B|1, T_q|1, H|1, 1): zero the rows that see no key. O(T) work,
        # instead of another pass over the (T_q, T_k) probabilities.
        visible = ops.transpose(row_visible, (0, 2, 1, 3))
        output = output * ops.cast(visible, output.dtype)
    if return_attention_scores:
        return output, ops.cast(probs, out_dtype)
    return output


# The hand-written gradient is used (and tested) on TensorFlow; other backends
# differentiate the plain path.
_HAS_CUSTOM_GRADIENT = keras.backend.backend() == "tensorflow"


def _check_static_heads(logits, value):
    if logits.shape[1] is None or value.shape[2] is None:
        raise ValueError(
            "The number of heads must be static. Received logits.shape="
            f"{tuple(logits.shape)}, value.shape={tuple(value.shape)}"
        )


def _masked_softmax(logits, mask):
    """float32 softmax over the last axis; masked logits never leak through."""
    if mask is not None:
        # Masked logits are replaced, not offset, so very large logits and
        # biases can never leak through the mask.
        logits = ops.where(mask, logits, ops.cast(masking.MASKED_LOGIT, "float32"))
    if logits.shape[-1] == 1:
        # One key: the softmax is exactly 1 (and Keras warns about it).
        return ops.ones_like(logits)
    return ops.softmax(logits, axis=-1)


def _grouped(x, num_kv_heads, head_axis):
    """Splits the head axis `H` of `x` into `(H_kv, H // H_kv)`."""
    shape = [_dyn_dim(x, a) for a in range(len(x.shape))]
    heads = shape[head_axis]
    shape[head_axis : head_axis + 1] = [num_kv_heads, heads // num_kv_heads]
    return ops.reshape(x, shape)


def _merge_groups(x, head_axis):
    """Inverse of `_grouped`: merges axes `head_axis` and `head_axis + 1`."""
    shape = [_dyn_dim(x, a) for a in range(len(x.shape))]
    shape[head_axis : head_axis + 2] = [shape[head_axis] * shape[head_axis + 1]]
    return ops.reshape(x, shape)


def _weighted_sum(weights, value):
    """`(B, H, T_q, T_k) x (B, T_k, H_kv, D) -> (B, T_q, H, D)`, H_kv | H."""
    num_kv_heads = value.shape[2]
    if weights.shape[1] == num_kv_heads:
        return ops.einsum("bhqk,bkhd->bqhd", weights, value)
    w5 = _grouped(weights, num_kv_heads, 1)
    return _merge_groups(ops.einsum("bngqk,bknd->bqngd", w5, value), 2)


def _softmax_weighted_sum(logits, value, mask):
    """`softmax(where(mask, logits)) @ value` with a hand-written gradient.

    The same numbers as `_masked_softmax` + `_weighted_sum`, but the backward
    pass makes fewer passes over `(B, H, T_q, T_k)` tensors than automatic
    differentiation: `d_logits = P * (dP - rowsum(dO * O))` (the
    FlashAttention identity: the row sum is taken over the `(T_q, D)` output,
    not over the `(T_q, T_k)` probabilities), and the mask costs nothing in
    the backward pass (masked probabilities are 0, so are their gradients).
    """
    out_dtype = value.dtype
    num_kv_heads = value.shape[2]
    grouped = logits.shape[1] != num_kv_heads

    def run(logits, value):
        probs = _masked_softmax(logits, mask)
        output = _weighted_sum(ops.cast(probs, out_dtype), value)

        def grad(*args, upstream=None):
            if upstream is None:
                (upstream,) = args
            d_out = ops.cast(upstream, "float32")
            v = ops.cast(value, "float32")
            # (B, T_q, H, 1) -> (B, H, T_q, 1): rowsum(dO * O), O(T D) work.
            row = ops.sum(d_out * ops.cast(output, "float32"), axis=-1, keepdims=True)
            row = ops.transpose(row, (0, 2, 1, 3))
            if not grouped:
                d_probs = ops.einsum("bqhd,bkhd->bhqk", d_out, v)
                d_value = ops.einsum("bhqk,bqhd->bkhd", probs, d_out)
            else:
                d_out5 = _grouped(d_out, num_kv_heads, 2)
                d_probs = _merge_groups(ops.einsum("bqngd,bknd->bngqk", d_out5, v), 1)
                d_value = ops.einsum(
                    "bngqk,bqngd->bknd", _grouped(probs, num_kv_heads, 1), d_out5
                )
            d_logits = probs * (d_probs - row)
            return d_logits, ops.cast(d_value, value.dtype)

        return output, grad

    return ops.custom_gradient(run)(logits, value)


def _select_chunk_size(chunk_size, query, key, return_attention_scores, dropout_active):
    """`(q_chunk, k_chunk)` when the blocked path is used, else None."""
    if chunk_size is not None and not isinstance(chunk_size, bool) and chunk_size == 0:
        return None
    chunks = chunked.check_chunk_size(chunk_size)
    if chunks is not None:
        if return_attention_scores or dropout_active:
            raise ValueError(
                "The blocked attention path (`chunk_size`) never builds the full "
                "score matrix, so it supports neither `return_attention_scores` "
                "nor dropout on the probabilities in training. Received: "
                f"chunk_size={chunk_size!r}, return_attention_scores="
                f"{return_attention_scores}, dropout active={dropout_active}"
            )
        return chunks
    t_q, t_k = query.shape[1], key.shape[1]
    if (
        t_q is not None
        and t_k is not None
        and t_q * t_k > chunked.AUTO_CHUNK_MIN_SCORES
        and not return_attention_scores
        and not dropout_active
    ):
        return (chunked.DEFAULT_CHUNK_SIZE,) * 2
    return None


def check_bias(bias, scores_shape, name="bias"):
    """A bias must broadcast to `(B, H, T_q, T_k)`: checked on its static shape,
    so that no path (the blocked one pads its inputs) silently misreads it.
    Returns it as a tensor (or None)."""
    if bias is None:
        return None
    if not hasattr(bias, "shape"):
        bias = ops.convert_to_tensor(bias)
    shape = tuple(bias.shape)
    if len(shape) > 4 or any(
        got is not None and want is not None and got not in (1, want)
        for got, want in zip(reversed(shape), reversed(scores_shape))
    ):
        batch, heads, t_q, t_k = scores_shape
        raise ValueError(
            f"Received an invalid `{name}` shape: {shape} does not broadcast to "
            f"(batch={batch}, heads={heads}, T_q={t_q}, T_k={t_k}). Expected at "
            "most rank 4, each axis 1 or equal to the attention's."
        )
    return bias


def _check_start_index(start_index):
    if isinstance(start_index, bool) or (isinstance(start_index, int) and start_index < 0):
        raise ValueError(
            "Received an invalid value for argument `start_index`, expected a "
            f"non-negative integer. Received: start_index={start_index!r}"
        )


def dot_product_attention(
    query,
    key,
    value,
    *,
    attention_mask=None,
    bias=None,
    is_causal=False,
    scale=None,
    dropout_rate=0.0,
    training=False,
    return_attention_scores=False,
    seed=None,
    start_index=0,
    sliding_window=None,
    chunk_size=None,
):
    """Scaled dot-product attention, `softmax(q k^T * scale + bias) v`.

    Args:
        query: `(B, T_q, H, D)`.
        key: `(B, T_k, H_kv, D)`; `H` must be a multiple of `H_kv`
            (grouped-query / multi-query attention, computed without
            repeating `key` or `value`).
        value: `(B, T_k, H_kv, D_v)`.
        attention_mask: boolean (True = attend), shaped `(B, T_k)`,
            `(T_q, T_k)`, `(B, T_q, T_k)` or `(B, H, T_q, T_k)`.
        bias: additive logits bias broadcastable to `(B, H, T_q, T_k)`
            (ALiBi, relative positions).
        is_causal: also apply a causal mask; query `i` sees keys
            `j <= i + start_index`.
        scale: multiplier of the logits; None means `1 / sqrt(D)`. It is
            applied to `query` (O(T D) work), not to the `(T_q, T_k)` logits.
        dropout_rate: dropout on the attention probabilities when `training`.
        training: whether dropout is active.
        return_attention_scores: also return the `(B, H, T_q, T_k)` scores.
        seed: a `keras.random.SeedGenerator` or int for dropout.
        start_index: absolute position of the first query (cached decoding).
        sliding_window: if set with `is_causal`, keys older than this many
            positions are hidden too.
        chunk_size: compute exact attention in `O(T)` memory, blocked over
            queries and keys (`keras_attn.ops.chunked`): an int, or a pair
            `(q_chunk, k_chunk)`, the forward pass's block sizes (they bound
            the memory; the backward pass uses blocks of at most
            `chunked.BACKWARD_MAX_CHUNK` = 512, its fastest). None picks the
            blocked path by itself, with `chunked.DEFAULT_CHUNK_SIZE` (1024)
            blocks, when the static `T_q * T_k` exceeds
            `chunked.AUTO_CHUNK_MIN_SCORES` (4096 x 4096) and neither dropout
            (in training) nor `return_attention_scores` asks for the full
            score matrix; `0` forces the unblocked path.

    Returns:
        `(B, T_q, H, D_v)`, and the scores when `return_attention_scores`.
        Logits and softmax are computed in float32 whatever the input dtype,
        and fully masked query rows give zeros, never NaN.

    Example:

    >>> import numpy as np
    >>> q = np.random.rand(2, 5, 4, 8).astype("float32")
    >>> out = dot_product_attention(q, q, q, is_causal=True)
    >>> tuple(out.shape)
    (2, 5, 4, 8)
    """
    # NumPy inputs as tensors: on torch, `ndarray * Tensor` is an error.
    query, key, value = (ops.convert_to_tensor(x) for x in (query, key, value))
    for name, x in (("query", query), ("key", key), ("value", value)):
        _check_rank(name, x, 4)
    dropout_rate = check_dropout("dropout_rate", dropout_rate)
    q_heads, k_heads, v_heads = query.shape[2], key.shape[2], value.shape[2]
    if k_heads != v_heads or q_heads % k_heads:
        raise ValueError(
            "`key` and `value` must have the same number of heads, and the "
            "number of query heads must be a multiple of it. Received: "
            f"query.shape={tuple(query.shape)}, key.shape={tuple(key.shape)}, "
            f"value.shape={tuple(value.shape)}"
        )
    if query.shape[-1] != key.shape[-1]:
        raise ValueError(
            "`query` and `key` must have the same head size (last axis). "
            f"Received: query.shape={tuple(query.shape)}, key.shape={tuple(key.shape)}"
        )
    tk_key, tk_value = key.shape[1], value.shape[1]
    if tk_key is not None and tk_value is not None and tk_key != tk_value:
        raise ValueError(
            "`key` and `value` must have the same sequence length. Received: "
            f"key.shape={tuple(key.shape)}, value.shape={tuple(value.shape)}"
        )

    _check_start_index(start_index)
    scores_shape = (query.shape[0], q_heads, query.shape[1], key.shape[1])
    bias = check_bias(bias, scores_shape)
    mask = masking.normalize_attention_mask(
        attention_mask,
        batch_size=scores_shape[0],
        num_heads=q_heads,
        query_length=scores_shape[2],
        key_length=scores_shape[3],
    )
    chunks = _select_chunk_size(
        chunk_size, query, key, return_attention_scores, training and dropout_rate > 0.0
    )
    if chunks is not None:
        # Head groups pay off even more here: one (B, H, 1024, 1024) block of
        # scores per step is 32 MiB at B=1, H=8 (benchmarks/README.md).
        blocks_shape = (
            scores_shape[0], q_heads,
            None if scores_shape[2] is None else min(chunks[0], scores_shape[2]),
            None if scores_shape[3] is None else min(chunks[1], scores_shape[3]),
        )
        return _in_head_groups(
            lambda q, k, v, m, b: chunked.chunked_dot_product_attention(
                q, k, v, attention_mask=m, bias=b, is_causal=is_causal, scale=scale,
                start_index=start_index, sliding_window=sliding_window, chunk_size=chunks,
            ),
            head_groups(blocks_shape, k_heads), query, key, value, mask, bias,
        )

    if is_causal:
        causal = masking.causal_mask(
            _dyn_dim(query, 1), _dyn_dim(key, 1), start_index=start_index,
            sliding_window=sliding_window,
        )
        mask = masking.combine_masks(mask, masking._expand_bool(causal, (0, 1)))
    common = dict(
        # A causal mask alone always leaves key 0 visible (start_index >= 0).
        every_row_sees_a_key=is_causal and attention_mask is None and sliding_window is None,
        scale=scale,
        dropout_rate=dropout_rate,
        training=training,
        seed=seed,
        return_attention_scores=return_attention_scores,
    )
    return _in_head_groups(
        lambda q, k, v, m, b: _dense_attention(q, k, v, m, b, **common),
        head_groups(scores_shape, k_heads, dropout_active=training and dropout_rate > 0.0),
        query, key, value, mask, bias,
        return_attention_scores=return_attention_scores,
    )


def _in_head_groups(attend, groups, query, key, value, mask, bias, return_attention_scores=False):
    """`attend(query, key, value, mask, bias)` computed in `groups`
    independent groups of heads (benchmarks/README.md): each group's score
    tensors are a fraction of the whole, and the groups are independent ops
    that TensorFlow runs side by side. Contiguous groups of query heads keep
    their key/value heads (grouped-query attention)."""
    if groups == 1:
        return attend(query, key, value, mask, bias)
    parts = zip(
        ops.split(query, groups, axis=2),
        ops.split(key, groups, axis=2),
        ops.split(value, groups, axis=2),
        _split_heads(mask, groups),
        _split_heads(bias, groups),
    )
    results = [attend(*part) for part in parts]
    if return_attention_scores:
        return (
            ops.concatenate([r[0] for r in results], axis=2),
            ops.concatenate([r[1] for r in results], axis=1),
        )
    return ops.concatenate(results, axis=2)


# Head groups: attention runs in groups of heads when the `(B, H, T_q, T_k)`
# float32 scores are at least `GROUP_MIN_SCORE_BYTES`, with groups of about
# `GROUP_SCORE_BYTES` each (an unknown batch size counts as 1). Measured in
# benchmarks/README.md.
GROUP_MIN_SCORE_BYTES = 2**20
GROUP_SCORE_BYTES = 2**21


def head_groups(scores_shape, num_kv_heads, dropout_active=False):
    """How many head groups attention is computed in separately (1 = none).

    `scores_shape` is `(batch, heads, query length, key length)` of one score
    tensor: the whole one on the unblocked path, one block on the blocked
    path (where each group then runs its own blocked loop).

    A divisor of the key/value heads (so each group keeps its own key/value
    heads), at least 2 once the score tensors reach `GROUP_MIN_SCORE_BYTES`,
    more for large ones. Only for static lengths: graphs traced with unknown
    lengths (such as serving signatures) keep one group, since LiteRT's
    reference int8 kernels abort on the grouped graph of a fully quantized
    model (XNNPACK runs it; tests/test_quantized_accuracy.py). Not with
    dropout in training (the groups would draw other masks than one call).
    """
    batch, heads, t_q, t_k = scores_shape
    if dropout_active or num_kv_heads is None or num_kv_heads < 2 or None in (t_q, t_k):
        return 1
    size = 4 * (batch or 1) * heads * t_q * t_k
    if size < GROUP_MIN_SCORE_BYTES:
        return 1
    wanted = max(2, -(-size // GROUP_SCORE_BYTES))
    divisors = [n for n in range(2, num_kv_heads + 1) if num_kv_heads % n == 0]
    return next((n for n in divisors if n >= wanted), divisors[-1])


def _split_heads(x, groups):
    """`x` (rank 4, heads on axis 1, or None) split into `groups` along the
    heads; a tensor broadcast over heads is shared by every group."""
    if x is None:
        return [x] * groups
    while len(x.shape) < 4:
        x = ops.expand_dims(x, 0)
    if x.shape[1] == 1:
        return [x] * groups
    return ops.split(x, groups, axis=1)


def _dense_attention(
    query,
    key,
    value,
    mask,
    bias,
    *,
    every_row_sees_a_key,
    scale,
    dropout_rate,
    training,
    seed,
    return_attention_scores,
):
    """The unblocked path of `dot_product_attention` for validated inputs:
    `mask` rank 4 (causal part included) or None, `bias` checked."""
    q_heads, k_heads = query.shape[2], key.shape[2]

    head_dim = query.shape[-1]
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    q = ops.cast(query, "float32") if query.dtype in _LOW_PRECISION else query
    k = ops.cast(key, "float32") if key.dtype in _LOW_PRECISION else key
    common = dict(
        dropout_rate=dropout_rate,
        training=training,
        seed=seed,
        return_attention_scores=return_attention_scores,
    )

    if (
        mask is not None
        and bias is None
        and q_heads == k_heads
        and mask.shape[1] == 1
        and mask.shape[2] == 1
        and q.dtype == "float32"
    ):
        # A key-only mask `(B|1, 1, 1, T_k)` (padding), as an additive bias:
        # `(q * 2 scale) k^T * 0.5 + bias`. oneDNN (TensorFlow's default CPU
        # kernels) fuses the batch matmul, the scalar multiply and the add
        # into one kernel, so masking costs no pass over the `(B, H, T_q, T_k)`
        # logits (a `where` costs one). Only key-only masks: with a
        # `(1, 1, T_q, T_k)` addend (a causal mask) the fused kernel was 100x
        # slower than `where` (benchmarks/README.md). Scaling by powers of two is exact, so the
        # logits are bit-identical to `(q * scale) k^T`, and the matmul output
        # only needs twice the final logit's range (scaling after the matmul
        # would need `1 / scale` times it).
        row_visible = None if every_row_sees_a_key else _rows_with_a_key(mask)
        logits = ops.einsum("bqhd,bkhd->bhqk", q * ops.cast(2.0 * scale, q.dtype), k) * 0.5
        logits = logits + masking.mask_to_bias(mask, row_visible)
        return _attend(logits, value, mask=None, row_visible=row_visible, **common)

    if scale != 1.0:
        q = q * ops.cast(scale, q.dtype)
    if q_heads == k_heads:
        logits = ops.einsum("bqhd,bkhd->bhqk", q, k)
    else:
        logits = _merge_groups(ops.einsum("bqngd,bknd->bngqk", _grouped(q, k_heads, 2), k), 1)
    return attend_from_logits(
        logits, value, mask=mask, bias=bias, every_row_sees_a_key=every_row_sees_a_key, **common
    )


def additive_attention(
    query_projection,
    key_projection,
    value,
    score_weight,
    *,
    attention_mask=None,
    dropout_rate=0.0,
    training=False,
    return_attention_scores=False,
    seed=None,
):
    """Bahdanau attention, `softmax(v^T tanh(W_q q + W_k k)) value`.

    Args:
        query_projection: `(B, T_q, U)`, the already projected `W_q q (+ b)`.
        key_projection: `(B, T_k, U)`, the already projected `W_k k`.
        value: `(B, T_k, D_v)`.
        score_weight: `(U,)`, the vector `v`.
        attention_mask: boolean, broadcastable to `(B, T_q, T_k)` (or any
            shape accepted by `dot_product_attention`).

    Returns:
        `(B, T_q, D_v)` and, when asked, the `(B, T_q, T_k)` scores. At most a
        `(B, T_q, T_k, U)` tensor is materialised.
    """
    q = ops.cast(query_projection, "float32")
    k = ops.cast(key_projection, "float32")
    # (B, T_q, T_k, U) is the largest tensor materialised.
    # expand_dims, not None-indexing: the latter lowers to a StridedSlice
    # with new_axis_mask that TFLite can only run with Flex.
    hidden = ops.tanh(ops.expand_dims(q, 2) + ops.expand_dims(k, 1))
    logits = ops.einsum("bqku,u->bqk", hidden, ops.cast(score_weight, "float32"))
    mask = masking.normalize_attention_mask(
        attention_mask, batch_size=q.shape[0], query_length=q.shape[1]
    )
    result = attend_from_logits(
        ops.expand_dims(logits, 1),
        ops.expand_dims(value, 2),
        mask=mask,
        dropout_rate=check_dropout("dropout_rate", dropout_rate),
        training=training,
        seed=seed,
        return_attention_scores=return_attention_scores,
    )
    if return_attention_scores:
        output, scores = result
        return output[:, :, 0, :], scores[:, 0]
    return result[:, :, 0, :]
