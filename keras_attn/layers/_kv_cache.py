"""Key/value caches of `MultiHeadAttention`: writes, ring buffers, masks.

`prepare_cached` turns a cached call into the projected query, keys, values
and one boolean mask; the layer then runs them through the same
`_compute_attention` and output projection as an uncached call.
"""

from keras import ops

from keras_attn.layers import _mha_attention
from keras_attn.layers import _positions
from keras_attn.ops import masking


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




def prepare_cached(
    layer,
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
    use_causal_mask,
    start_index,
):
    """Projected `(q, k, v, gate, mask, new_cache)` of a cached call of `layer`.

    With `cache_index=None` the cache is complete (cross-attention keys and
    values from `project_key_value`) and is used as is; `value` may be None.
    Otherwise the keys/values of `value` (the new tokens, positions
    `[cache_index, cache_index + T_q)`) are written into the cache first, and
    keys at positions `>= cache_index + T_q` are hidden. Masks over keys
    (`value_mask`, `key_mask`, `attention_mask`) cover the cache axis; a
    `(B, T_q)` key padding mask (e.g. the Keras mask of the new tokens) covers
    the new tokens only, earlier positions stay visible. When the layer's
    `sliding_window` equals the cache length the cache is a ring buffer
    (slot = position mod length), bounding memory for long generation.
    The causal and window masks are part of `mask`.
    """
    key_cache, value_cache = _check_cache(cache, static_length=cache_index is not None)
    d_q = layer._feature_dims[0]
    if len(query.shape) != 3 or (query.shape[-1] is not None and query.shape[-1] != d_q):
        raise ValueError(
            f"Expected `query` of shape (batch, seq, {d_q}). Received: "
            f"query.shape={tuple(query.shape)}"
        )
    rotary = layer.rotary_embedding
    window = layer.sliding_window
    length = key_cache.shape[1]
    t_q = query.shape[1] if query.shape[1] is not None else ops.shape(query)[1]
    ring = False
    mask_parts = []
    if cache_index is None:
        # query = [B, T_q, H, key_dim]
        with masking.hidden_keras_masks(query):
            q, _, _, gate = _mha_attention.project_inputs(layer, query, None, None)
        if rotary is not None:
            q = rotary(q, start_index=start_index)
        k, v = key_cache, value_cache
        new_cache = (key_cache, value_cache)
    else:
        key_or_value = value if key is None else key
        with masking.hidden_keras_masks(query, value, key_or_value):
            q, k_new, v_new, gate = _mha_attention.project_inputs(layer, query, key_or_value, value)
        if rotary is not None:
            q = rotary(q, start_index=cache_index)
            k_new = rotary(k_new, start_index=cache_index)
        ring = window is not None and window == length
        check_cache_write(length, k_new.shape[1], cache_index, ring=ring)
        new_pos = ops.arange(t_q, dtype="int32") + ops.cast(cache_index, "int32")
        if ring:
            if not use_causal_mask:
                raise ValueError(
                    "A ring-buffer cache (sliding_window == cache length) needs "
                    "`use_causal_mask=True`. Received: use_causal_mask=False"
                )
            # Attend over the cache as it was (slots hold earlier positions)
            # plus the new block, so a block may wrap around.
            k_pos = ops.concatenate([ring_positions(length, cache_index), new_pos])
            k = ops.concatenate([key_cache, ops.cast(k_new, key_cache.dtype)], axis=1)
            v = ops.concatenate([value_cache, ops.cast(v_new, value_cache.dtype)], axis=1)
            visible = ops.expand_dims(ops.greater_equal(k_pos, 0), 0)
            new_cache = (
                write_cache(key_cache, k_new, cache_index, ring=True),
                write_cache(value_cache, v_new, cache_index, ring=True),
            )
        else:
            k_pos = ops.arange(length, dtype="int32")
            k = write_cache(key_cache, k_new, cache_index)
            v = write_cache(value_cache, v_new, cache_index)
            # Slots after the new block hold nothing yet.
            visible = ops.less(k_pos[None, :], new_pos[-1] + 1)
            new_cache = (k, v)
        diff = new_pos[:, None] - k_pos[None, :]
        if use_causal_mask:
            visible = ops.logical_and(visible, ops.greater_equal(diff, 0))
        if window is not None:
            visible = ops.logical_and(visible, ops.less(ops.abs(diff), window))
        # expand_dims: None-indexing a bool tensor needs Flex in TFLite.
        mask_parts.append(ops.expand_dims(ops.expand_dims(visible, 0), 0))
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
            num_heads=layer.num_heads,
        )
    )
    return q, k, v, gate, masking.combine_masks(*mask_parts), new_cache
