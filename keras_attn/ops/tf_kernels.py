"""Kernels that pay off on the TensorFlow backend, mostly on a CPU.

Everything here is an optimisation of `keras_attn.ops.reference` (same
numbers, tested against it in tests/ops/test_kernels.py); the measurements behind
each one are in benchmarks/README.md. `keras_attn.ops.dispatch.select_kernel`
decides when they run:

- the `"tf_cpu"` kernel (`tf_cpu_attention`), on TensorFlow on a CPU only:
  attention in independent head groups (`head_groups`), a key-padding mask
  folded into the logits as an additive bias, and a hand-written softmax +
  weighted-sum gradient (`softmax_weighted_sum`);
- `layer_norm`, the Transformer blocks' LayerNorm with a written-out
  backward pass, under the same condition (`dispatch.select_kernel().cpu_kernels`);
- `loop` and `sequential_map`, the blocked path's loops on TensorFlow (any
  device): one iteration in flight at a time, which bounds its memory;
- `after`, which holds a gradient function's rebuilt weights back until the
  upstream gradient exists.

Converter constraints (TFLite builtin ops only, tf2onnx), in one place:

- masks are built from `arange` comparisons and `expand_dims`, never
  `None`-indexing of a bool tensor (a `StridedSlice` with `new_axis_mask`
  that TFLite runs only with Flex), `cumsum`/`tril` or `isfinite`;
- `sequential_map` writes into a preallocated buffer instead of
  `tf.map_fn`'s TensorLists (builtin-only in TFLite only with a static
  element shape, and a serving signature's batch is dynamic);
- float `where`s keep both branches finite: tf2onnx lowers them to
  `c * a + (1 - c) * b`, and `0 * inf` is NaN;
- `head_groups` is 1 for graphs traced with unknown lengths (serving
  signatures): LiteRT's reference int8 kernels abort on the grouped graph of
  a fully quantized model (tests/export/test_quantized_accuracy.py).
"""

import keras
from keras import ops

from keras_attn.ops import masking
from keras_attn.ops import reference
from keras_attn.ops.shapes import dim

GROUP_MIN_SCORE_BYTES = 2**20
"""Attention runs in head groups once the float32 `(B, H, T_q, T_k)` scores
take at least this many bytes (an unknown batch size counts as 1)..."""

GROUP_SCORE_BYTES = 2**21
"""...with groups of about this many bytes of scores each."""


def head_groups(scores_shape, num_kv_heads, dropout_active=False):
    """How many independent groups of heads attention is computed in (1 = none).

    `scores_shape` is `(batch, heads, T_q, T_k)` of one score tensor: the
    whole one on the unblocked path, one block on the blocked path (where
    each group runs its own blocked loop). The groups' score tensors are a
    fraction of the whole, and TensorFlow runs the independent groups side
    by side. A divisor of the key/value heads (each group keeps its own),
    only for static lengths (see the module note on converters), never with
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


def in_head_groups(attend, groups, query, key, value, mask, bias, return_attention_scores=False):
    """`attend(query, key, value, mask, bias)` computed in `groups` groups of
    contiguous heads (grouped-query attention: each keeps its key/value heads)."""
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


def _split_heads(x, groups):
    """`x` (rank <= 4, heads on axis 1 once rank 4, a `masking.AttentionMask`,
    or None) split into `groups` along the heads; a tensor broadcast over
    heads is shared."""
    if x is None:
        return [x] * groups
    if isinstance(x, masking.AttentionMask):
        return [x._replace(mask=part) for part in _split_heads(x.mask, groups)]
    while len(x.shape) < 4:
        x = ops.expand_dims(x, 0)
    if x.shape[1] == 1:
        return [x] * groups
    return ops.split(x, groups, axis=1)


def softmax_weighted_sum(logits, value, mask):
    """`softmax(where(mask, logits)) @ value` with a hand-written gradient.

    The numbers of `reference.masked_softmax` + `reference.weighted_sum`; the
    backward pass makes fewer passes over `(B, H, T_q, T_k)` tensors than
    automatic differentiation: `d_logits = P * (dP - rowsum(dO * O))` (the
    FlashAttention identity: the row sum over the `(T_q, D)` output, not the
    `(T_q, T_k)` probabilities), and the mask costs nothing backwards
    (masked probabilities are 0, so are their gradients).
    """
    out_dtype = value.dtype
    num_kv_heads = value.shape[2]
    is_grouped = logits.shape[1] != num_kv_heads

    def run(logits, value):
        probs = reference.masked_softmax(logits, mask)
        output = reference.weighted_sum(ops.cast(probs, out_dtype), value)

        def grad(*args, upstream=None):
            if upstream is None:
                (upstream,) = args
            d_out = ops.cast(upstream, "float32")
            v = ops.cast(value, "float32")
            # (B, T_q, H, 1) -> (B, H, T_q, 1): rowsum(dO * O), O(T D) work.
            row = ops.sum(d_out * ops.cast(output, "float32"), axis=-1, keepdims=True)
            row = ops.transpose(row, (0, 2, 1, 3))
            if not is_grouped:
                d_probs = ops.einsum("bqhd,bkhd->bhqk", d_out, v)
                d_value = ops.einsum("bhqk,bqhd->bkhd", probs, d_out)
            else:
                d_out5 = reference.grouped(d_out, num_kv_heads, 2)
                d_probs = reference.merge_groups(
                    ops.einsum("bqngd,bknd->bngqk", d_out5, v), 1
                )
                d_value = ops.einsum(
                    "bngqk,bqngd->bknd", reference.grouped(probs, num_kv_heads, 1), d_out5
                )
            d_logits = probs * (d_probs - row)
            return d_logits, ops.cast(d_value, value.dtype)

        return output, grad

    return ops.custom_gradient(run)(logits, value)


def _is_key_only(mask):
    return mask is not None and mask.shape[1] == 1 and mask.shape[2] == 1


def _one_group(query, key, value, mask, bias, *, scale, every_row_sees_a_key, logit_soft_cap,
               **common):
    if reference.is_low_precision(query):
        query = ops.cast(query, "float32")
    if reference.is_low_precision(key):
        key = ops.cast(key, "float32")
    if (
        _is_key_only(mask)
        and bias is None
        and logit_soft_cap is None
        and query.shape[2] == key.shape[2]
        and query.dtype == "float32"
        and key.dtype == "float32"
    ):
        # A key-only (padding) mask `(B|1, 1, 1, T_k)` as an additive bias,
        # `(q * 2 scale) k^T * 0.5 + bias`: oneDNN fuses the batch matmul, the
        # scalar multiply and the add into one kernel, so the mask costs no
        # pass over the logits (a `where` costs one). Only key-only masks: a
        # `(1, 1, T_q, T_k)` addend (causal) makes the fused kernel far slower
        # than `where`. Scaling by powers of two is exact (the logits are
        # bit-identical to `(q * scale) k^T`), and the matmul output needs
        # only twice the final logit's range.
        row_visible = None if every_row_sees_a_key else reference.rows_with_a_key(mask)
        q = query * ops.cast(2.0 * scale, query.dtype)
        logits = ops.einsum("bqhd,bkhd->bhqk", q, key) * 0.5
        logits = logits + masking.mask_to_bias(mask, row_visible)
        return reference.attend(
            logits, value, mask=None, row_visible=row_visible,
            softmax_weighted_sum=softmax_weighted_sum, **common,
        )
    return reference.attend_with_bias(
        reference.soft_cap(reference.logits(query, key, scale), logit_soft_cap), value,
        mask=mask, bias=bias,
        every_row_sees_a_key=every_row_sees_a_key,
        softmax_weighted_sum=softmax_weighted_sum, **common,
    )


def tf_cpu_attention(
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
    """The `"tf_cpu"` kernel: `reference.reference_attention`'s inputs (`mask`
    a `masking.AttentionMask`) and numbers, in head groups, with the folded
    padding bias and the hand-written gradient (which
    `keras.ops.custom_gradient` provides on TensorFlow and JAX)."""
    common = dict(
        scale=scale,
        logit_soft_cap=logit_soft_cap,
        every_row_sees_a_key=mask.every_row_sees_a_key,
        dropout_rate=dropout_rate,
        training=training,
        seed=seed,
        return_attention_scores=return_attention_scores,
    )
    scores_shape = (query.shape[0], query.shape[2], query.shape[1], key.shape[1])
    groups = head_groups(scores_shape, key.shape[2], dropout_active=training and dropout_rate > 0)
    return in_head_groups(
        lambda q, k, v, m, b: _one_group(q, k, v, m, b, **common),
        groups, query, key, value, mask.logits_mask(dim(query, 1), dim(key, 1)), bias,
        return_attention_scores=return_attention_scores,
    )


def after(tensors, ready):
    """`tensors`, on TensorFlow read only once `ready` exists.

    TensorFlow's executor runs an op as soon as its inputs exist. A gradient
    function that rebuilds a weight from variables alone (an int8 kernel
    dequantized for the input gradient) would then run at the start of the
    backward pass, for every layer at once, and hold every rebuilt weight
    until its layer's turn (Qwen2.5-0.5B, int8 base under LoRA: 1.4 GB more
    at the step's peak, benchmarks/bench_finetune.py). The other backends
    trace or run the backward pass in order: `tensors` unchanged there.
    """
    if keras.backend.backend() != "tensorflow":
        return tensors
    import tensorflow as tf

    with tf.control_dependencies([ready]):
        return tuple(tf.identity(t) for t in tensors)


def loop(lower, upper, body, init):
    """`ops.fori_loop`; on TensorFlow a `tf.while_loop` with one iteration in
    flight. With TensorFlow's default of 10, the independent blocks of the
    blocked path keep up to 10 x 10 score blocks alive at once, which defeats
    the blocking (benchmarks/README.md)."""
    if keras.backend.backend() != "tensorflow":
        return ops.fori_loop(lower, upper, body, init)
    import tensorflow as tf

    return tf.while_loop(
        lambda i, _: i < upper,
        lambda i, carry: (i + 1, body(i, carry)),
        (lower, init),
        parallel_iterations=1,
    )[1]


def sequential_map(fn, n, batch):
    """`ops.map(fn, arange(n))`; on TensorFlow one iteration at a time.

    On TensorFlow the results go into a preallocated `(n, ...)` buffer,
    written row by row (`where(arange(n) == i, result, buffer)`) in a
    `tf.while_loop`, instead of `tf.map_fn`'s TensorLists (see the module
    note on converters). The row writes cost O(n) passes over `(T, d)`-sized
    results, next to the `O(T^2 d)` work of the blocks. `batch` is the
    (possibly dynamic) batch size, the one axis of `fn`'s results that may be
    unknown when tracing.
    """
    indices = ops.arange(n, dtype="int32")
    if keras.backend.backend() != "tensorflow":
        return ops.map(fn, indices)
    import tensorflow as tf

    # The result shapes, from a trace of `fn` that never runs.
    traced = tf.function(fn).get_concrete_function(tf.TensorSpec((), tf.int32))
    specs = tf.nest.map_structure(tf.TensorSpec.from_tensor, traced.structured_outputs)
    flat_specs = tf.nest.flatten(specs)

    def buffer(spec):
        shape = [n] + [batch if d is None else d for d in spec.shape]
        return tf.zeros(tf.stack([tf.cast(d, tf.int32) for d in shape]), spec.dtype)

    def body(i, stacked):
        row = tf.equal(indices, i)
        written = []
        for old, new in zip(stacked, tf.nest.flatten(fn(i))):
            hit = tf.reshape(row, [-1] + [1] * len(new.shape))
            written.append(tf.where(hit, new[None], old))
        return i + 1, written

    _, stacked = tf.while_loop(
        lambda i, _: i < n,
        body,
        (tf.constant(0, tf.int32), [buffer(spec) for spec in flat_specs]),
        parallel_iterations=1,
    )
    return tf.nest.pack_sequence_as(specs, stacked)


def layer_norm(x, gamma, beta, epsilon):
    """`(x - mean) / sqrt(var + epsilon) * gamma + beta` over the last axis,
    float32 arithmetic, with the backward pass written out
    (`dx = rstd * (g - mean(g) - x_hat * mean(g * x_hat))`, `g = dy * gamma`)
    instead of differentiated through the forward ops."""
    x = ops.cast(x, "float32")
    gamma = ops.cast(gamma, "float32")
    beta = ops.cast(beta, "float32")
    batch_axes = tuple(range(len(x.shape) - 1))

    def run(x, gamma, beta):
        mean = ops.mean(x, axis=-1, keepdims=True)
        centered = x - mean
        rstd = ops.rsqrt(ops.mean(ops.square(centered), axis=-1, keepdims=True) + epsilon)
        x_hat = centered * rstd

        def grad(*args, upstream=None):
            if upstream is None:
                (upstream,) = args
            d_y = ops.cast(upstream, "float32")
            g = d_y * gamma
            d_x = rstd * (
                g
                - ops.mean(g, axis=-1, keepdims=True)
                - x_hat * ops.mean(g * x_hat, axis=-1, keepdims=True)
            )
            return d_x, ops.sum(d_y * x_hat, axis=batch_axes), ops.sum(d_y, axis=batch_axes)

        return x_hat * gamma + beta, grad

    return ops.custom_gradient(run)(x, gamma, beta)
