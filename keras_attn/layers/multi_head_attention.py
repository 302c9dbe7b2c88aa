"""Multi-head attention: a drop-in for `keras.layers.MultiHeadAttention`, with GQA."""

import itertools
import math
import string

import keras
from keras import ops

from keras_attn.layers import _common
from keras_attn.layers import _dtype_checks
from keras_attn.layers import _positions
from keras_attn.layers.rotary_embedding import RotaryEmbedding
from keras_attn.ops import attention as attention_ops
from keras_attn.ops import masking


def _output_projection_equation(num_output_dims):
    letters = string.ascii_lowercase[4 : 4 + num_output_dims]
    return f"abcd,cd{letters}->ab{letters}", letters


def _plain(dense):
    """Can `dense` (an EinsumDense) be computed from its `kernel`/`bias` as a
    2-D matmul? Not when quantized (its call dequantizes)."""
    return dense.built and dense.quantization_mode is None


def _seq_dims(x):
    return [x.shape[a] if x.shape[a] is not None else ops.shape(x)[a] for a in (0, 1)]


def project(x, denses):
    """`[dense(x) for dense in denses]` for `"abc,cde->abde"` EinsumDense
    projections of one `(B, T, features)` input, as ONE 2-D matmul.

    The kernels `(features, heads, size)` are concatenated as
    `(features, sum(heads * size))` at call time (a copy of the weights, not
    of activations) and the `(B * T, ...)` product is split: for
    self-attention the query, key and value projections become one larger
    matmul (and one in each direction of the backward pass), which oneDNN
    runs faster than three small ones (benchmarks/README.md). The variables
    stay those of the separate projections, so weights, checkpoints and
    `from_keras` are unchanged. Quantized projections are called as layers.
    """
    if not all(_plain(d) for d in denses) or len({d.bias is None for d in denses}) > 1:
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
    """`dense(x)` for the `"abcd,cd...->ab..."` output projection of
    `(B, T, heads, size)`, as a 2-D matmul over `(B * T, heads * size)`."""
    if not _plain(dense):
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


def _key_padding_over_cache(name, mask, length, t_q, cache_index, ring, key_cache):
    """A `(B, T)` key padding mask of a cached call, as a mask over the keys
    attended to: the cache axis `(B, length)`, plus the new block for a ring
    buffer. `T` may be the cache length (a mask over the cache axis) or, when
    new tokens are written (`cache_index` given), `T_q` (their own mask, e.g.
    the Keras mask of the new tokens; earlier positions stay visible)."""
    masking._check_mask_dtype(name, mask)
    if len(mask.shape) != 2:
        raise ValueError(
            f"Expected `{name}` of shape (batch, length) in a cached call. "
            f"Received: {name}.shape={tuple(mask.shape)}"
        )
    mask = masking._as_bool(mask)
    n = mask.shape[1]
    static_t_q = t_q if isinstance(t_q, int) else None
    covers_cache = n == length and not ring
    covers_new = cache_index is not None and (n is None or n == static_t_q or static_t_q is None)
    if covers_cache or (n == length and cache_index is None):
        return mask
    if not covers_new:
        expected = f"(batch, {length})" + (
            "" if cache_index is None else f" or the new tokens' (batch, {static_t_q})"
        )
        if ring:
            expected = f"the new tokens' (batch, {static_t_q}) (a ring-buffer cache)"
        raise ValueError(
            f"Received an invalid `{name}` shape for a cached call: "
            f"{tuple(mask.shape)}. Expected {expected}."
        )
    earlier = ops.cast(ops.ones_like(key_cache[:, :, 0, 0]), "bool")
    if ring:
        # Keys are the cache as it was, then the new block.
        return ops.concatenate([earlier, mask], axis=1)
    # Non-ring: the new tokens sit at slots [cache_index, cache_index + T_q).
    relative = ops.arange(length, dtype="int32") - ops.cast(cache_index, "int32")
    is_new = ops.logical_and(ops.greater_equal(relative, 0), ops.less(relative, t_q))
    index = ops.clip(relative, 0, ops.maximum(t_q - 1, 0))
    # Gathered as int32: TFLite gathers booleans only with Flex.
    placed = ops.take(ops.cast(mask, "int32"), index, axis=1) > 0
    return ops.where(ops.expand_dims(is_new, 0), placed, earlier)

def _check_cache(cache, static_length=True):
    if (
        not isinstance(cache, (tuple, list))
        or len(cache) != 2
        or any(len(getattr(c, "shape", ())) != 4 for c in cache)
    ):
        raise ValueError(
            "Received an invalid value for argument `cache`, expected a pair "
            "`(key_cache, value_cache)` of rank-4 tensors `(batch, max_length, "
            f"num_key_value_heads, head_dim)`. Received: cache={cache!r}"
        )
    if static_length and cache[0].shape[1] is None:
        raise ValueError(
            "The cache length (axis 1) must be static. Received: "
            f"key_cache.shape={tuple(cache[0].shape)}"
        )
    return cache[0], cache[1]


def write_cache(cache, new, index, ring=False):
    """Writes `new` `(B, T, H, D)` into `cache` `(B, L, H, D)` at `index`.

    Positions `[index, index + T)` of the cache are replaced (slots modulo `L`
    when `ring`; of a block longer than `L` only its last `L` positions stay).
    Written as an index comparison, a gather and a `where` over the cache
    axis, so the update lowers to TFLite builtins and ONNX (no
    `XlaDynamicUpdateSlice`, no scatter) and keeps the cache's static shape.
    """
    length = cache.shape[1]
    new = ops.cast(new, cache.dtype)
    index = ops.cast(index, "int32")
    slots = ops.arange(length, dtype="int32")
    t = new.shape[1]
    if t == 1:
        hit = ops.equal(slots, index % length if ring else index)
        return ops.where(ops.reshape(hit, (1, length, 1, 1)), new, cache)
    t = ops.shape(new)[1] if t is None else t
    if ring:
        last = index + t - 1
        offset = last - ops.mod(last - slots, length) - index
    else:
        offset = slots - index
    inside = ops.logical_and(ops.greater_equal(offset, 0), ops.less(offset, t))
    placed = ops.take(new, ops.clip(offset, 0, t - 1), axis=1)
    return ops.where(ops.reshape(inside, (1, length, 1, 1)), placed, cache)


def check_cache_write(cache_length, num_new, cache_index, ring=False):
    """Raises a ValueError when writing positions past the end of a cache is statically known.

    `write_cache` keeps the cache's static shape and drops positions
    `>= cache_length`, so an oversized write would silently give attention
    over missing keys. Writing `num_new` positions at `cache_index` must stay
    within `[0, cache_length)`. Checked when `cache_index` is a Python/NumPy
    integer and the lengths are static ints; also when `num_new` alone
    exceeds the cache (whatever the index). A ring buffer (`ring=True`, a
    sliding window equal to the cache length) wraps and is never checked.
    Tensor values are left to the caller (e.g. bound `max_length`).

    Args:
        cache_length: slots of the cache (`cache.shape[1]`), int or None.
        num_new: number of new positions (`new.shape[1]`), int or None.
        cache_index: position of the first new token (int or tensor).
        ring: whether the cache is a ring buffer.
    """
    if ring or cache_length is None or num_new is None:
        return
    index = _positions.static_int(cache_index)
    if index is not None and index < 0:
        raise ValueError(
            "Received an invalid value for argument `cache_index`, expected a "
            f"non-negative integer. Received: cache_index={index}"
        )
    end = num_new if index is None else index + num_new
    if end > cache_length:
        where = (f"{num_new} new positions" if index is None
                 else f"positions [{index}, {end}) (cache_index={index}, {num_new} new token(s))")
        raise ValueError(
            f"The key/value cache holds {cache_length} positions, but {where} were "
            f"to be written into it; positions past its end would be dropped. "
            f"Create the cache with `max_length` >= {end}. Received: cache "
            f"length={cache_length}, cache_index={cache_index!r}, new tokens={num_new}"
        )


def ring_positions(length, index):
    """Absolute position held by each slot of a ring cache before writing at `index`.

    Negative where the slot was never written.
    """
    slots = ops.arange(length, dtype="int32")
    previous = ops.cast(index, "int32") - 1
    return previous - ops.mod(previous - slots, length)


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
        attention_axes: only None (or the sequence axis) is supported.
        sliding_window: if set, each query sees keys within
            `sliding_window - 1` positions (as Keras).
        flash_attention: accepted for compatibility; only None/False.
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
            _common.check_positive_int("num_key_value_heads", num_key_value_heads, allow_none=True)
            or num_heads
        )
        if num_heads % self.num_key_value_heads:
            raise ValueError(
                "Received an invalid value for argument `num_key_value_heads`, "
                f"expected a divisor of num_heads={num_heads}. Received: "
                f"num_key_value_heads={num_key_value_heads}"
            )
        self.dropout = _common.check_dropout("dropout", dropout)
        self.chunk_size = _common.check_chunk_size(chunk_size, self.dropout)
        self.use_bias = _common.check_bool("use_bias", use_bias)
        self.use_gate = _common.check_bool("use_gate", use_gate)
        if output_shape is not None:
            if isinstance(output_shape, int):
                output_shape = (output_shape,)
            if not isinstance(output_shape, (tuple, list)) or not output_shape or not all(
                isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in output_shape
            ):
                raise ValueError(
                    "Received an invalid value for argument `output_shape`, "
                    "expected a positive int or a tuple of positive ints. "
                    f"Received: output_shape={output_shape!r}"
                )
            output_shape = tuple(output_shape)
        self._output_shape = output_shape
        if attention_axes not in (None, 1, (1,), [1], -2, (-2,), [-2]):
            raise ValueError(
                "keras_attn.layers.MultiHeadAttention attends over one sequence "
                "axis of (batch, seq, features) inputs; `attention_axes` must be "
                f"None or 1. Received: attention_axes={attention_axes!r}. Reshape "
                "multi-axis inputs to one sequence axis."
            )
        self.sliding_window = _common.check_positive_int(
            "sliding_window", sliding_window, allow_none=True
        )
        if flash_attention:
            raise ValueError(
                "`flash_attention=True` is not available; keras_attn runs exact "
                "attention through keras_attn.ops. Received: flash_attention=True"
            )
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self.bias_initializer = keras.initializers.get(bias_initializer)
        self.kernel_regularizer = keras.regularizers.get(kernel_regularizer)
        self.bias_regularizer = keras.regularizers.get(bias_regularizer)
        self.kernel_constraint = keras.constraints.get(kernel_constraint)
        self.bias_constraint = keras.constraints.get(bias_constraint)
        self.seed = seed
        self.seed_generator = keras.random.SeedGenerator(seed) if self.dropout else None
        if isinstance(rotary_embedding, dict):
            rotary_embedding = keras.saving.deserialize_keras_object(rotary_embedding)
        if rotary_embedding is not None and not isinstance(rotary_embedding, RotaryEmbedding):
            raise TypeError(
                "Received an invalid value for argument `rotary_embedding`, "
                "expected a keras_attn.layers.RotaryEmbedding or None. Received: "
                f"rotary_embedding={rotary_embedding!r}"
            )
        if rotary_embedding is not None and self.key_dim % 2:
            raise ValueError(
                f"`rotary_embedding` needs an even `key_dim`. Received: key_dim={key_dim}"
            )
        self.rotary_embedding = rotary_embedding
        self.supports_masking = True

    def _dense_kwargs(self):
        return dict(
            kernel_initializer=_common.clone_initializer(self.kernel_initializer),
            bias_initializer=_common.clone_initializer(self.bias_initializer),
            kernel_regularizer=self.kernel_regularizer,
            bias_regularizer=self.bias_regularizer,
            kernel_constraint=self.kernel_constraint,
            bias_constraint=self.bias_constraint,
            dtype=self.dtype_policy,
        )

    def _projection(self, name, heads, head_dim, activation=None):
        return keras.layers.EinsumDense(
            "abc,cde->abde",
            output_shape=(None, heads, head_dim),
            bias_axes="de" if self.use_bias else None,
            activation=activation,
            name=name,
            **self._dense_kwargs(),
        )

    def build(self, query_shape, value_shape, key_shape=None):
        key_shape = value_shape if key_shape is None else key_shape
        layout = "(batch, seq, features)"
        _common.check_shape_rank("query", query_shape, 3, layout)
        _common.check_shape_rank("value", value_shape, 3, layout)
        _common.check_shape_rank("key", key_shape, 3, layout)
        if value_shape[1] is not None and key_shape[1] is not None and value_shape[1] != key_shape[1]:
            raise ValueError(
                "`value` and `key` must have the same sequence length. Received: "
                f"value_shape={tuple(value_shape)}, key_shape={tuple(key_shape)}"
            )
        for name, shape in (("query", query_shape), ("value", value_shape), ("key", key_shape)):
            if shape[-1] is None:
                raise ValueError(
                    f"The last axis of `{name}` must be known. Received: {name}_shape={tuple(shape)}"
                )
        self._query_dense = self._projection("query", self.num_heads, self.key_dim)
        self._query_dense.build(query_shape)
        self._key_dense = self._projection("key", self.num_key_value_heads, self.key_dim)
        self._key_dense.build(key_shape)
        self._value_dense = self._projection("value", self.num_key_value_heads, self.value_dim)
        self._value_dense.build(value_shape)
        if self.use_gate:
            self._gate_dense = self._projection("gate", self.num_heads, self.value_dim, "sigmoid")
            self._gate_dense.build(query_shape)
        out_dims = self._output_shape or (query_shape[-1],)
        equation, letters = _output_projection_equation(len(out_dims))
        self._output_dense = keras.layers.EinsumDense(
            equation,
            output_shape=(None,) + tuple(out_dims),
            bias_axes=letters if self.use_bias else None,
            name="attention_output",
            **self._dense_kwargs(),
        )
        self._output_dense.build((query_shape[0], query_shape[1], self.num_heads, self.value_dim))
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
        if cache is not None:
            return self._call_with_cache(
                query,
                value,
                key,
                cache=cache,
                cache_index=cache_index,
                query_mask=query_mask,
                value_mask=value_mask,
                key_mask=key_mask,
                attention_mask=attention_mask,
                attention_bias=attention_bias,
                use_causal_mask=use_causal_mask,
                return_attention_scores=return_attention_scores,
                training=training,
                start_index=start_index,
            )
        if cache_index is not None:
            raise ValueError(
                "`cache_index` was given without a `cache`. Received: "
                f"cache_index={cache_index!r}, cache=None"
            )
        key_or_value = value if key is None else key
        d_q, d_v, d_k = self._feature_dims
        _common.check_attention_inputs(
            query,
            value,
            key_or_value,
            feature_checks=(("query", query, d_q), ("value", value, d_v), ("key", key_or_value, d_k)),
        )
        # A query padding mask only zeroes whole output rows: applied to the
        # `(B, T_q, H, D)` output, it leaves a key-only mask that the
        # attention core adds to the logits for free (see
        # `keras_attn.ops.dot_product_attention`). Scores keep the merged mask.
        rows = None
        if query_mask is not None and not return_attention_scores:
            _common.check_padding_mask("query_mask", query_mask, query, "query")
            rows, query_mask = masking._as_bool(query_mask), None
        mask = _common.merge_attention_masks(
            query,
            value,
            key,
            query_mask=query_mask,
            value_mask=value_mask,
            key_mask=key_mask,
            attention_mask=attention_mask,
            # The causal mask is built by the ops (blockwise on the chunked
            # path, never as a (T_q, T_k) tensor there).
            use_causal_mask=False,
            num_heads=self.num_heads,
            sliding_window=self.sliding_window,
        )
        # query = [B, T_q, H, key_dim]; key = [B, T_k, H_kv, key_dim]
        with masking.hidden_keras_masks(query, value, key_or_value):
            q, k, v, gate = self._project_inputs(query, key_or_value, value)
        if self.rotary_embedding is not None:
            q = self.rotary_embedding(q, start_index=start_index)
            k = self.rotary_embedding(k, start_index=start_index)
        attention_bias = attention_ops.check_bias(
            attention_bias, (q.shape[0], self.num_heads, q.shape[1], k.shape[1]), "attention_bias"
        )
        result = attention_ops.dot_product_attention(
            q,
            k,
            v,
            attention_mask=mask,
            bias=attention_bias,
            is_causal=bool(use_causal_mask),
            scale=None,
            dropout_rate=self.dropout,
            training=bool(training),
            seed=self.seed_generator,
            return_attention_scores=return_attention_scores,
            chunk_size=self.chunk_size,
        )
        output, scores = result if return_attention_scores else (result, None)
        # output = [B, T_q, H, value_dim]
        if rows is not None:
            # expand_dims, not None-indexing (TFLite runs the latter only with Flex).
            output = output * ops.cast(masking._expand_bool(rows, (2, 3)), output.dtype)
        if gate is not None:
            output = output * gate
        output = project_output(output, self._output_dense)
        if return_attention_scores:
            return output, scores
        return output

    def _project_inputs(self, query, key, value):
        """`(q, k, v, gate)`: the projections of each input tensor computed
        together (`project`): one matmul for self-attention, query and gate
        in one and key and value in another for cross-attention. An input
        given as None (and the gate without `use_gate`) gives None."""
        denses = (
            self._query_dense,
            self._key_dense,
            self._value_dense,
            self._gate_dense if self.use_gate else None,
        )
        groups = {}
        for x, dense in zip((query, key, value, query), denses):
            if x is not None and dense is not None:
                groups.setdefault(id(x), (x, []))[1].append(dense)
        results = {}
        for x, group in groups.values():
            results.update(zip(map(id, group), project(x, group)))
        return tuple(results.get(id(dense)) for dense in denses)

    def project_key_value(self, value, key=None):
        """Projected `(key, value)` of `value` (and `key`), for a cross-attention cache.

        Returns `(B, T_k, num_key_value_heads, key_dim)` and
        `(B, T_k, num_key_value_heads, value_dim)`, as used by
        `call(query, None, cache=..., cache_index=None)`. Rotary positions
        (if any) start at 0.
        """
        key_or_value = value if key is None else key
        with masking.hidden_keras_masks(value, key_or_value):
            _, k, v, _ = self._project_inputs(None, key_or_value, value)
        if self.rotary_embedding is not None:
            k = self.rotary_embedding(k)
        return k, v

    def _call_with_cache(
        self,
        query,
        value,
        key,
        *,
        cache,
        cache_index,
        query_mask,
        value_mask,
        key_mask,
        attention_mask,
        attention_bias,
        use_causal_mask,
        return_attention_scores,
        training,
        start_index,
    ):
        """Attention over a key/value cache; returns the updated cache last.

        With `cache_index=None` the cache is complete (cross-attention keys
        and values from `project_key_value`) and is used as is; `value` may be
        None. Otherwise the keys/values of `value` (the new tokens, positions
        `[cache_index, cache_index + T_q)`) are written into the cache first,
        and keys at positions `>= cache_index + T_q` are hidden. Masks over
        keys (`value_mask`, `key_mask`, `attention_mask`) cover the cache
        axis; a `(B, T_q)` key padding mask (e.g. the Keras mask of the new
        tokens) covers the new tokens only, earlier positions stay visible.
        When `sliding_window` equals the cache length the cache is a ring
        buffer (slot = position mod length), bounding memory for long
        generation.
        """
        key_cache, value_cache = _check_cache(cache, static_length=cache_index is not None)
        d_q = self._feature_dims[0]
        if len(query.shape) != 3 or (query.shape[-1] is not None and query.shape[-1] != d_q):
            raise ValueError(
                f"Expected `query` of shape (batch, seq, {d_q}). Received: "
                f"query.shape={tuple(query.shape)}"
            )
        length = key_cache.shape[1]
        t_q = query.shape[1] if query.shape[1] is not None else ops.shape(query)[1]
        ring = False
        mask_parts = []
        if cache_index is None:
            # query = [B, T_q, H, key_dim]
            with masking.hidden_keras_masks(query):
                q, _, _, gate = self._project_inputs(query, None, None)
            if self.rotary_embedding is not None:
                q = self.rotary_embedding(q, start_index=start_index)
            k, v = key_cache, value_cache
            new_cache = (key_cache, value_cache)
        else:
            key_or_value = value if key is None else key
            with masking.hidden_keras_masks(query, value, key_or_value):
                q, k_new, v_new, gate = self._project_inputs(query, key_or_value, value)
            if self.rotary_embedding is not None:
                q = self.rotary_embedding(q, start_index=cache_index)
                k_new = self.rotary_embedding(k_new, start_index=cache_index)
            ring = self.sliding_window is not None and self.sliding_window == length
            check_cache_write(length, k_new.shape[1], cache_index, ring=ring)
            q_pos = ops.arange(t_q, dtype="int32") + ops.cast(cache_index, "int32")
            new_pos = ops.arange(t_q, dtype="int32") + ops.cast(cache_index, "int32")
            if ring:
                # Attend over the cache as it was (slots hold earlier
                # positions) plus the new block, so a block may wrap around.
                old_pos = ring_positions(length, cache_index)
                k_pos = ops.concatenate([old_pos, new_pos])
                k = ops.concatenate([key_cache, ops.cast(k_new, key_cache.dtype)], axis=1)
                v = ops.concatenate([value_cache, ops.cast(v_new, value_cache.dtype)], axis=1)
                visible = ops.expand_dims(ops.greater_equal(k_pos, 0), 0)
                if not use_causal_mask:
                    raise ValueError(
                        "A ring-buffer cache (sliding_window == cache length) needs "
                        "`use_causal_mask=True`. Received: use_causal_mask=False"
                    )
            else:
                k_pos = ops.arange(length, dtype="int32")
                k = write_cache(key_cache, k_new, cache_index)
                v = write_cache(value_cache, v_new, cache_index)
                # Slots after the new block hold nothing yet.
                visible = ops.less(k_pos[None, :], q_pos[-1] + 1)
            diff = q_pos[:, None] - k_pos[None, :]
            if use_causal_mask:
                visible = ops.logical_and(visible, ops.greater_equal(diff, 0))
            if self.sliding_window is not None:
                visible = ops.logical_and(visible, ops.less(ops.abs(diff), self.sliding_window))
            # Expanded with reshape: None-indexing a bool tensor needs Flex in TFLite.
            mask_parts.append(ops.expand_dims(ops.expand_dims(visible, 0), 0))
            if ring:
                new_cache = (
                    write_cache(key_cache, k_new, cache_index, ring=True),
                    write_cache(value_cache, v_new, cache_index, ring=True),
                )
            else:
                new_cache = (k, v)
        if ring and attention_mask is not None:
            raise ValueError(
                "`attention_mask` is not supported with a ring-buffer cache (its "
                "slots hold changing positions); a `(B, T_q)` padding mask of "
                "the new tokens is. Received: attention_mask.shape="
                f"{tuple(attention_mask.shape)}"
            )
        for name, key_padding in (("value_mask", value_mask), ("key_mask", key_mask)):
            if key_padding is not None:
                key_padding = _key_padding_over_cache(
                    name, key_padding, length, t_q, cache_index, ring, key_cache
                )
                mask_parts.append(masking.padding_mask_to_attention_mask(value_mask=key_padding))
        if query_mask is not None:
            mask_parts.append(masking.padding_mask_to_attention_mask(query_mask=query_mask))
        mask_parts.append(
            masking.normalize_attention_mask(
                attention_mask,
                batch_size=query.shape[0],
                query_length=query.shape[1],
                key_length=length,
                num_heads=self.num_heads,
            )
        )
        mask = masking.combine_masks(*mask_parts)
        attention_bias = attention_ops.check_bias(
            attention_bias, (q.shape[0], self.num_heads, q.shape[1], k.shape[1]), "attention_bias"
        )
        result = attention_ops.dot_product_attention(
            q,
            k,
            v,
            attention_mask=mask,
            bias=attention_bias,
            scale=None,
            dropout_rate=self.dropout,
            training=bool(training),
            seed=self.seed_generator,
            return_attention_scores=return_attention_scores,
        )
        output, scores = result if return_attention_scores else (result, None)
        # output = [B, T_q, H, value_dim]
        if gate is not None:
            output = output * gate
        output = project_output(output, self._output_dense)
        if return_attention_scores:
            return output, scores, new_cache
        return output, new_cache

    def compute_output_shape(self, query_shape, value_shape, key_shape=None):
        out_dims = self._output_shape or (query_shape[-1],)
        return tuple(query_shape[:-1]) + tuple(out_dims)

    def compute_output_spec(
        self, query, value, key=None, return_attention_scores=False, **kwargs
    ):
        _dtype_checks.check_float_features("MultiHeadAttention", query=query, value=value, key=key)
        out = keras.KerasTensor(
            self.compute_output_shape(query.shape, value.shape), dtype=self.compute_dtype
        )
        if not return_attention_scores:
            return out
        scores = keras.KerasTensor(
            (query.shape[0], self.num_heads, query.shape[1], value.shape[1]),
            dtype=self.compute_dtype,
        )
        return out, scores

    @classmethod
    def from_keras(cls, layer):
        """A layer with the same weights and outputs as a built Keras MHA/GQA layer.

        Accepts a built `keras.layers.MultiHeadAttention` or
        `keras.layers.GroupQueryAttention` over `(batch, seq, features)` inputs.
        """
        if not isinstance(
            layer, (keras.layers.MultiHeadAttention, keras.layers.GroupQueryAttention)
        ):
            raise TypeError(
                "`from_keras` expects a keras.layers.MultiHeadAttention or "
                f"GroupQueryAttention. Received: {type(layer).__name__}"
            )
        if not layer.built:
            raise ValueError(
                "`from_keras` needs a built layer (call it once, or `build` it), "
                f"so its weights exist. Received an unbuilt layer: {layer.name}"
            )
        config = layer.get_config()
        if isinstance(layer, keras.layers.GroupQueryAttention):
            kwargs = {
                "num_heads": config["num_query_heads"],
                "key_dim": config["head_dim"],
                "num_key_value_heads": config["num_key_value_heads"],
                "dropout": config["dropout"],
                "use_bias": config["use_bias"],
                "use_gate": config.get("use_gate", False),
                "dtype": config.get("dtype"),
            }
        else:
            query_kernel = layer._query_dense.kernel
            if len(query_kernel.shape) != 3:
                raise ValueError(
                    "`from_keras` supports layers over (batch, seq, features) inputs "
                    f"with one attention axis. Received: query kernel shape "
                    f"{tuple(query_kernel.shape)}, attention_axes={config.get('attention_axes')}"
                )
            kwargs = {
                k: config[k]
                for k in (
                    "num_heads", "key_dim", "value_dim", "dropout", "use_bias", "output_shape",
                    "kernel_initializer", "bias_initializer", "kernel_regularizer",
                    "bias_regularizer", "activity_regularizer", "kernel_constraint",
                    "bias_constraint", "seed", "use_gate", "sliding_window", "dtype",
                )
                if k in config
            }
        new = cls(**kwargs)
        query_shape = (None, None, layer._query_dense.kernel.shape[0])
        key_shape = (None, None, layer._key_dense.kernel.shape[0])
        value_shape = (None, None, layer._value_dense.kernel.shape[0])
        new.build(query_shape, value_shape, key_shape)
        names = ["_query_dense", "_key_dense", "_value_dense", "_output_dense"]
        if new.use_gate:
            names.append("_gate_dense")
        for name in names:
            getattr(new, name).set_weights(getattr(layer, name).get_weights())
        return new

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "num_heads": self.num_heads,
                "key_dim": self.key_dim,
                "value_dim": self.value_dim,
                "dropout": self.dropout,
                "use_bias": self.use_bias,
                "output_shape": self._output_shape,
                "sliding_window": self.sliding_window,
                "kernel_initializer": keras.initializers.serialize(self.kernel_initializer),
                "bias_initializer": keras.initializers.serialize(self.bias_initializer),
                "kernel_regularizer": keras.regularizers.serialize(self.kernel_regularizer),
                "bias_regularizer": keras.regularizers.serialize(self.bias_regularizer),
                "activity_regularizer": keras.regularizers.serialize(self.activity_regularizer),
                "kernel_constraint": keras.constraints.serialize(self.kernel_constraint),
                "bias_constraint": keras.constraints.serialize(self.bias_constraint),
                "use_gate": self.use_gate,
                "seed": self.seed,
                "num_key_value_heads": self.num_key_value_heads,
                "chunk_size": self.chunk_size,
                "rotary_embedding": (
                    keras.saving.serialize_keras_object(self.rotary_embedding)
                    if self.rotary_embedding is not None
                    else None
                ),
            }
        )
        return config
