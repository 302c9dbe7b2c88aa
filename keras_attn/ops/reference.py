"""The reference attention kernel, in plain `keras.ops`.

`logits = soft_cap((q * scale) k^T) + bias`, masked logits replaced, a float32 softmax,
the weighted sum of values; query rows that see no key give zeros (outputs,
scores and gradients). Every other kernel is tested against this one, and
`keras_attn.config.set_attention_implementation("reference")` runs it for
every call. The helpers here are shared by the other kernels.

Layout: query `(B, T_q, H, D)`, key and value `(B, T_k, H_kv, D)` with
`H_kv | H` (grouped-query attention without repeating keys or values),
masks and biases rank 4 `(B|1, H|1, T_q|1, T_k|1)`.
"""

import keras
from keras import ops

from keras_attn.ops import masking
from keras_attn.ops.shapes import dim

LOW_PRECISION = ("float16", "bfloat16")


def is_low_precision(x):
    """float16 / bfloat16, however the backend spells the dtype."""
    return keras.backend.standardize_dtype(x.dtype) in LOW_PRECISION


def rows_with_a_key(mask):
    """`(B|1, H|1, T_q|1, 1)`: does the query row see at least one key?"""
    return ops.any(mask, axis=-1, keepdims=True)


def masked_softmax(logits, mask):
    """float32 softmax over the last axis; masked logits never leak through."""
    if mask is not None:
        # Replaced, not offset: very large logits and biases cannot leak.
        logits = ops.where(mask, logits, ops.cast(masking.MASKED_LOGIT, "float32"))
    if logits.shape[-1] == 1:
        # One key: the softmax is exactly 1 (and Keras warns about it).
        return ops.ones_like(logits)
    return ops.softmax(logits, axis=-1)


def grouped(x, num_kv_heads, head_axis):
    """Splits the head axis `H` of `x` into `(H_kv, H // H_kv)`."""
    shape = [dim(x, a) for a in range(len(x.shape))]
    shape[head_axis : head_axis + 1] = [num_kv_heads, shape[head_axis] // num_kv_heads]
    return ops.reshape(x, shape)


def merge_groups(x, head_axis):
    """Inverse of `grouped`: merges axes `head_axis` and `head_axis + 1`."""
    shape = [dim(x, a) for a in range(len(x.shape))]
    shape[head_axis : head_axis + 2] = [shape[head_axis] * shape[head_axis + 1]]
    return ops.reshape(x, shape)


def logits(query, key, scale):
    """float32 `(B, H, T_q, T_k)` logits `(q * scale) k^T` (scaling `q`: O(T D) work)."""
    q, k = ops.convert_to_tensor(query), ops.convert_to_tensor(key)
    q = ops.cast(q, "float32") if is_low_precision(q) else q
    k = ops.cast(k, "float32") if is_low_precision(k) else k
    if scale != 1.0:
        q = q * ops.cast(scale, q.dtype)
    num_kv_heads = key.shape[2]
    if query.shape[2] == num_kv_heads:
        result = ops.einsum("bqhd,bkhd->bhqk", q, k)
    else:
        result = merge_groups(ops.einsum("bqngd,bknd->bngqk", grouped(q, num_kv_heads, 2), k), 1)
    return ops.cast(result, "float32")


def soft_cap(logits, cap):
    """`cap * tanh(logits / cap)` (Gemma 2's attention-logit soft-capping);
    `logits` unchanged when `cap` is None."""
    if cap is None:
        return logits
    cap = ops.cast(cap, logits.dtype)
    return ops.tanh(logits / cap) * cap


def weighted_sum(weights, value):
    """`(B, H, T_q, T_k) x (B, T_k, H_kv, D) -> (B, T_q, H, D)`, H_kv | H."""
    num_kv_heads = value.shape[2]
    if weights.shape[1] == num_kv_heads:
        return ops.einsum("bhqk,bkhd->bqhd", weights, value)
    w5 = grouped(weights, num_kv_heads, 1)
    return merge_groups(ops.einsum("bngqk,bknd->bqngd", w5, value), 2)


def check_static_heads(logits, value):
    if logits.shape[1] is None or value.shape[2] is None:
        raise ValueError(
            "The number of heads must be static. Received logits.shape="
            f"{tuple(logits.shape)}, value.shape={tuple(value.shape)}"
        )


def attend(
    logits,
    value,
    *,
    mask,
    row_visible,
    dropout_rate=0.0,
    training=False,
    seed=None,
    return_attention_scores=False,
    softmax_weighted_sum=None,
):
    """Softmax and weighted sum of float32 `logits` (bias included).

    `mask` is boolean or None (already folded into the logits), `row_visible`
    None when every row sees a key. `softmax_weighted_sum(logits, value, mask)`,
    if given, replaces the plain softmax and sum when neither dropout nor the
    scores are needed (a kernel's fused version with its own gradient).
    """
    out_dtype = value.dtype
    check_static_heads(logits, value)
    dropout_active = training and dropout_rate > 0.0
    if softmax_weighted_sum is not None and not return_attention_scores and not dropout_active:
        output = softmax_weighted_sum(logits, value, mask)
    else:
        probs = masked_softmax(logits, mask)
        if row_visible is not None and return_attention_scores:
            probs = probs * ops.cast(row_visible, probs.dtype)
        weights = probs
        if dropout_active:
            weights = keras.random.dropout(weights, dropout_rate, seed=seed)
        output = weighted_sum(ops.cast(weights, out_dtype), value)
    if row_visible is not None:
        # (B|1, T_q|1, H|1, 1): zero the rows that see no key, O(T) work.
        visible = ops.transpose(row_visible, (0, 2, 1, 3))
        output = output * ops.cast(visible, output.dtype)
    if return_attention_scores:
        return output, ops.cast(probs, out_dtype)
    return output


def reference_attention(
    query,
    key,
    value,
    *,
    mask,
    bias,
    scale,
    logit_soft_cap=None,
    dropout_rate=0.0,
    training=False,
    seed=None,
    return_attention_scores=False,
):
    """The reference kernel for validated inputs: `mask` a
    `masking.AttentionMask` (its band is built here; its padded query rows
    are zeroed by the caller, `dot_product_attention`); `bias` checked;
    `scale` a float; `logit_soft_cap` None or a float."""
    return attend_with_bias(
        soft_cap(logits(query, key, scale), logit_soft_cap),
        value,
        mask=mask.logits_mask(dim(query, 1), dim(key, 1)),
        bias=bias,
        every_row_sees_a_key=mask.every_row_sees_a_key,
        dropout_rate=dropout_rate,
        training=training,
        seed=seed,
        return_attention_scores=return_attention_scores,
    )


def attend_with_bias(scores, value, *, mask, bias, every_row_sees_a_key=False, **attend_kwargs):
    """`attend` after adding `bias` to the float32 `scores`; the rows that
    see a key are found from the boolean `mask` unless the caller vouches
    that every row does."""
    if bias is not None:
        scores = scores + ops.cast(bias, "float32")
    row_visible = None
    if mask is not None and not every_row_sees_a_key:
        row_visible = rows_with_a_key(mask)
    return attend(scores, value, mask=mask, row_visible=row_visible, **attend_kwargs)
