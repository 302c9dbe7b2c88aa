"""Multi-head attention: a drop-in for `keras.layers.MultiHeadAttention`, with GQA."""

import keras
from keras import ops

from keras_attn.layers import _common
from keras_attn.layers import _dtype_checks
from keras_attn.layers import _kv_cache
from keras_attn.layers import _mha_attention
from keras_attn.layers import _mha_convert
from keras_attn.layers import _mha_projections as proj
from keras_attn.ops import attention as attention_ops
from keras_attn.ops import masking
from keras_attn.layers._mha_projections import project_output


@_common.register
class MultiHeadAttention(keras.layers.Layer):
    """Multi-head attention (Vaswani et al., 2017) with grouped-query heads.

    Same constructor arguments, call signature, weights and outputs as
    `keras.layers.MultiHeadAttention` for inputs `(batch, seq, features)`,
    so it can replace it (`MultiHeadAttention.from_keras(layer)` copies a
    built Keras layer). In addition:

    - `num_key_value_heads` (Ainslie et al., 2023): keys and values get fewer
      heads than queries, each shared by `num_heads / num_key_value_heads`
      query heads (1 = multi-query attention). The shared heads are never
      repeated in memory.
    - `rotary_embedding`: a `RotaryEmbedding` applied to projected queries
      and keys.
    - `attention_bias=` at call time: an additive `(B|1, H|1, T_q, T_k)`
      logits bias, e.g. from `AlibiBias` or `RelativePositionBias`.
    - A query row whose keys are all masked outputs zeros (before the output
      projection), never NaN and never an average of the values.

    Args:
        num_heads: number of query heads.
        key_dim: size of each query/key head.
        value_dim: size of each value head; defaults to `key_dim`.
        dropout: dropout rate on the attention probabilities.
        use_bias: whether the projections have biases.
        output_shape: last dims of the output; defaults to the query's features.
        attention_axes: axes of rank > 3 inputs attended over, as in Keras
            (e.g. `(1, 2)` for the `(H, W)` of `(B, H, W, C)` images); None
            is every axis between batch and features. The other axes act
            as batch axes.
        sliding_window: if set, each query sees keys within
            `sliding_window - 1` positions (as Keras).
        flash_attention: as Keras: True runs `keras.ops.dot_product_attention(
            flash_attention=True)` (JAX/torch on supported devices; an error
            elsewhere, with dropout or with `return_attention_scores`);
            None/False run keras_attn's exact attention.
        kernel_initializer, bias_initializer, kernel_regularizer,
        bias_regularizer, activity_regularizer, kernel_constraint,
        bias_constraint: as for `keras.layers.EinsumDense`.
        use_gate: sigmoid gate on the attention output (as Keras).
        seed: seed for dropout.
        num_key_value_heads: heads for keys and values; must divide `num_heads`.
        rotary_embedding: a `RotaryEmbedding` (or its config) or None.
        chunk_size: None, an int or `(q_chunk, k_chunk)`: memory-efficient
            exact attention blocked over queries and keys (see
            `keras_attn.ops.dot_product_attention`); None uses it only for
            long sequences, 0 never.

    Call arguments:
        query: `(B, T_q, D_q)`.
        value: `(B, T_k, D_v)`.
        key: optional `(B, T_k, D_k)`; `value` is used when None.
        query_mask, value_mask, key_mask: `(B, T)` padding masks (filled in
            from Keras masks automatically).
        attention_mask: boolean `(B, T_k)`, `(T_q, T_k)`, `(B, T_q, T_k)` or
            `(B, H, T_q, T_k)`; True = attend.
        attention_bias: additive logits bias, broadcastable to `(B, H, T_q, T_k)`.
        use_causal_mask: hide keys after each query position.
        return_attention_scores: also return `(B, H, T_q, T_k)` scores.
        training: whether dropout is active.
        start_index: position of the first query for the rotary embedding.
        cache: `(key_cache, value_cache)`, each `(B, max_length,
            num_key_value_heads, head_dim)`, for incremental decoding. With
            `cache_index`, the new tokens' keys/values are written at
            `[cache_index, cache_index + T_q)` (rotary positions start there)
            and keys after them are hidden; with `cache_index=None` the cache
            is a precomputed cross-attention cache (`project_key_value`).
            Key masks then cover the cache axis `(B, max_length)`, or, as
            `(B, T_q)` (e.g. the Keras mask of the new tokens), only the new
            tokens' positions.
        cache_index: scalar int position of the first new token.

    Override point: `_compute_attention(query, key, value, attention_mask=None,
    training=None, return_attention_scores=False, use_causal_mask=False)`
    gets the projected `(B, T, H, D)` tensors and returns
    `(output, scores_or_None)`, as in Keras. It is used by every call,
    cached or not; when a subclass overrides it, the causal mask is part of
    `attention_mask` (`(B|1, T_q, T_k)`, or `(B|1, H, T_q, T_k)` when it
    varies by head) and `attention_bias`, if given, comes as a keyword.

    Returns:
        `(B, T_q, *output_shape)`, or `(output, scores)`; with a cache, the
        updated cache is appended: `(output, cache)` or
        `(output, scores, cache)`.

    Example:

    >>> import numpy as np
    >>> mha = MultiHeadAttention(num_heads=4, key_dim=8, num_key_value_heads=2)
    >>> x = np.random.rand(2, 6, 16).astype("float32")
    >>> out, scores = mha(x, x, use_causal_mask=True, return_attention_scores=True)
    >>> tuple(out.shape), tuple(scores.shape)
    ((2, 6, 16), (2, 4, 6, 6))
    """

    def __init__(
        self,
        num_heads,
        key_dim,
        value_dim=None,
        dropout=0.0,
        use_bias=True,
        output_shape=None,
        attention_axes=None,
        sliding_window=None,
        flash_attention=None,
        kernel_initializer="glorot_uniform",
        bias_initializer="zeros",
        kernel_regularizer=None,
        bias_regularizer=None,
        activity_regularizer=None,
        kernel_constraint=None,
        bias_constraint=None,
        use_gate=False,
        seed=None,
        num_key_value_heads=None,
        rotary_embedding=None,
        chunk_size=None,
        **kwargs,
    ):
        super().__init__(activity_regularizer=activity_regularizer, **kwargs)
        self.num_heads = _common.check_positive_int("num_heads", num_heads)
        self.key_dim = _common.check_positive_int("key_dim", key_dim)
        self.value_dim = _common.check_positive_int("value_dim", value_dim, allow_none=True) or key_dim
        self.num_key_value_heads = (
            _common.check_num_key_value_heads(num_key_value_heads, num_heads) or num_heads
        )
        self.dropout = _common.check_dropout("dropout", dropout)
        self.chunk_size = _common.check_chunk_size(chunk_size, self.dropout)
        self.use_bias = _common.check_bool("use_bias", use_bias)
        self.use_gate = _common.check_bool("use_gate", use_gate)
        output_shape = proj.check_output_shape(output_shape)
        self._output_shape = output_shape
        self._attention_axes = proj.check_attention_axes(attention_axes)
        self._sliding_window = _common.check_positive_int(
            "sliding_window", sliding_window, allow_none=True
        )
        # As Keras: None follows `keras.config.is_flash_attention_enabled()`.
        self._flash_attention = flash_attention or keras.config.is_flash_attention_enabled()
        if self._flash_attention and self.dropout > 0.0:
            raise ValueError(
                "Dropout is not supported when flash attention is enabled. "
                "Please set dropout to 0.0 to use flash attention."
            )
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self.bias_initializer = keras.initializers.get(bias_initializer)
        self.kernel_regularizer = keras.regularizers.get(kernel_regularizer)
        self.bias_regularizer = keras.regularizers.get(bias_regularizer)
        self.kernel_constraint = keras.constraints.get(kernel_constraint)
        self.bias_constraint = keras.constraints.get(bias_constraint)
        self.seed = seed
        self.seed_generator = keras.random.SeedGenerator(seed) if self.dropout else None
        rotary_embedding = _common.check_rotary_embedding(rotary_embedding)
        if rotary_embedding is not None and self.key_dim % 2:
            raise ValueError(
                f"`rotary_embedding` needs an even `key_dim`. Received: key_dim={key_dim}"
            )
        self.rotary_embedding = rotary_embedding
        self.supports_masking = True

    # Keras's public properties.
    @property
    def sliding_window(self):
        return self._sliding_window

    @property
    def attention_axes(self):
        return self._attention_axes

    @property
    def query_dense(self):
        return self._query_dense

    @property
    def key_dense(self):
        return self._key_dense

    @property
    def value_dense(self):
        return self._value_dense

    @property
    def output_dense(self):
        return self._output_dense

    def build(self, query_shape, value_shape, key_shape=None):
        key_shape = value_shape if key_shape is None else key_shape
        proj.check_shapes(query_shape, value_shape, key_shape)
        for name, shape in (("query", query_shape), ("value", value_shape), ("key", key_shape)):
            if shape[-1] is None:
                raise ValueError(
                    f"The last axis of `{name}` must be known. Received: {name}_shape={tuple(shape)}"
                )
        rank = len(query_shape)
        self._attention_axes = proj.normalize_attention_axes(self._attention_axes, rank)
        self._nd = None
        if rank > 3:
            if self.rotary_embedding is not None:
                raise ValueError(
                    "`rotary_embedding` needs (batch, seq, features) inputs. Received: "
                    f"query_shape={tuple(query_shape)}"
                )
            self._nd = proj.NDLayout(rank + 1, self._attention_axes)
        proj.build_sublayers(self, query_shape, value_shape, key_shape)
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
        attention_bias=None,
        use_causal_mask=False,
        return_attention_scores=False,
        training=None,
        start_index=0,
        cache=None,
        cache_index=None,
    ):
        _dtype_checks.check_float_features("MultiHeadAttention", query=query, value=value, key=key)
        query_mask, value_mask, key_mask, attention_mask = _common.mask_tensors(
            query_mask, value_mask, key_mask, attention_mask
        )
        overridden = type(self)._compute_attention is not MultiHeadAttention._compute_attention
        rows, kwargs = None, {}
        if cache is not None:
            q, k, v, gate, mask, new_cache = _kv_cache.prepare_cached(
                self, query, value, key, cache=cache, cache_index=cache_index,
                query_mask=query_mask, value_mask=value_mask, key_mask=key_mask,
                attention_mask=attention_mask, use_causal_mask=use_causal_mask,
                start_index=start_index,
            )
        elif cache_index is not None:
            raise ValueError(
                "`cache_index` was given without a `cache`. Received: "
                f"cache_index={cache_index!r}, cache=None"
            )
        else:
            q, k, v, gate, mask, rows, kwargs = _mha_attention.prepare_uncached(
                self, query, value, key, query_mask=query_mask, value_mask=value_mask,
                key_mask=key_mask, attention_mask=attention_mask,
                use_causal_mask=use_causal_mask,
                return_attention_scores=return_attention_scores, overridden=overridden,
                start_index=start_index,
            )
        if attention_bias is not None:
            if self._nd is not None:
                raise ValueError(
                    "`attention_bias` needs (batch, seq, features) inputs. Received: "
                    f"query.shape={tuple(query.shape)}"
                )
            kwargs["attention_bias"] = attention_ops.check_bias(
                attention_bias, (q.shape[0], self.num_heads, q.shape[1], k.shape[1]),
                "attention_bias",
            )
        if mask is not None and len(mask.shape) == 4 and mask.shape[1] == 1:
            mask = ops.squeeze(mask, 1)  # Keras's (B, T_q, T_k) layout
        output, scores = self._compute_attention(
            q, k, v, mask, training, return_attention_scores, **kwargs
        )
        if rows is not None:
            # expand_dims, not None-indexing (TFLite runs the latter only with Flex).
            output = output * ops.cast(masking._expand_bool(rows, (2, 3)), output.dtype)
        if gate is not None:
            output = output * gate
        output = project_output(output, self._output_dense)
        result = (output, scores) if return_attention_scores else (output,)
        if cache is not None:
            result += (new_cache,)
        return result if len(result) > 1 else output

    def _compute_attention(
        self,
        query,
        key,
        value,
        attention_mask=None,
        training=None,
        return_attention_scores=False,
        use_causal_mask=False,
        attention_bias=None,
        sliding_window=None,
    ):
        """Attention of projected `query` `(B, T, H, key_dim)`, `key`
        `(B, S, H_kv, key_dim)`, `value` `(B, S, H_kv, value_dim)`.

        Keras's override point, with its signature and return value
        `(output (B, T, H, value_dim), scores (B, H, T, S) or None)`.
        `attention_mask` (True = attend) broadcasts to the scores after
        Keras's expansion (`(B, T, S)` gains the head axis); `use_causal_mask`
        hides later keys too; `sliding_window` keeps the band
        `|i - j| < sliding_window` (built block by block on the blocked
        path); `attention_bias` is added to the logits. For
        rank > 3 inputs, tensors have Keras's N-D layouts.
        """
        return _mha_attention.compute_attention(
            self, query, key, value, attention_mask, training, return_attention_scores,
            use_causal_mask, attention_bias, sliding_window,
        )

    def project_key_value(self, value, key=None):
        """Projected `(key, value)` of `value` (and `key`), for a cross-attention cache.

        Returns `(B, T_k, num_key_value_heads, key_dim)` and
        `(B, T_k, num_key_value_heads, value_dim)`, as used by
        `call(query, None, cache=..., cache_index=None)`. Rotary positions
        (if any) start at 0.
        """
        key_or_value = value if key is None else key
        with masking.hidden_keras_masks(value, key_or_value):
            _, k, v, _ = _mha_attention.project_inputs(self, None, key_or_value, value)
        if self.rotary_embedding is not None:
            k = self.rotary_embedding(k)
        return k, v

    def compute_output_shape(self, query_shape, value_shape, key_shape=None):
        query_shape = tuple(query_shape)
        if value_shape is not None:  # None: a cross-attention cache call
            proj.check_shapes(query_shape, value_shape, key_shape, ranks=False)
        return query_shape[:-1] + tuple(self._output_shape or query_shape[-1:])

    def compute_output_spec(
        self, query, value, key=None, return_attention_scores=False, cache=None,
        cache_index=None, **kwargs
    ):
        _dtype_checks.check_float_features("MultiHeadAttention", query=query, value=value, key=key)
        return _mha_attention.output_spec(self, query, value, key, return_attention_scores, cache)

    @classmethod
    def from_keras(cls, layer):
        """A layer with the same weights and outputs as a built Keras MHA/GQA layer.

        Accepts a built `keras.layers.MultiHeadAttention` (any input rank and
        `attention_axes`) or `keras.layers.GroupQueryAttention`.
        """
        return _mha_convert.from_keras(cls, layer)

    @classmethod
    def from_torch(cls, module, **kwargs):
        """A layer with the weights of a `torch.nn.MultiheadAttention`.

        `in_proj_weight` (or `q/k/v_proj_weight` with `kdim`/`vdim`) and
        `out_proj` are split per head; `bias` is kept. `batch_first` does not
        matter for the weights: call ours with `(batch, seq, features)` inputs.
        Mind the call order: torch `mha(query, key, value)` is ours
        `mha(query, value, key)`, and torch's `key_padding_mask` / `attn_mask`
        use True = *masked*, ours True = attend. Other keyword arguments
        (e.g. `dropout`, `name`) go to the constructor.

        Example:

        >>> import torch
        >>> t = torch.nn.MultiheadAttention(16, 4, batch_first=True)
        >>> ours = MultiHeadAttention.from_torch(t)
        >>> ours.num_heads, ours.key_dim
        (4, 4)
        """
        return _mha_convert.from_torch(cls, module, **kwargs)

    def get_config(self):
        config = super().get_config()
        for name in (
            "num_heads", "key_dim", "value_dim", "dropout", "use_bias", "sliding_window",
            "use_gate", "seed", "num_key_value_heads", "chunk_size",
        ):
            config[name] = getattr(self, name)
        for name in ("kernel_initializer", "bias_initializer"):
            config[name] = keras.initializers.serialize(getattr(self, name))
        for name in ("kernel_regularizer", "bias_regularizer", "activity_regularizer"):
            config[name] = keras.regularizers.serialize(getattr(self, name))
        for name in ("kernel_constraint", "bias_constraint"):
            config[name] = keras.constraints.serialize(getattr(self, name))
        config["output_shape"] = self._output_shape
        config["attention_axes"] = self._attention_axes
        config["rotary_embedding"] = (
            keras.saving.serialize_keras_object(self.rotary_embedding)
            if self.rotary_embedding is not None
            else None
        )
        return config
