"""The key/value cache of `MultiHeadAttention`: which keys a cached call sees.

A cached call writes its new keys and values (`keras_attn.ops.cache`) and
attends over the cache. `attend_to_cache` returns those keys with their
positions and validity (and the new queries' positions); the layer turns
them into its one `keras_attn.ops.masking.AttentionMask`, whose boolean mask
holds the band between those positions (`masking.mask_from_positions`).
"""

from typing import NamedTuple

from keras import ops

from keras_attn import checks
from keras_attn.ops import cache as cache_ops
from keras_attn.ops import masking
from keras_attn.ops import shapes


class CachedKeys(NamedTuple):
    """The keys and values a cached call attends over.

    `positions` `(T_k,)` are the keys' absolute positions, `valid` `(1, T_k)`
    says which slots hold a key (None: all), `new_cache` is the updated
    `(key_cache, value_cache)`, `ring` whether the cache is a ring buffer,
    `query_positions` `(T_q,)` the absolute positions of the call's queries.
    """

    key: object
    value: object
    positions: object
    valid: object
    new_cache: tuple
    ring: bool
    query_positions: object


class KeyValue:
    """The keys and values one attention call attended over, for a
    `shared_key_value` layer: `keys` is the projected `(key, value)` pair
    (uncached) or the call's `CachedKeys` (`cached`). A plain object, so that
    Keras passes it through a layer call as it is (a `CachedKeys` mixes
    tensors with Python flags, which Keras refuses in call arguments)."""

    __slots__ = ("keys", "cached")

    def __init__(self, keys, cached):
        self.keys = keys
        self.cached = cached


def check_cache(cache):
    """`(key_cache, value_cache)`, each `(B, L, H_kv, D)`."""
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
    return cache[0], cache[1]


def attend_to_cache(cache, cache_index, new_key, new_value, query_length, sliding_window,
                    use_causal_mask):
    """The `CachedKeys` of a cached call with `query_length` new queries.

    With `cache_index=None` the cache is complete (cross-attention keys from
    `project_key_value`) and used as is; the queries are at positions
    `0 .. query_length - 1`. Otherwise `new_key`/`new_value` (positions from
    `cache_index`, as the queries') are written first and slots after them
    hold no key yet. When `sliding_window` equals the cache length the cache
    is a ring buffer (slot = position mod length): the call attends over the
    cache as it was plus the new block, so a block may wrap. A cache whose
    length is not static (a traced `decode_step` signature's part of the
    caller's cache) is never a ring.
    """
    key_cache, value_cache = check_cache(cache)
    length = key_cache.shape[1]
    query_positions = ops.arange(query_length, dtype="int32")
    if cache_index is None:
        positions = ops.arange(shapes.dim(key_cache, 1), dtype="int32")
        return CachedKeys(key_cache, value_cache, positions, None, (key_cache, value_cache), False,
                          query_positions)
    query_positions = query_positions + ops.cast(cache_index, "int32")
    ring = sliding_window is not None and sliding_window == length
    cache_ops.check_cache_write(length, new_key.shape[1], cache_index, ring=ring)
    if not ring:
        bound = cache_ops.read_bound()
        positions = ops.arange(shapes.dim(key_cache, 1), dtype="int32")
        if bound is not None and new_key.shape[1] == 1:
            key = cache_ops.write_slot(key_cache, new_key, cache_index, bound[1])
            value = cache_ops.write_slot(value_cache, new_value, cache_index, bound[1])
        else:
            key = cache_ops.write_cache(key_cache, new_key, cache_index)
            value = cache_ops.write_cache(value_cache, new_value, cache_index)
        valid = ops.expand_dims(ops.less(positions, query_positions[-1] + 1), 0)
        read = (key, value, positions, valid)
        if bound is not None:
            read = cache_ops.filled_part(*read, query_positions[0], query_positions[-1],
                                         bound[0], sliding_window)
        return CachedKeys(*read, (key, value), False, query_positions)
    if not use_causal_mask:
        raise ValueError(
            "A ring-buffer cache (sliding_window == cache length) needs "
            "`use_causal_mask=True`. Received: use_causal_mask=False"
        )
    positions = ops.concatenate([cache_ops.ring_positions(length, cache_index), query_positions])
    new_cache = (
        cache_ops.write_cache(key_cache, new_key, cache_index, ring=True),
        cache_ops.write_cache(value_cache, new_value, cache_index, ring=True),
    )
    return CachedKeys(
        ops.concatenate([key_cache, ops.cast(new_key, key_cache.dtype)], axis=1),
        ops.concatenate([value_cache, ops.cast(new_value, value_cache.dtype)], axis=1),
        positions,
        ops.expand_dims(ops.greater_equal(positions, 0), 0),
        new_cache,
        True,
        query_positions,
    )


def key_padding(name, mask, keys, t_q, cache_index):
    """A `(B, T)` key padding mask of a cached call over the keys attended to.

    `T` may be the cache length (a mask over the cache axis) or, when new
    tokens are written (`cache_index` given), `T_q` (their own mask, e.g. the
    Keras mask of the new tokens; earlier positions stay visible).
    """
    checks.check_mask_dtype(name, mask)
    if len(mask.shape) != 2:
        raise ValueError(
            f"Expected `{name}` of shape (batch, length) in a cached call. "
            f"Received: {name}.shape={tuple(mask.shape)}"
        )
    mask = masking.as_bool(mask)
    length = keys.new_cache[0].shape[1]
    n = mask.shape[1]
    static_t_q = t_q if isinstance(t_q, int) else None
    covers_new = cache_index is not None and (n is None or n == static_t_q or static_t_q is None)
    if n == length and (not keys.ring or cache_index is None):
        return mask
    if not covers_new:
        expected = f"(batch, {length})" + (
            "" if cache_index is None else f" or the new tokens' (batch, {static_t_q})"
        )
        if keys.ring:
            expected = f"the new tokens' (batch, {static_t_q}) (a ring-buffer cache)"
        raise ValueError(
            f"Received an invalid `{name}` shape for a cached call: "
            f"{tuple(mask.shape)}. Expected {expected}."
        )
    earlier = ops.cast(ops.ones_like(keys.new_cache[0][:, :, 0, 0]), "bool")
    if keys.ring:
        # Keys are the cache as it was, then the new block.
        return ops.concatenate([earlier, mask], axis=1)
    # The new tokens sit at slots [cache_index, cache_index + T_q).
    relative = ops.arange(length, dtype="int32") - ops.cast(cache_index, "int32")
    is_new = ops.logical_and(ops.greater_equal(relative, 0), ops.less(relative, t_q))
    index = ops.clip(relative, 0, ops.maximum(t_q - 1, 0))
    # Gathered as int32: TFLite gathers booleans only with Flex.
    placed = ops.take(ops.cast(mask, "int32"), index, axis=1) > 0
    return ops.where(ops.expand_dims(is_new, 0), placed, earlier)
