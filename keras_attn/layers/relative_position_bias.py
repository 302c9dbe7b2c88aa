"""T5-style bucketed relative position bias (Raffel et al., 2020)."""

import math

import keras
from keras import ops

from keras_attn import checks
from keras_attn import saving


def relative_position_buckets(relative_position, bidirectional, num_buckets, max_distance):
    """Maps `key_pos - query_pos` (int32) to T5's buckets: exact near, log-spaced far."""
    n = -relative_position
    result = ops.zeros_like(n)
    if bidirectional:
        num_buckets //= 2
        result = result + ops.cast(n < 0, "int32") * num_buckets
        n = ops.abs(n)
    else:
        n = ops.maximum(n, 0)
    max_exact = num_buckets // 2
    is_small = n < max_exact
    n_float = ops.cast(ops.maximum(n, 1), "float32")
    large = max_exact + ops.cast(
        ops.log(n_float / max_exact)
        / math.log(max_distance / max_exact)
        * (num_buckets - max_exact),
        "int32",
    )
    large = ops.minimum(large, num_buckets - 1)
    return result + ops.where(is_small, n, large)


@saving.register
class RelativePositionBias(keras.layers.Layer):
    """Learned per-head bias of the bucketed distance between query and key.

    Returns `(1, num_heads, T_q, T_k)` to pass as `attention_bias=` to an
    attention layer. Distances below `num_buckets / 4` (bidirectional) get
    their own bucket; larger ones share log-spaced buckets up to
    `max_distance`, beyond which all distances share the last bucket, so any
    sequence length works.

    Args:
        num_heads: number of attention heads.
        num_buckets: number of buckets (T5: 32).
        max_distance: distance at which the last bucket starts (T5: 128).
        bidirectional: False for causal (decoder) attention.
        embeddings_initializer: initializer of the `(num_buckets, num_heads)` table.

    Call arguments:
        query: `(B, T_q, ...)`; only its length is used.
        key: `(B, T_k, ...)`; defaults to `query`.
        start_index: absolute position of the first query (cached decoding).

    Example:

    >>> import numpy as np
    >>> layer = RelativePositionBias(num_heads=4)
    >>> tuple(layer(np.zeros((2, 7, 16), "float32")).shape)
    (1, 4, 7, 7)
    """

    def __init__(
        self,
        num_heads,
        num_buckets=32,
        max_distance=128,
        bidirectional=True,
        embeddings_initializer="zeros",
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.num_heads = checks.check_positive_int("num_heads", num_heads)
        self.num_buckets = checks.check_positive_int("num_buckets", num_buckets)
        self.max_distance = checks.check_positive_int("max_distance", max_distance)
        self.bidirectional = checks.check_bool("bidirectional", bidirectional)
        min_buckets = 4 if bidirectional else 2
        if num_buckets < min_buckets or (bidirectional and num_buckets % 2):
            raise ValueError(
                "Received an invalid value for argument `num_buckets`, expected "
                f"an {'even ' if bidirectional else ''}integer >= {min_buckets}. "
                f"Received: num_buckets={num_buckets}"
            )
        exact = (num_buckets // 2 if bidirectional else num_buckets) // 2
        if max_distance <= exact:
            raise ValueError(
                "Received an invalid value for argument `max_distance`, expected "
                f"more than {exact} (the exact-bucket range). Received: "
                f"max_distance={max_distance}"
            )
        self.embeddings_initializer = keras.initializers.get(embeddings_initializer)

    def build(self, query_shape=None, key_shape=None):
        self.embeddings = self.add_weight(
            name="embeddings",
            shape=(self.num_buckets, self.num_heads),
            initializer=self.embeddings_initializer,
        )
        self.built = True

    def call(self, query, key=None, start_index=0):
        checks.check_start_index(start_index)
        key = query if key is None else key
        q_pos = ops.arange(ops.shape(query)[1], dtype="int32") + ops.cast(start_index, "int32")
        k_pos = ops.arange(ops.shape(key)[1], dtype="int32")
        buckets = relative_position_buckets(
            k_pos[None, :] - q_pos[:, None],
            self.bidirectional,
            self.num_buckets,
            self.max_distance,
        )
        bias = ops.take(self.embeddings, buckets, axis=0)  # (T_q, T_k, H)
        bias = ops.transpose(bias, (2, 0, 1))[None]
        return ops.cast(bias, self.compute_dtype)

    def compute_output_shape(self, query_shape, key_shape=None):
        key_shape = query_shape if key_shape is None else key_shape
        return (1, self.num_heads, query_shape[1], key_shape[1])

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "num_heads": self.num_heads,
                "num_buckets": self.num_buckets,
                "max_distance": self.max_distance,
                "bidirectional": self.bidirectional,
                "embeddings_initializer": keras.initializers.serialize(
                    self.embeddings_initializer
                ),
            }
        )
        return config
