"""Multi-head attention: a drop-in for `keras.layers.MultiHeadAttention`, with GQA."""

import keras
from keras import ops

from keras_attn import checks
from keras_attn import saving
from keras_attn.layers import _common
from keras_attn.layers import _kv_cache
from keras_attn.layers import _nd_layout
from keras_attn.layers import _peer_weights
from keras_attn.layers import _projections as proj
from keras_attn.layers.rotary_embedding import check_rotary_embedding
from keras_attn.ops import attention as attention_ops
from keras_attn.ops import dispatch
from keras_attn.ops import masking
from keras_attn.ops import recording
from keras_attn.ops import shapes


@saving.register
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
    - `use_qk_norm`: RMSNorm over each query and key head after the
      projection, before the rotary embedding (Qwen3, Gemma 3).
    - `logit_soft_cap`: logits become `cap * tanh(logits / cap)` (Gemma 2).
    - `use_value_norm`: an RMSNorm without scale over each value head (Gemma 4).
    - `shared_key_value`: a layer without key/value projections that attends
      over another layer's keys and values (`return_key_value=` on that
      layer, `key_value=` on this one; Gemma 4's KV-shared layers).
    - A query row whose keys are all masked outputs zeros (before the output
      projection), never NaN and never an average of the values.

    Args:
        num_heads: number of query heads.
        key_dim: size of each query/key head.
        value_dim: size of each value head; defaults to `key_dim`.
        dropout: dropout rate on the attention probabilities.
        use_bias: whether the projections have biases.
        output_use_bias: whether the output projection has a bias; None
            follows `use_bias` (False with `use_bias=True` is Qwen2's layout:
            biased query/key/value, unbiased output).
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
        use_qk_norm: an RMSNorm (`keras.layers.RMSNormalization`, sublayers
            `query_norm` and `key_norm`, a scale of `key_dim` each) over each
            projected query and key head, before the rotary embedding
            (Dehghani et al., 2023; Qwen3, Gemma 3).
        qk_norm_epsilon: the epsilon of those norms.
        logit_soft_cap: None, or a positive float `c`: the scaled logits
            become `c * tanh(logits / c)` before masks and biases (Gemma 2;
            see `keras_attn.ops.dot_product_attention`).
        use_value_norm: an RMSNorm without scale (epsilon `qk_norm_epsilon`)
            over each projected value head (Gemma 4).
        shared_key_value: True for a layer with no key and value projections
            (nor key norm): every call attends over the keys and values that
            another layer's call returned (`key_value=`), with this layer's
            queries. The other layer must have the same `num_key_value_heads`,
            `key_dim`, `value_dim` and `sliding_window`.

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
        return_key_value: also return (last) the keys and values this call
            attended over, for a `shared_key_value` layer's `key_value=`: an
            opaque object holding, uncached, the projected keys and values
            `(B, T_k, H_kv, D)` (key norm and rotary applied); cached, the
            cache's keys with their positions and validity (ring buffers
            included).
        key_value: a `shared_key_value` layer's keys and values: what another
            layer's call over the same sequence returned with
            `return_key_value=True` (with `cache_index` when that call was
            cached; this layer then takes no `cache` and returns none).

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
        output_use_bias=None,
        use_qk_norm=False,
        qk_norm_epsilon=1e-6,
        logit_soft_cap=None,
        use_value_norm=False,
        shared_key_value=False,
        **kwargs,
    ):
        super().__init__(activity_regularizer=activity_regularizer, **kwargs)
        self.num_heads = checks.check_positive_int("num_heads", num_heads)
        self.key_dim = checks.check_positive_int("key_dim", key_dim)
        self.value_dim = checks.check_positive_int("value_dim", value_dim, allow_none=True) or key_dim
        self.num_key_value_heads = (
            checks.check_num_key_value_heads(num_key_value_heads, num_heads) or num_heads
        )
        self.dropout = checks.check_dropout("dropout", dropout)
        self.chunk_size = checks.check_layer_chunk_size(chunk_size, self.dropout)
        self.use_bias = checks.check_bool("use_bias", use_bias)
        self.output_use_bias = checks.check_bool(
            "output_use_bias", self.use_bias if output_use_bias is None else output_use_bias
        )
        self.use_gate = checks.check_bool("use_gate", use_gate)
        self.use_qk_norm = checks.check_bool("use_qk_norm", use_qk_norm)
        self.qk_norm_epsilon = checks.check_positive_float("qk_norm_epsilon", qk_norm_epsilon)
        self.logit_soft_cap = checks.check_soft_cap("logit_soft_cap", logit_soft_cap)
        self.use_value_norm = checks.check_bool("use_value_norm", use_value_norm)
        self.shared_key_value = checks.check_bool("shared_key_value", shared_key_value)
        if self.logit_soft_cap is not None and flash_attention:
            raise ValueError(
                "Flash attention does not soft-cap logits. Received: flash_attention="
                f"{flash_attention!r}, logit_soft_cap={logit_soft_cap!r}"
            )
        output_shape = proj.check_output_shape(output_shape)
        self._output_shape = output_shape
        self._attention_axes = proj.check_attention_axes(attention_axes)
        self._sliding_window = checks.check_positive_int(
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
        rotary_embedding = check_rotary_embedding(rotary_embedding)
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
        self._attention_axes = _nd_layout.normalize_attention_axes(self._attention_axes, rank)
        self._nd = None
        if rank > 3:
            if self.rotary_embedding is not None:
                raise ValueError(
                    "`rotary_embedding` needs (batch, seq, features) inputs. Received: "
                    f"query_shape={tuple(query_shape)}"
                )
            self._nd = _nd_layout.NDLayout(rank + 1, self._attention_axes)
        self._build_projections(query_shape, value_shape, key_shape)
        self._feature_dims = (query_shape[-1], value_shape[-1], key_shape[-1])
        self.built = True

    def _build_projections(self, query_shape, value_shape, key_shape):
        """The EinsumDense sublayers, in Keras's order (gate before value) so
        that `get_weights()` lists match."""
        rank = len(query_shape)
        heads, kv_heads = self.num_heads, self.num_key_value_heads

        def dense(name, shape, bound_dims, out_dims, activation=None, use_bias=self.use_bias):
            # As Keras: the input's non-feature axes are free, `bound_dims` contracted.
            equation, bias_axes = proj.projection_equation(rank - 1, bound_dims, len(out_dims))
            sublayer = keras.layers.EinsumDense(
                equation,
                output_shape=proj.output_shape_arg(rank - 2 + len(out_dims), out_dims),
                bias_axes=bias_axes if use_bias else None,
                activation=activation,
                name=name,
                kernel_initializer=_common.clone_initializer(self.kernel_initializer),
                bias_initializer=_common.clone_initializer(self.bias_initializer),
                kernel_regularizer=self.kernel_regularizer,
                bias_regularizer=self.bias_regularizer,
                kernel_constraint=self.kernel_constraint,
                bias_constraint=self.bias_constraint,
                dtype=self.dtype_policy,
            )
            sublayer.build(shape)
            return sublayer

        self._query_dense = dense("query", query_shape, 1, (heads, self.key_dim))
        self._key_dense = self._value_dense = None
        if not self.shared_key_value:
            self._key_dense = dense("key", key_shape, 1, (kv_heads, self.key_dim))
        if self.use_gate:
            self._gate_dense = dense("gate", query_shape, 1, (heads, self.value_dim), "sigmoid")
        if not self.shared_key_value:
            self._value_dense = dense("value", value_shape, 1, (kv_heads, self.value_dim))
        self._output_dense = dense(
            "attention_output", tuple(query_shape[:-1]) + (heads, self.value_dim), 2,
            self._output_shape or (query_shape[-1],), use_bias=self.output_use_bias,
        )
        self.query_norm = self.key_norm = None
        if self.use_qk_norm:
            # query = [B, T, H, key_dim]: one scale of key_dim shared by the heads.
            head_shape = tuple(query_shape[:-1]) + (heads, self.key_dim)
            self.query_norm, self.key_norm = (
                keras.layers.RMSNormalization(
                    epsilon=self.qk_norm_epsilon, dtype=self.dtype_policy, name=name
                )
                for name in ("query_norm", "key_norm")
            )
            self.query_norm.build(head_shape)
            if self.shared_key_value:
                self.key_norm = None
            else:
                self.key_norm.build(head_shape)

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
        return_key_value=False,
        key_value=None,
    ):
        masks = _common.attention_call_preamble(
            "MultiHeadAttention", query, value, key,
            query_mask=query_mask, value_mask=value_mask, key_mask=key_mask,
            attention_mask=attention_mask,
        )
        shared = self._check_key_value(key_value, cache, cache_index)
        if cache is None and cache_index is not None and not shared:
            raise ValueError(
                "`cache_index` was given without a `cache`. Received: "
                f"cache_index={cache_index!r}, cache=None"
            )
        self._check_inputs(query, value, key, cached=cache is not None or cache_index is not None)
        # keras_attn.visualize: the probabilities are computed (and recorded)
        # only inside `ops.recording.recording()`.
        # Flash attention never forms them: such a layer is not recorded.
        record = recording.active() and not self._flash_attention
        # `_compute_attention` gets the `AttentionMask` as it is, except an
        # override (Keras's override point takes one boolean tensor) and
        # inputs of rank > 3 (whose mask is Keras's N-D tensor).
        one_tensor = self._nd is not None or (
            type(self)._compute_attention is not MultiHeadAttention._compute_attention
        )
        if cache is not None and cache_index is None:
            # A complete (cross-attention) cache: the query alone is projected.
            value = key = None
        # Another layer's keys and values (`shared`): the query alone is projected.
        kv_inputs = (None, None) if shared else (value if key is None else key, value)
        # query = [B, T_q, H, key_dim]; key = [B, T_k, H_kv, key_dim]
        q, k, v, gate = self._project(
            query, *kv_inputs, start_index=start_index if cache_index is None else cache_index,
        )
        keys = None
        if shared and key_value.cached:
            keys = key_value.keys
            k, v = keys.key, keys.value
        elif shared:
            k, v = key_value.keys
        if cache is not None:
            keys = _kv_cache.attend_to_cache(
                cache, cache_index, k, v, shapes.dim(query, 1), self.sliding_window,
                use_causal_mask,
            )
            k, v = keys.key, keys.value
        mask = self._attention_mask(query, value, key, masks, keys, cache_index, use_causal_mask)
        bias = {}
        if attention_bias is not None:
            bias["attention_bias"] = self._check_attention_bias(attention_bias, query, q, k)
        output, scores = self._compute_attention(
            q, k, v, self._keras_mask(mask, q, k) if one_tensor else mask, training,
            return_attention_scores or record, **bias,
        )
        if record and scores is not None:
            recording.add(self, scores, mask.dense(shapes.dim(q, 1), shapes.dim(k, 1)))
        if gate is not None:
            output = output * gate
        output = self._project_output(output)
        result = (output, scores) if return_attention_scores else (output,)
        if cache is not None:
            result += (keys.new_cache,)
        if return_key_value:
            result += (_kv_cache.KeyValue(keys if keys is not None else (k, v), keys is not None),)
        return result if len(result) > 1 else output

    def _check_key_value(self, key_value, cache, cache_index):
        """Whether this call attends over another layer's keys (`key_value`)."""
        if not self.shared_key_value:
            if key_value is not None:
                raise ValueError(
                    "`key_value` is for a layer built with `shared_key_value=True`; this one "
                    "projects its own keys and values. Received: key_value="
                    f"{type(key_value).__name__}"
                )
            return False
        if (
            cache is not None or not isinstance(key_value, _kv_cache.KeyValue)
            or key_value.cached != (cache_index is not None)
        ):
            raise ValueError(
                "A layer with `shared_key_value=True` has no keys, values or cache of its own: "
                "pass `key_value=`, what another layer's call returned with "
                "`return_key_value=True` (with `cache_index` if and only if that call was "
                f"cached), and no `cache`. Received: key_value={type(key_value).__name__}, "
                f"cache={'None' if cache is None else 'given'}, cache_index={cache_index!r}"
            )
        return True

    def _check_inputs(self, query, value, key, cached):
        """Ranks and feature sizes of a call against what the layer was built for."""
        d_q, d_v, d_k = self._feature_dims
        if cached:
            if len(query.shape) != 3 or query.shape[-1] not in (None, d_q):
                raise ValueError(
                    f"Expected `query` of shape (batch, seq, {d_q}). Received: "
                    f"query.shape={tuple(query.shape)}"
                )
            return
        key = value if key is None else key
        features = (("query", query, d_q), ("value", value, d_v), ("key", key, d_k))
        if self._nd is None:
            checks.check_attention_inputs(query, value, key, feature_checks=features)
            return
        proj.check_shapes(query.shape, value.shape, key.shape)
        for name, x, expected in features:
            if len(x.shape) != len(query.shape) or x.shape[-1] not in (None, expected):
                raise ValueError(
                    f"The layer was built for `{name}` of rank {len(query.shape)} with "
                    f"{expected} features. Received: {name}.shape={tuple(x.shape)}"
                )

    def _project(self, query, key, value, start_index=0):
        """`(q, k, v, gate)` (None for an input given as None, and for the
        gate without `use_gate`), rotary positions from `start_index`.

        With `KernelPlan.fused_projections`, the projections of each input
        tensor are computed together (`proj.project`): one matmul for
        self-attention, query and gate in one and key and value in another
        for cross-attention.
        """
        denses = (
            self._query_dense,
            self._key_dense,
            self._value_dense,
            self._gate_dense if self.use_gate else None,
        )
        inputs = (query, key, value, query)
        fused = dispatch.select_kernel().fused_projections
        with masking.hidden_keras_masks(query, key, value):
            groups = {}
            for x, dense in zip(inputs, denses):
                if x is not None and dense is not None:
                    groups.setdefault(id(x), (x, []))[1].append(dense)
            results = {}
            for x, group in groups.values():
                outputs = proj.project(x, group) if fused else [d(x) for d in group]
                results.update(zip(map(id, group), outputs))
        q, k, v, gate = (results.get(id(dense)) for dense in denses)
        if self.use_qk_norm:
            q = None if q is None else self.query_norm(q)
            k = None if k is None else self.key_norm(k)
        if self.use_value_norm and v is not None:
            v = _common.rms_normalize(v, self.qk_norm_epsilon)
        if self.rotary_embedding is not None:
            if q is not None:
                q = self.rotary_embedding(q, start_index=start_index)
            if k is not None:
                k = self.rotary_embedding(k, start_index=start_index)
        return q, k, v, gate

    def _project_output(self, output):
        if dispatch.select_kernel().fused_projections:
            return proj.project_output(output, self._output_dense)
        return self._output_dense(output)

    def _attention_mask(self, query, value, key, masks, keys, cache_index, use_causal_mask):
        """The call's one `masking.AttentionMask`, built from positions.

        Uncached, the mask of every attention layer
        (`_common.merge_attention_masks`): the causal / window band stays a
        description for the kernel, and the query padding apart. With a
        cache (`keys`, a `_kv_cache.CachedKeys`, supplies the keys'
        positions and which slots hold one), the band between those
        positions is part of the boolean mask
        (`masking.mask_from_positions`). For inputs of rank > 3, Keras's N-D
        mask (`_nd_layout.nd_mask`).
        """
        query_mask, value_mask, key_mask, attention_mask = masks
        if self._nd is not None:
            return masking.AttentionMask(_nd_layout.nd_mask(
                query, value, query_mask, value_mask, key_mask, attention_mask,
                use_causal_mask, self.sliding_window,
            ))
        if keys is None:
            return _common.merge_attention_masks(
                query, value, key, query_mask=query_mask, value_mask=value_mask,
                key_mask=key_mask, attention_mask=attention_mask,
                use_causal_mask=use_causal_mask, num_heads=self.num_heads,
                sliding_window=self.sliding_window,
            )
        checks.check_padding_mask("query_mask", query_mask, query, "query")
        t_q = shapes.dim(query, 1)
        key_valid = masking.combine_masks(keys.valid, *(
            _kv_cache.key_padding(name, m, keys, t_q, cache_index)
            for name, m in (("value_mask", value_mask), ("key_mask", key_mask))
            if m is not None
        ))
        if keys.ring and attention_mask is not None:
            raise ValueError(
                "`attention_mask` is not supported with a ring-buffer cache (its "
                "slots hold changing positions); a `(B, T_q)` padding mask of "
                "the new tokens is. Received: attention_mask.shape="
                f"{tuple(attention_mask.shape)}"
            )
        complete = cache_index is None  # a complete cross-attention cache has no band
        mask = masking.mask_from_positions(
            keys.query_positions, keys.positions, is_causal=bool(use_causal_mask) and not complete,
            sliding_window=None if complete else self.sliding_window, key_valid=key_valid,
            attention_mask=masking.normalize_attention_mask(
                attention_mask, batch_size=query.shape[0], query_length=query.shape[1],
                key_length=keys.new_cache[0].shape[1], num_heads=self.num_heads,
            ),
        )
        return masking.AttentionMask(mask, query_valid=masking.as_bool(query_mask))

    def _keras_mask(self, mask, query, key):
        """`mask` (an `AttentionMask`) as the one boolean tensor Keras's
        `_compute_attention` takes: `(B|1, T_q, T_k)`, or `(B|1, H, T_q, T_k)`
        when it varies by head (N-D inputs: Keras's N-D layout)."""
        dense = mask.dense(shapes.dim(query, 1), shapes.dim(key, 1))
        if self._nd is None and dense is not None and dense.shape[1] == 1:
            dense = ops.squeeze(dense, 1)
        return dense

    def _check_attention_bias(self, attention_bias, query, q, k):
        """`attention_bias` against the projected `q` and `k` (an input `query`
        of rank > 3 takes none)."""
        if self._nd is not None:
            raise ValueError(
                "`attention_bias` needs (batch, seq, features) inputs. Received: "
                f"query.shape={tuple(query.shape)}"
            )
        return checks.check_bias(
            attention_bias, (q.shape[0], self.num_heads, q.shape[1], k.shape[1]),
            "attention_bias",
        )

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

        The layer's own call passes its `masking.AttentionMask` as
        `attention_mask` (band and query padding included), which goes to
        `keras_attn.ops.dot_product_attention` as it is; an override gets
        the one boolean tensor instead.
        """
        if self._flash_attention and return_attention_scores:
            raise ValueError(
                "Returning attention scores is not supported when flash "
                "attention is enabled. Please disable flash attention to access"
                " attention scores."
            )
        # Called directly (an override calling super()), inputs may be NumPy.
        query, key, value = (ops.convert_to_tensor(x) for x in (query, key, value))
        if not isinstance(attention_mask, masking.AttentionMask):
            # Keras's one boolean tensor: from an override, N-D inputs, a direct call.
            if attention_mask is not None:
                attention_mask = ops.convert_to_tensor(attention_mask)
                checks.check_mask_dtype("attention_mask", attention_mask)
                attention_mask = masking.as_bool(attention_mask)
            if len(query.shape) > 4:
                return self._compute_nd_attention(
                    query, key, value, attention_mask, training, return_attention_scores,
                    use_causal_mask,
                )
            if attention_mask is not None:
                while len(attention_mask.shape) < 4:  # Keras's layout
                    attention_mask = ops.expand_dims(attention_mask, -3)
        result = attention_ops.dot_product_attention(
            query,
            key,
            value,
            attention_mask=attention_mask,
            bias=attention_bias,
            is_causal=bool(use_causal_mask),
            dropout_rate=self.dropout,
            training=bool(training),
            seed=self.seed_generator,
            return_attention_scores=return_attention_scores,
            chunk_size=self.chunk_size,
            sliding_window=sliding_window,
            flash_attention=self._flash_attention or None,
            logit_soft_cap=self.logit_soft_cap,
        )
        return result if return_attention_scores else (result, None)

    def _compute_nd_attention(self, query, key, value, mask, training, return_scores, causal):
        # Folded to (B', T_q', H, D) with the attention axes flattened, then back.
        layout = self._nd or _nd_layout.NDLayout(len(query.shape), self._attention_axes)
        if causal:
            mask = _nd_layout.nd_mask(query, value, None, None, None, mask, True, None)
        q, batch, q_seq = layout.fold(query)
        k, _, k_seq = layout.fold(key)
        v, _, _ = layout.fold(value)
        if mask is not None:
            mask = layout.fold_mask(mask, batch, q_seq, k_seq)
        output, scores = self._compute_attention(q, k, v, mask, training, return_scores)
        output = layout.unfold_output(output, batch, q_seq)
        if scores is not None:
            scores = layout.unfold_scores(scores, batch, q_seq, k_seq)
        return output, scores

    def project_key_value(self, value, key=None):
        """Projected `(key, value)` of `value` (and `key`), for a cross-attention cache.

        Returns `(B, T_k, num_key_value_heads, key_dim)` and
        `(B, T_k, num_key_value_heads, value_dim)`, as used by
        `call(query, None, cache=..., cache_index=None)`. Rotary positions
        (if any) start at 0.
        """
        _, k, v, _ = self._project(None, value if key is None else key, value)
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
        checks.check_float_features("MultiHeadAttention", query=query, value=value, key=key)
        shapes_in = [None if x is None else x.shape for x in (query, value, key)]
        result = (keras.KerasTensor(self.compute_output_shape(*shapes_in), dtype=self.compute_dtype),)
        if return_attention_scores:
            shape = _nd_layout.scores_shape(
                query.shape, None if cache is not None else value.shape,
                self._attention_axes, self.num_heads,
                None if cache is None else cache[0].shape[1],
            )
            result += (keras.KerasTensor(shape, dtype=self.compute_dtype),)
        if cache is not None:
            result += (tuple(keras.KerasTensor(c.shape, dtype=c.dtype) for c in cache),)
        return result if len(result) > 1 else result[0]

    @classmethod
    def from_keras(cls, layer):
        """A layer with the same weights and outputs as a built Keras MHA/GQA layer.

        Accepts a built `keras.layers.MultiHeadAttention` (any input rank and
        `attention_axes`) or `keras.layers.GroupQueryAttention`.
        """
        return _peer_weights.mha_from_keras(cls, layer)

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
        return _peer_weights.mha_from_torch(cls, module, **kwargs)

    def get_config(self):
        config = super().get_config()
        for name in (
            "num_heads", "key_dim", "value_dim", "dropout", "use_bias", "sliding_window",
            "use_gate", "seed", "num_key_value_heads", "chunk_size", "output_use_bias",
            "use_qk_norm", "qk_norm_epsilon", "logit_soft_cap", "use_value_norm",
            "shared_key_value",
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
