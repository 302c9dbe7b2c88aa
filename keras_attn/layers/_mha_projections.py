"""Projections and N-D attention layout of `MultiHeadAttention`.

The einsum equations are those of `keras.layers.MultiHeadAttention`, so the
sublayers' weights have Keras's shapes for every input rank. `project` and
`project_output` compute the common `(batch, seq, features)` case as 2-D
matmuls; `fold_attention_axes` / `unfold_*` bring inputs with several
attention or batch-like axes to that case and back.
"""

import itertools
import math
import string

import keras
from keras import ops

from keras_attn.layers import _common
from keras_attn.ops import masking


def projection_equation(free_dims, bound_dims, output_dims):
    """`(equation, bias_axes)` of an EinsumDense as Keras's MHA builds it."""
    letters = string.ascii_lowercase
    free = letters[:free_dims]
    bound = letters[free_dims : free_dims + bound_dims]
    out = letters[free_dims + bound_dims : free_dims + bound_dims + output_dims]
    return f"{free}{bound},{bound}{out}->{free}{out}", out


def build_sublayers(layer, query_shape, value_shape, key_shape):
    """Creates and builds the EinsumDense sublayers of a `MultiHeadAttention`,
    in Keras's order (gate before value) so that `get_weights()` lists match."""
    rank = len(query_shape)
    heads, kv_heads = layer.num_heads, layer.num_key_value_heads

    def dense(name, shape, bound_dims, out_dims, activation=None):
        # As Keras: the input's non-feature axes are free, `bound_dims` contracted.
        equation, bias_axes = projection_equation(rank - 1, bound_dims, len(out_dims))
        sublayer = keras.layers.EinsumDense(
            equation,
            output_shape=output_shape_arg(rank - 2 + len(out_dims), out_dims),
            bias_axes=bias_axes if layer.use_bias else None,
            activation=activation,
            name=name,
            kernel_initializer=_common.clone_initializer(layer.kernel_initializer),
            bias_initializer=_common.clone_initializer(layer.bias_initializer),
            kernel_regularizer=layer.kernel_regularizer,
            bias_regularizer=layer.bias_regularizer,
            kernel_constraint=layer.kernel_constraint,
            bias_constraint=layer.bias_constraint,
            dtype=layer.dtype_policy,
        )
        sublayer.build(shape)
        return sublayer

    layer._query_dense = dense("query", query_shape, 1, (heads, layer.key_dim))
    layer._key_dense = dense("key", key_shape, 1, (kv_heads, layer.key_dim))
    if layer.use_gate:
        layer._gate_dense = dense("gate", query_shape, 1, (heads, layer.value_dim), "sigmoid")
    layer._value_dense = dense("value", value_shape, 1, (kv_heads, layer.value_dim))
    layer._output_dense = dense(
        "attention_output", tuple(query_shape[:-1]) + (heads, layer.value_dim), 2,
        layer._output_shape or (query_shape[-1],),
    )


def output_shape_arg(rank, known_last_dims):
    """EinsumDense `output_shape` for an output of `rank` axes after the batch."""
    return [None] * (rank - len(known_last_dims)) + list(known_last_dims)


def check_output_shape(output_shape):
    """None, or a tuple of positive ints (an int is one dim), as Keras."""
    if output_shape is None:
        return None
    if isinstance(output_shape, int) and not isinstance(output_shape, bool):
        output_shape = (output_shape,)
    if not isinstance(output_shape, (tuple, list)) or not output_shape or not all(
        isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in output_shape
    ):
        raise ValueError(
            f"Invalid `output_shape`: {output_shape!r}. Expected a positive "
            "int or a tuple/list of positive ints."
        )
    return tuple(output_shape)


def check_attention_axes(attention_axes):
    """None, or a tuple of ints (an int is one axis), as Keras."""
    if attention_axes is None:
        return None
    if isinstance(attention_axes, int) and not isinstance(attention_axes, bool):
        return (attention_axes,)
    if not isinstance(attention_axes, (list, tuple)) or not all(
        isinstance(a, int) and not isinstance(a, bool) for a in attention_axes
    ):
        raise ValueError(
            "`attention_axes` must be an int, list, or tuple of ints. "
            f"Received: attention_axes={attention_axes!r}"
        )
    return tuple(attention_axes)


def check_shapes(query_shape, value_shape, key_shape=None, ranks=True):
    """Keras's check (value and key agree except for features), and equal ranks >= 3."""
    value_shape = tuple(value_shape)
    key_shape = value_shape if key_shape is None else tuple(key_shape)
    if value_shape[1:-1] != key_shape[1:-1]:
        raise ValueError(
            "All dimensions of `value` and `key`, except the last one, must be "
            f"equal (the same sequence length). Received: value_shape={value_shape} "
            f"and key_shape={key_shape}"
        )
    if ranks and not 3 <= len(query_shape) == len(value_shape):
        raise ValueError(
            "Expected `query` and `value` of the same rank, at least rank 3 "
            "(batch, ..., features). Received: "
            f"query_shape={tuple(query_shape)}, value_shape={value_shape}"
        )


def scores_shape(query_shape, value_shape, attention_axes, num_heads, cache_length=None):
    """Keras's scores layout `(B, *other, heads, *q_axes, *k_axes)`; with a
    cache, `(B, heads, T_q, cache_length)`."""
    rank = len(query_shape)
    axes = normalize_attention_axes(attention_axes, rank)
    other = tuple(query_shape[a] for a in range(1, rank - 1) if a not in axes)
    q_seq = tuple(query_shape[a] for a in axes)
    k_seq = (cache_length,) if value_shape is None else tuple(value_shape[a] for a in axes)
    return (query_shape[0],) + other + (num_heads,) + q_seq + k_seq


def nd_mask(query, value, query_mask, value_mask, key_mask, attention_mask,
            use_causal_mask, sliding_window):
    """Keras's mask for inputs of rank > 3 (or None): padding masks as
    `[..., None]` / `[..., None, :]`, the causal and window masks as
    `(1, T, S)` over the first axis after the batch, ANDed with
    `attention_mask`. `NDLayout.fold_mask` gives it the scores' layout."""
    parts = []
    if query_mask is not None:
        parts.append(ops.expand_dims(masking._as_bool(query_mask), -1))
    for m in (value_mask, key_mask):
        if m is not None:
            parts.append(ops.expand_dims(masking._as_bool(m), -2))
    t, s = ops.shape(query)[1], ops.shape(value)[1]
    rel = ops.expand_dims(ops.arange(t, dtype="int32"), 1) - ops.arange(s, dtype="int32")
    if use_causal_mask:
        parts.append(ops.expand_dims(ops.greater_equal(rel, 0), 0))
    if sliding_window is not None:
        parts.append(ops.expand_dims(ops.less(ops.abs(rel), sliding_window), 0))
    if attention_mask is not None:
        masking._check_mask_dtype("attention_mask", attention_mask)
        parts.append(masking._as_bool(attention_mask))
    mask = None
    for part in parts:
        mask = part if mask is None else ops.logical_and(mask, part)
    return mask


def normalize_attention_axes(attention_axes, input_rank):
    """Keras's rule: None is every axis between batch and features; negative
    axes count from the input's rank."""
    if attention_axes is None:
        return tuple(range(1, input_rank - 1))
    axes = tuple(a if a >= 0 else input_rank + a for a in attention_axes)
    bad = [a for a in axes if not 1 <= a < input_rank - 1]
    if bad or len(set(axes)) != len(axes):
        raise ValueError(
            "Received an invalid value for argument `attention_axes`, expected "
            f"distinct axes between the batch axis and the feature axis of inputs "
            f"of rank {input_rank}. Received: attention_axes={attention_axes!r}"
        )
    return tuple(sorted(axes))


def _plain(dense):
    """Can `dense` be computed from its `kernel`/`bias` as a 2-D matmul?
    Not when quantized (its call dequantizes)."""
    return dense.built and dense.quantization_mode is None


def _seq_dims(x):
    return [x.shape[a] if x.shape[a] is not None else ops.shape(x)[a] for a in (0, 1)]


def project(x, denses):
    """`[dense(x) for dense in denses]` for `"abc,cde->abde"` projections of
    one `(B, T, features)` input, as ONE 2-D matmul.

    The kernels `(features, heads, size)` are concatenated as
    `(features, sum(heads * size))` at call time (a copy of the weights, not
    of activations) and the `(B * T, ...)` product is split: for
    self-attention the query, key and value projections become one larger
    matmul, which oneDNN runs faster than three small ones
    (benchmarks/README.md). The variables stay those of the separate
    projections, so weights, checkpoints and `from_keras` are unchanged.
    Quantized projections, and inputs of another rank, are called as layers.
    """
    if (
        len(x.shape) != 3
        or not all(_plain(d) for d in denses)
        or len({d.bias is None for d in denses}) > 1
    ):
        return [d(x) for d in denses]
    features = x.shape[-1]
    batch, length = _seq_dims(x)
    kernels = [d.kernel for d in denses]  # read once: with LoRA, a computed tensor
    widths = [k.shape[1] * k.shape[2] for k in kernels]
    kernel = ops.concatenate(
        [ops.reshape(k, (features, w)) for k, w in zip(kernels, widths)], axis=1
    )
    y = ops.matmul(ops.reshape(ops.cast(x, kernel.dtype), (-1, features)), kernel)
    if denses[0].bias is not None:
        y = y + ops.concatenate([ops.reshape(d.bias, (w,)) for d, w in zip(denses, widths)])
    pieces = ops.split(y, list(itertools.accumulate(widths[:-1])), axis=-1) if len(denses) > 1 else [y]
    outputs = []
    for d, k, piece in zip(denses, kernels, pieces):
        piece = ops.reshape(piece, (batch, length) + tuple(k.shape[1:]))
        outputs.append(d.activation(piece) if d.activation is not None else piece)
    return outputs


def project_output(x, dense):
    """`dense(x)` for the output projection of `(B, T, heads, size)`, as a
    2-D matmul over `(B * T, heads * size)`."""
    if len(x.shape) != 4 or not _plain(dense):
        return dense(x)
    batch, length = _seq_dims(x)
    kernel = dense.kernel
    inner = kernel.shape[0] * kernel.shape[1]
    out_dims = tuple(kernel.shape[2:])
    width = math.prod(out_dims)
    y = ops.matmul(ops.reshape(ops.cast(x, kernel.dtype), (-1, inner)), ops.reshape(kernel, (inner, width)))
    if dense.bias is not None:
        y = y + ops.reshape(dense.bias, (width,))
    return ops.reshape(y, (batch, length) + out_dims)


def _dims(x, axes):
    shape = ops.shape(x)
    return [x.shape[a] if x.shape[a] is not None else shape[a] for a in axes]


def _product(dims):
    out = 1
    for d in dims:
        out = out * d
    return out


class NDLayout:
    """Folds projected `(B, *spatial, heads, size)` tensors with attention over
    `attention_axes` into `(B', T, heads, size)`: the other spatial axes join
    the batch, the attention axes are flattened into one sequence axis. The
    attention itself is then the one of `(batch, seq, features)` inputs.

    Scores and masks use Keras's layout `(B, *other, heads, *q_axes, *k_axes)`.
    """

    def __init__(self, rank, attention_axes):
        # rank: of the projected tensors; attention_axes: normalized, sorted.
        self.axes = tuple(attention_axes)
        self.other = tuple(a for a in range(1, rank - 2) if a not in self.axes)
        self.perm = (0,) + self.other + self.axes + (rank - 2, rank - 1)
        self.inverse = tuple(self.perm.index(a) for a in range(rank))
        self.scores_rank = 2 + len(self.other) + 2 * len(self.axes)

    def fold(self, x):
        batch = _dims(x, (0,) + self.other)
        seq = _dims(x, self.axes)
        tail = _dims(x, (len(x.shape) - 2, len(x.shape) - 1))
        folded = ops.reshape(ops.transpose(x, self.perm), [_product(batch), _product(seq)] + tail)
        return folded, batch, seq

    def unfold_output(self, y, batch, seq):
        tail = _dims(y, (2, 3))
        return ops.transpose(ops.reshape(y, batch + seq + tail), self.inverse)

    def unfold_scores(self, scores, batch, q_seq, k_seq):
        return ops.reshape(scores, batch + [scores.shape[1]] + q_seq + k_seq)

    def fold_mask(self, mask, batch, q_seq, k_seq):
        """A mask broadcastable to Keras's scores layout, as `(B', H|1, T_q, T_k)`."""
        while len(mask.shape) < self.scores_rank:
            mask = ops.expand_dims(mask, -2 * len(self.axes) - 1)
        heads = mask.shape[len(batch)]
        heads = 1 if heads is None else heads
        mask = ops.broadcast_to(mask, batch + [heads] + q_seq + k_seq)
        return ops.reshape(mask, [_product(batch), heads, _product(q_seq), _product(k_seq)])
