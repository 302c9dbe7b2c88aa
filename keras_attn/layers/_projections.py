"""The projections of `MultiHeadAttention`: Keras's einsum equations, and
the same projections as 2-D matmuls.

The einsum equations are those of `keras.layers.MultiHeadAttention`, so the
sublayers' weights have Keras's shapes for every input rank. `project` and
`project_output` compute the common `(batch, seq, features)` case as 2-D
matmuls (`KernelPlan.fused_projections`).
"""

import itertools
import math
import string

from keras import ops


def projection_equation(free_dims, bound_dims, output_dims):
    """`(equation, bias_axes)` of an EinsumDense as Keras's MHA builds it."""
    letters = string.ascii_lowercase
    free = letters[:free_dims]
    bound = letters[free_dims : free_dims + bound_dims]
    out = letters[free_dims + bound_dims : free_dims + bound_dims + output_dims]
    return f"{free}{bound},{bound}{out}->{free}{out}", out


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


def _plain(dense):
    """Can `dense` be computed from its kernel and bias as a 2-D matmul (plus
    a LoRA layer's update)? Not when quantized (its call dequantizes), nor
    with LoRA dropout (its call knows whether it trains)."""
    return dense.built and dense.quantization_mode is None and not getattr(dense, "lora_dropout", 0)


def _kernel(dense):
    """The kernel the matmul takes: a PEFT-style LoRA layer's frozen one, its
    low-rank update added apart (`_with_update`). The merged kernel would make
    the backward pass form a full-size kernel gradient to reach A and B."""
    return dense.frozen_kernel if hasattr(dense, "lora_update") else dense.kernel


def _with_update(dense, x, y):
    update = dense.lora_update(x, dtype=y.dtype) if hasattr(dense, "lora_update") else None
    return y if update is None else y + update


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
    kernels = [_kernel(d) for d in denses]
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
        piece = _with_update(d, x, ops.reshape(piece, (batch, length) + tuple(k.shape[1:])))
        outputs.append(d.activation(piece) if d.activation is not None else piece)
    return outputs


def project_output(x, dense):
    """`dense(x)` for the output projection of `(B, T, heads, size)`, as a
    2-D matmul over `(B * T, heads * size)`."""
    if len(x.shape) != 4 or not _plain(dense):
        return dense(x)
    batch, length = _seq_dims(x)
    kernel = _kernel(dense)
    inner = kernel.shape[0] * kernel.shape[1]
    out_dims = tuple(kernel.shape[2:])
    width = math.prod(out_dims)
    y = ops.matmul(ops.reshape(ops.cast(x, kernel.dtype), (-1, inner)), ops.reshape(kernel, (inner, width)))
    if dense.bias is not None:
        y = y + ops.reshape(dense.bias, (width,))
    return _with_update(dense, x, ops.reshape(y, (batch, length) + out_dims))
