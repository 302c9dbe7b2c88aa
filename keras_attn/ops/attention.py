"""The attention API: `dot_product_attention`, `additive_attention`,
`attend_from_logits`.

`dot_product_attention` validates its inputs, brings the masks to rank 4,
asks `keras_attn.ops.dispatch.select_kernel` which kernel runs and runs it:
`reference` (keras_attn.ops.reference), `tf_cpu` (keras_attn.ops.tf_kernels),
`blocked` (keras_attn.ops.chunked) or `keras` (`keras.ops.dot_product_attention`).

Tensors use the layout `(batch, seq, heads, head_dim)`.
"""

import math

from keras import ops

from keras_attn import checks
from keras_attn.ops import chunked
from keras_attn.ops import dispatch
from keras_attn.ops import masking
from keras_attn.ops import reference
from keras_attn.ops import shapes
from keras_attn.ops import tf_kernels


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
    fused = tf_kernels.softmax_weighted_sum if dispatch.select_kernel().cpu_kernels else None
    return reference.attend_with_bias(
        ops.cast(logits, "float32"),
        value,
        mask=None if mask is None else masking.as_bool(mask),
        bias=bias,
        every_row_sees_a_key=every_row_sees_a_key,
        dropout_rate=dropout_rate,
        training=training,
        seed=seed,
        return_attention_scores=return_attention_scores,
        softmax_weighted_sum=fused,
    )


def _plan(query, key, value, *, chunk_size, dropout_rate, training, return_attention_scores,
          flash_attention=None, logit_soft_cap=None):
    """Validates the call's sizes and options; returns `(plan, chunks, dropout_rate)`."""
    checks.check_heads_and_sizes(query, key, value)
    dropout_rate = checks.check_dropout("dropout_rate", dropout_rate)
    dropout_active = bool(training) and dropout_rate > 0.0
    chunks = checks.check_chunk_size(chunk_size)
    if isinstance(chunks, tuple) and (return_attention_scores or dropout_active):
        raise ValueError(
            "The blocked attention path (`chunk_size`) never builds the full "
            "score matrix, so it supports neither `return_attention_scores` "
            "nor dropout on the probabilities in training. Received: "
            f"chunk_size={chunk_size!r}, return_attention_scores="
            f"{return_attention_scores}, dropout active={dropout_active}"
        )
    if isinstance(chunks, tuple) and logit_soft_cap is not None:
        raise ValueError(
            "The blocked attention path (`chunk_size`) does not soft-cap logits. Pass "
            "chunk_size=None or 0 with `logit_soft_cap`. Received: chunk_size="
            f"{chunk_size!r}, logit_soft_cap={logit_soft_cap!r}"
        )
    if flash_attention and logit_soft_cap is not None:
        raise ValueError(
            "Flash attention does not soft-cap logits. Received: flash_attention="
            f"{flash_attention!r}, logit_soft_cap={logit_soft_cap!r}"
        )
    plan = dispatch.select_kernel(
        query_length=query.shape[1],
        key_length=key.shape[1],
        chunk_size=chunks,
        dropout_active=dropout_active,
        return_attention_scores=return_attention_scores,
        flash_attention=flash_attention,
        logit_soft_cap=logit_soft_cap,
    )
    if plan.attention == "blocked" and not isinstance(chunks, tuple):
        chunks = (dispatch.DEFAULT_CHUNK_SIZE,) * 2
    return plan, chunks, dropout_rate


def explain_kernel(
    query,
    key,
    value,
    *,
    chunk_size=None,
    dropout_rate=0.0,
    training=False,
    return_attention_scores=False,
    logit_soft_cap=None,
    **unused,
):
    """The name of the kernel `dot_product_attention` would run for these
    arguments (under the current `keras_attn.config` settings), without
    running it: `"reference"`, `"tf_cpu"`, `"blocked"` or `"keras"`.

    Example:

    >>> import numpy as np
    >>> import keras_attn
    >>> q = np.zeros((1, 8, 2, 4), "float32")
    >>> with keras_attn.config.attention_implementation("reference"):
    ...     explain_kernel(q, q, q)
    'reference'
    """
    del unused
    return _plan(
        query, key, value, chunk_size=chunk_size, dropout_rate=dropout_rate,
        training=training, return_attention_scores=return_attention_scores,
        logit_soft_cap=checks.check_soft_cap("logit_soft_cap", logit_soft_cap),
    )[0].attention


def dot_product_attention(
    query,
    key,
    value,
    *,
    attention_mask=None,
    key_padding_mask=None,
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
    flash_attention=None,
    logit_soft_cap=None,
):
    """Scaled dot-product attention, `softmax(q k^T * scale + bias) v`.

    Args:
        query: `(B, T_q, H, D)`.
        key: `(B, T_k, H_kv, D)`; `H` must be a multiple of `H_kv`
            (grouped-query / multi-query attention, computed without
            repeating `key` or `value`).
        value: `(B, T_k, H_kv, D_v)`.
        attention_mask: boolean (True = attend), broadcastable to
            `(B, H, T_q, T_k)` by the usual right-aligned rule, as in
            `keras.ops.dot_product_attention` and PyTorch SDPA: `(T_q, T_k)`,
            `(B, 1, T_q, T_k)`, `(B, H, T_q, T_k)`... Or a
            `keras_attn.ops.AttentionMask` (what the layers pass: the whole
            mask of the call, band and padded query rows included), taken as
            it is; `key_padding_mask`, `is_causal`, `start_index` and
            `sliding_window` are then left at their defaults.
        key_padding_mask: boolean `(B, T_k)`, True for the keys to attend to.
        bias: additive logits bias broadcastable to `(B, H, T_q, T_k)`
            (ALiBi, relative positions).
        is_causal: also apply a causal mask; query `i` sees keys
            `j <= i + start_index`.
        scale: multiplier of the logits; None means `1 / sqrt(D)`.
        dropout_rate: dropout on the attention probabilities when `training`.
        training: whether dropout is active.
        return_attention_scores: also return the `(B, H, T_q, T_k)` scores.
        seed: a `keras.random.SeedGenerator` or int for dropout.
        start_index: absolute position of the first query (cached decoding).
        sliding_window: query `i` sees only keys with
            `|i + start_index - j| < sliding_window` (a band); with
            `is_causal`, the last `sliding_window` keys. On the blocked path
            the band is built per block and blocks outside it are skipped.
        chunk_size: exact attention in `O(T)` memory, blocked over queries
            and keys (`keras_attn.ops.chunked`): an int or a pair
            `(q_chunk, k_chunk)` of forward block sizes. None lets
            `keras_attn.ops.dispatch.select_kernel` block long static
            sequences by itself; 0 never blocks.
        flash_attention: True runs `keras.ops.dot_product_attention(
            flash_attention=True)` (as `keras.layers.MultiHeadAttention`'s
            argument; an error where Keras has no flash kernel).
        logit_soft_cap: None, or a positive float `c`: the scaled logits
            become `c * tanh(logits / c)` before the bias and the mask
            (Gemma 2). Run by the `reference` and `tf_cpu` kernels
            (`select_kernel` sends capped calls there); not with an explicit
            `chunk_size` pair nor `flash_attention`.

    Which kernel runs: `keras_attn.ops.dispatch.select_kernel`, under the
    setting `keras_attn.config.set_attention_implementation`;
    `keras_attn.ops.last_kernel()` names the one that ran.

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
    logit_soft_cap = checks.check_soft_cap("logit_soft_cap", logit_soft_cap)
    plan, chunks, dropout_rate = _plan(
        query, key, value, chunk_size=chunk_size, dropout_rate=dropout_rate,
        training=training, return_attention_scores=return_attention_scores,
        flash_attention=flash_attention, logit_soft_cap=logit_soft_cap,
    )
    kernel = plan.attention
    scores_shape = (query.shape[0], query.shape[2], query.shape[1], key.shape[1])
    bias = checks.check_bias(bias, scores_shape)
    mask = _attention_mask(
        attention_mask, key_padding_mask, scores_shape, is_causal=is_causal,
        start_index=start_index, sliding_window=sliding_window,
    )
    if return_attention_scores:
        mask = mask.with_query_rows_in_mask()  # zero scores for padded query rows
    if scale is None:
        scale = 1.0 / math.sqrt(query.shape[-1])
    scale = float(scale)
    dispatch.record(kernel)

    common = dict(mask=mask, bias=bias, scale=scale)
    if kernel == "blocked":
        run = lambda q, k, v, m, b: chunked.chunked_dot_product_attention(  # noqa: E731
            q, k, v, mask=m, bias=b, scale=scale, chunk_size=chunks,
        )
        groups = 1
        if plan.cpu_kernels:
            blocks_shape = (
                scores_shape[0], scores_shape[1],
                None if scores_shape[2] is None else min(chunks[0], scores_shape[2]),
                None if scores_shape[3] is None else min(chunks[1], scores_shape[3]),
            )
            groups = tf_kernels.head_groups(blocks_shape, key.shape[2])
        result = tf_kernels.in_head_groups(run, groups, query, key, value, mask, bias)
    elif kernel == "keras":
        result = _keras_attention(query, key, value, flash=plan.flash, **common)
    else:
        attend = tf_kernels.tf_cpu_attention if kernel == "tf_cpu" else reference.reference_attention
        result = attend(
            query, key, value, logit_soft_cap=logit_soft_cap,
            dropout_rate=dropout_rate, training=training, seed=seed,
            return_attention_scores=return_attention_scores, **common,
        )
    # Padded query rows give zeros (with the scores, they are part of `mask`).
    return result if return_attention_scores else mask.zero_padded_rows(result)


def _attention_mask(attention_mask, key_padding_mask, scores_shape, *, is_causal, start_index,
                    sliding_window):
    """The call's `masking.AttentionMask`: taken as it is when given as one,
    else built from the mask arguments (validated)."""
    if isinstance(attention_mask, masking.AttentionMask):
        if key_padding_mask is not None or is_causal or sliding_window is not None or not (
            isinstance(start_index, int) and start_index == 0
        ):
            raise ValueError(
                "An `AttentionMask` carries the whole mask of the call: pass "
                "`key_padding_mask`, `is_causal`, `start_index` and `sliding_window` "
                "in it, not beside it. Received: key_padding_mask="
                f"{'None' if key_padding_mask is None else 'a mask'}, is_causal={is_causal!r}, "
                f"start_index={start_index!r}, sliding_window={sliding_window!r}"
            )
        return attention_mask
    checks.check_start_index(start_index)
    return masking.AttentionMask(
        mask=masking.combine_masks(
            masking.broadcast_attention_mask(attention_mask, scores_shape),
            masking.key_padding_mask_to_attention_mask(
                key_padding_mask, batch_size=scores_shape[0], key_length=scores_shape[3]
            ),
        ),
        is_causal=bool(is_causal),
        sliding_window=checks.check_sliding_window(sliding_window),
        start_index=start_index,
    )


def _keras_attention(query, key, value, *, mask, bias, scale, flash=None):
    """The `"keras"` kernel: `keras.ops.dot_product_attention` (cuDNN or
    flash attention where Keras has them), plus keras_attn's semantics: a
    float32 softmax for float32 inputs, and zeros for rows that see no key
    (Keras gives them uniform weights). `mask`: a `masking.AttentionMask`."""
    # Keras' own causal flag (what flash kernels want) means start_index 0
    # and T_q == T_k; other bands are built here.
    keras_causal = (
        mask.is_causal and mask.sliding_window is None
        and isinstance(mask.start_index, int) and mask.start_index == 0
        and query.shape[1] is not None and query.shape[1] == key.shape[1]
    )
    every_row_sees_a_key = mask.every_row_sees_a_key
    if keras_causal:
        mask = mask.mask
    else:
        mask = mask.logits_mask(shapes.dim(query, 1), shapes.dim(key, 1))
    groups = query.shape[2] // key.shape[2]
    if groups > 1 and (flash or key.shape[2] == 1):
        # Multi-query: Keras' TensorFlow version repeats key/value heads only
        # for more than one of them; its flash kernels take equal head counts.
        key = ops.repeat(key, groups, axis=2)
        value = ops.repeat(value, groups, axis=2)
    out = ops.dot_product_attention(
        query, key, value, bias=bias, mask=mask, scale=scale, is_causal=keras_causal,
        flash_attention=flash,
    )
    if mask is not None and not every_row_sees_a_key:
        visible = ops.transpose(reference.rows_with_a_key(mask), (0, 2, 1, 3))
        out = out * ops.cast(visible, out.dtype)
    return out


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
        dropout_rate=checks.check_dropout("dropout_rate", dropout_rate),
        training=training,
        seed=seed,
        return_attention_scores=return_attention_scores,
    )
    if return_attention_scores:
        output, scores = result
        return output[:, :, 0, :], scores[:, 0]
    return result[:, :, 0, :]
