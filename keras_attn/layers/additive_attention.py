"""Bahdanau (additive) attention with learned query and key projections."""

import keras

from keras_attn import checks
from keras_attn import saving
from keras_attn.layers import _common
from keras_attn.ops import attention as attention_ops
from keras_attn.ops import masking
from keras_attn.ops import recording


@saving.register
class AdditiveAttention(keras.layers.Layer):
    """Additive attention as in Bahdanau et al. (2015).

    `score(q_i, k_j) = v^T tanh(W_q q_i + W_k k_j + b)`, followed by a
    masked softmax over keys and a weighted sum of the values. Unlike
    `keras.layers.AdditiveAttention` (which has neither `W_q` nor `W_k`),
    this is the layer from the paper. The largest tensor it materialises is
    `(batch, T_q, T_k, units)`: memory grows with `units * T_q * T_k`.

    Args:
        units: size of the hidden layer of the score MLP.
        dropout: dropout rate on the attention probabilities.
        use_bias: whether the score MLP has the bias `b`.
        kernel_initializer, bias_initializer: initializers of `W_q`, `W_k`,
            `v` and `b`.
        seed: seed for dropout.

    Call arguments:
        query: `(B, T_q, D_q)`, e.g. the decoder state.
        value: `(B, T_k, D_v)`, e.g. the encoder outputs.
        key: optional `(B, T_k, D_k)`; `value` is used when None.
        query_mask, value_mask, key_mask, attention_mask, use_causal_mask,
        return_attention_scores, training: as in `DotProductAttention`.

    Returns:
        The context `(B, T_q, D_v)`, or `(context, scores)` with scores
        `(B, T_q, T_k)`.

    Example:

    >>> import numpy as np
    >>> layer = AdditiveAttention(units=16)
    >>> q = np.random.rand(2, 1, 8).astype("float32")
    >>> v = np.random.rand(2, 6, 12).astype("float32")
    >>> tuple(layer(q, v).shape)
    (2, 1, 12)
    """

    def __init__(
        self,
        units,
        dropout=0.0,
        use_bias=True,
        kernel_initializer="glorot_uniform",
        bias_initializer="zeros",
        seed=None,
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.units = checks.check_positive_int("units", units)
        self.dropout = checks.check_dropout("dropout", dropout)
        self.use_bias = checks.check_bool("use_bias", use_bias)
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self.bias_initializer = keras.initializers.get(bias_initializer)
        self.seed = seed
        self.seed_generator = keras.random.SeedGenerator(seed) if self.dropout else None
        self.supports_masking = True

    def build(self, query_shape, value_shape, key_shape=None):
        key_shape = value_shape if key_shape is None else key_shape
        for name, shape in (("query", query_shape), ("value", value_shape), ("key", key_shape)):
            checks.check_shape_rank(name, shape, 3, "(batch, seq, features)")
        def dense(name, use_bias):
            return keras.layers.Dense(
                self.units,
                use_bias=use_bias,
                name=name,
                dtype=self.dtype_policy,
                kernel_initializer=_common.clone_initializer(self.kernel_initializer),
                bias_initializer=_common.clone_initializer(self.bias_initializer),
            )

        self.query_dense = dense("query", self.use_bias)
        self.query_dense.build(query_shape)
        self.key_dense = dense("key", False)
        self.key_dense.build(key_shape)
        self.score_weight = self.add_weight(
            name="score_weight",
            shape=(self.units,),
            initializer=_common.clone_initializer(self.kernel_initializer),
        )
        self._feature_dims = (query_shape[-1], value_shape[-1], key_shape[-1])
        self.built = True

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
        use_causal_mask=False,
        return_attention_scores=False,
        training=None,
    ):
        d_q, d_v, d_k = self._feature_dims
        key_or_value = value if key is None else key
        key_or_value, mask = _common.single_head_call_masks(
            "AdditiveAttention", query, value, key, use_causal_mask=use_causal_mask,
            feature_checks=(("query", query, d_q), ("value", value, d_v), ("key", key_or_value, d_k)),
            query_mask=query_mask, value_mask=value_mask, key_mask=key_mask,
            attention_mask=attention_mask,
        )
        with masking.hidden_keras_masks(query, key_or_value):
            query_projection = self.query_dense(query)
            key_projection = self.key_dense(key_or_value)
        # keras_attn.visualize: probabilities only inside ops.recording.recording().
        record = recording.active()
        result = attention_ops.additive_attention(
            query_projection,
            key_projection,
            value,
            self.score_weight,
            attention_mask=mask,
            dropout_rate=self.dropout,
            training=bool(training),
            seed=self.seed_generator,
            return_attention_scores=return_attention_scores or record,
        )
        if not record:
            return result
        recording.add(self, keras.ops.expand_dims(result[1], 1), mask)  # one head
        return result if return_attention_scores else result[0]

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
            {
                "units": self.units,
                "dropout": self.dropout,
                "use_bias": self.use_bias,
                "kernel_initializer": keras.initializers.serialize(self.kernel_initializer),
                "bias_initializer": keras.initializers.serialize(self.bias_initializer),
                "seed": self.seed,
            }
        )
        return config
