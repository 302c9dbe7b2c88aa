"""Luong / scaled dot-product attention without weights."""

import keras

from keras_attn import checks
from keras_attn import saving
from keras_attn.layers import _common
from keras_attn.ops import attention as attention_ops
from keras_attn.ops import recording


@saving.register
class DotProductAttention(keras.layers.Layer):
    """Weightless dot-product (Luong) attention over one sequence axis.

    Computes `softmax(scale * query @ key^T) @ value` for every query
    position (Luong et al., 2015, "dot" score; Vaswani et al., 2017 with
    `scale="sqrt"`). The layer has no weights; masks from Keras masking,
    explicit masks and the causal flag combine by logical AND, and fully
    masked query rows give zeros.

    Args:
        scale: `"sqrt"` for `1/sqrt(features)`, a positive float, or None for
            no scaling (Luong's plain dot score).
        dropout: dropout rate on the attention probabilities.
        seed: seed for dropout.
        chunk_size: None, an int or `(q_chunk, k_chunk)`: memory-efficient
            exact attention blocked over queries and keys (see
            `keras_attn.ops.dot_product_attention`); None uses it only for
            long sequences, 0 never.

    Call arguments:
        query: `(B, T_q, D)`.
        value: `(B, T_k, D_v)`.
        key: optional `(B, T_k, D)`; `value` is used when None.
        query_mask, value_mask, key_mask: `(B, T)` padding masks (filled in
            from Keras masks automatically).
        attention_mask: boolean `(B, T_k)`, `(T_q, T_k)` or `(B, T_q, T_k)`.
        attention_bias: additive logits bias broadcastable to `(B, T_q, T_k)`.
        use_causal_mask: hide keys after each query position.
        return_attention_scores: also return the `(B, T_q, T_k)` scores.
        training: whether dropout is active.

    Returns:
        `(B, T_q, D_v)`, or `(output, scores)`.

    Example:

    >>> import numpy as np
    >>> q = np.random.rand(2, 3, 8).astype("float32")
    >>> v = np.random.rand(2, 5, 8).astype("float32")
    >>> out, scores = DotProductAttention()(q, v, return_attention_scores=True)
    >>> tuple(out.shape), tuple(scores.shape)
    ((2, 3, 8), (2, 3, 5))
    """

    def __init__(self, scale="sqrt", dropout=0.0, seed=None, chunk_size=None, **kwargs):
        super().__init__(**kwargs)
        if scale != "sqrt" and scale is not None:
            checks.check_positive_float("scale", scale)
        self.scale = scale
        self.dropout = checks.check_dropout("dropout", dropout)
        self.chunk_size = checks.check_layer_chunk_size(chunk_size, self.dropout)
        self.seed = seed
        self.seed_generator = keras.random.SeedGenerator(seed) if self.dropout else None
        self.supports_masking = True
        self.built = True

    def _scale_value(self):
        if self.scale == "sqrt":
            return None
        if self.scale is None:
            return 1.0
        return float(self.scale)

    def call(
        self,
        query,
        value,
        key=None,
        *,
        query_mask=None,
        value_mask=None,
        key_mask=None,
        attention_mask=None,
        attention_bias=None,
        use_causal_mask=False,
        return_attention_scores=False,
        training=None,
    ):
        key_or_value, mask = _common.single_head_call_masks(
            "DotProductAttention", query, value, key, use_causal_mask=use_causal_mask,
            query_mask=query_mask, value_mask=value_mask, key_mask=key_mask,
            attention_mask=attention_mask,
        )
        if query.shape[-1] is not None and key_or_value.shape[-1] is not None and (
            query.shape[-1] != key_or_value.shape[-1]
        ):
            raise ValueError(
                "`query` and `key` (or `value` when `key` is None) must have the "
                f"same number of features. Received: query.shape={tuple(query.shape)}, "
                f"key.shape={tuple(key_or_value.shape)}"
            )
        # keras_attn.visualize: probabilities only inside ops.recording.recording().
        record = recording.active()
        want_scores = return_attention_scores or record
        bias = None
        if attention_bias is not None:
            bias = attention_bias
            if len(bias.shape) == 3:
                bias = keras.ops.expand_dims(bias, 1)
        result = attention_ops.dot_product_attention(
            # expand_dims, not None-indexing (a Flex-only StridedSlice in TFLite).
            keras.ops.expand_dims(query, 2),
            keras.ops.expand_dims(key_or_value, 2),
            keras.ops.expand_dims(value, 2),
            attention_mask=mask,
            bias=bias,
            scale=self._scale_value(),
            dropout_rate=self.dropout,
            training=bool(training),
            seed=self.seed_generator,
            return_attention_scores=want_scores,
            chunk_size=self.chunk_size,
        )
        if not want_scores:
            return result[:, :, 0, :]
        output, scores = result
        if record:
            recording.add(self, scores, mask)  # (B, 1, T_q, T_k): one head
        return (output[:, :, 0, :], scores[:, 0]) if return_attention_scores else output[:, :, 0, :]

    def compute_output_shape(self, query_shape, value_shape, key_shape=None):
        return tuple(query_shape[:-1]) + (value_shape[-1],)

    def compute_output_spec(self, query, value, key=None, return_attention_scores=False, **kwargs):
        out = keras.KerasTensor(
            self.compute_output_shape(query.shape, value.shape), dtype=self.compute_dtype
        )
        if not return_attention_scores:
            return out
        scores = keras.KerasTensor(
            (query.shape[0], query.shape[1], value.shape[1]), dtype=self.compute_dtype
        )
        return out, scores

    def get_config(self):
        config = super().get_config()
        config.update(
            {"scale": self.scale, "dropout": self.dropout, "seed": self.seed,
             "chunk_size": self.chunk_size}
        )
        return config
