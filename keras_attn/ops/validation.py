"""Argument checks of the attention ops: one validator per concept.

Each raises early, naming the argument, the value or shape received and what
was expected. (`chunk_size` is checked by `keras_attn.ops.dispatch`, masks by
`keras_attn.ops.masking`.)
"""

import math

from keras import ops


def check_rank(name, x, rank):
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


def check_start_index(start_index):
    if isinstance(start_index, bool) or (isinstance(start_index, int) and start_index < 0):
        raise ValueError(
            "Received an invalid value for argument `start_index`, expected a "
            f"non-negative integer. Received: start_index={start_index!r}"
        )


def check_sliding_window(sliding_window):
    if sliding_window is None:
        return None
    if isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or sliding_window <= 0:
        raise ValueError(
            "Received an invalid value for argument `sliding_window`, expected "
            f"None or a positive integer. Received: sliding_window={sliding_window!r}"
        )
    return sliding_window


def check_heads_and_sizes(query, key, value):
    for name, x in (("query", query), ("key", key), ("value", value)):
        check_rank(name, x, 4)
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
