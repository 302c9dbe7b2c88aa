"""ALiBi: attention with linear biases (Press et al., 2022)."""

import math

import keras
from keras import ops

from keras_attn import checks
from keras_attn import saving
from keras_attn.layers import _positions


def alibi_slopes(num_heads, max_bias=8.0):
    """Per-head slopes `2^(-max_bias * (h + 1) / n)`, with the paper's rule for non-powers of 2."""

    def power_of_two(n):
        return [2.0 ** (-max_bias * (h + 1) / n) for h in range(n)]

    if math.log2(num_heads).is_integer():
        return power_of_two(num_heads)
    closest = 2 ** math.floor(math.log2(num_heads))
    return power_of_two(closest) + power_of_two(2 * closest)[0::2][: num_heads - closest]


@saving.register
class AlibiBias(keras.layers.Layer):
    """Linear distance penalties to add to attention logits (ALiBi).

    Produces `bias[h, i, j] = -slope_h * |(start_index + i) - j|`, shaped
    `(1, num_heads, T_q, T_k)`, to pass as `attention_bias=` to an attention
    layer (or `bias=` to `keras_attn.ops.dot_product_attention`). Under a
    causal mask this is exactly the paper's `slope_h * (j - i)`.

    Args:
        num_heads: number of attention heads.
        max_bias: the paper's 8; slopes are `2^(-max_bias * (h + 1) / num_heads)`.

    Call arguments:
        query: `(B, T_q, ...)`; only its length is used.
        key: `(B, T_k, ...)`; defaults to `query`.
        start_index: absolute position of the first query (cached decoding).

    Example:

    >>> import numpy as np
    >>> x = np.zeros((2, 5, 16), "float32")
    >>> tuple(AlibiBias(num_heads=4)(x).shape)
    (1, 4, 5, 5)
    """

    def __init__(self, num_heads, max_bias=8.0, **kwargs):
        super().__init__(**kwargs)
        self.num_heads = checks.check_positive_int("num_heads", num_heads)
        self.max_bias = checks.check_positive_float("max_bias", max_bias)
        self.built = True

    def call(self, query, key=None, start_index=0):
        checks.check_start_index(start_index)
        key = query if key is None else key
        q_pos = _positions.positions(ops.shape(query)[1], start_index)
        k_pos = _positions.positions(ops.shape(key)[1])
        distance = ops.abs(q_pos[:, None] - k_pos[None, :])  # (T_q, T_k)
        slopes = ops.convert_to_tensor(alibi_slopes(self.num_heads, self.max_bias), "float32")
        # expand_dims, not None-indexing (a Flex-only StridedSlice in TFLite).
        bias = -ops.reshape(slopes, (-1, 1, 1)) * ops.expand_dims(distance, 0)
        return ops.cast(ops.expand_dims(bias, 0), self.compute_dtype)

    def compute_output_shape(self, query_shape, key_shape=None):
        key_shape = query_shape if key_shape is None else key_shape
        return (1, self.num_heads, query_shape[1], key_shape[1])

    def get_config(self):
        config = super().get_config()
        config.update({"num_heads": self.num_heads, "max_bias": self.max_bias})
        return config
