"""Key/value cache writes for incremental decoding (`keras.ops` only).

A cache is `(batch, max_length, num_key_value_heads, head_dim)`. Writes are
an index comparison, a gather and a `where` over the cache axis, so they
lower to TFLite builtins and ONNX (no `XlaDynamicUpdateSlice`, no scatter)
and keep the cache's static shape. Used by `MultiHeadAttention(cache=...)`
and the generation models (`keras_attn.generation.cache`).

Inside `bounded_reads(bucket)` (the LLM-runtime exports' decode traces) a
cached call attends over the filled part of its cache only, rounded up to a
multiple of `bucket` (`filled_part`), and a one-token write is a
`slice_update` (TFLite's in-place `DYNAMIC_UPDATE_SLICE`) or a
`scatter_update` (ONNX's `ScatterND`) instead of the `where` over every slot
(`write_slot`): a decode step then costs what the context holds, not what
the export allocated.
"""

import contextlib
import threading

from keras import ops

from keras_attn.checks import static_int
from keras_attn.ops import shapes


def write_cache(cache, new, index, ring=False):
    """Writes `new` `(B, T, H, D)` into `cache` `(B, L, H, D)` at `index`.

    Positions `[index, index + T)` of the cache are replaced (slots modulo `L`
    when `ring`; of a block longer than `L` only its last `L` positions stay).
    Written as an index comparison, a gather and a `where` over the cache
    axis, so the update lowers to TFLite builtins and ONNX (no
    `XlaDynamicUpdateSlice`, no scatter) and keeps the cache's static shape.
    """
    length = shapes.dim(cache, 1)
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
    index = static_int(cache_index)
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


_bounds = threading.local()


@contextlib.contextmanager
def bounded_reads(bucket, update_slices=False):
    """Cached calls traced inside read only the filled part of their caches.

    A non-ring cache of `L` slots holds keys at slots `[0, last]` after a call
    whose last query is at position `last`; the other slots are masked for
    every query, so attention over `[0, min(L, ceil((last + 1) / bucket) *
    bucket))` is the same function (masked keys contribute exactly zero). A
    sliding window `W` also drops the slots before `first - W + 1` (rounded
    down to `bucket`). The slice sizes come from the call's position, a
    tensor: graphs only (the TensorFlow traces of `keras_attn.runtimes`).
    Calls inside take no mask over the cache axis (`value_mask`/`key_mask`
    of the cache's length, `attention_mask`): the runtimes' decode passes
    none, and `DecoderTrace.decode` with a `padding_mask` reads every slot.

    Args:
        bucket: positive int, the granularity of the bound (the sliced
            tensors change size, and are reallocated, only when it moves).
        update_slices: whether one-token writes use `keras.ops.slice_update`
            (TensorFlow's `XlaDynamicUpdateSlice`: TFLite's
            `DYNAMIC_UPDATE_SLICE`, which writes in place when the runtime
            passes one buffer as the cache's input and output, as LiteRT-LM
            does; tf2onnx has no converter for it); otherwise
            `scatter_update` (`ScatterND`).
    """
    if isinstance(bucket, bool) or not isinstance(bucket, int) or bucket < 1:
        raise ValueError(
            "Received an invalid value for argument `bucket`, expected a positive "
            f"integer. Received: bucket={bucket!r}")
    previous = getattr(_bounds, "value", None)
    _bounds.value = (bucket, bool(update_slices))
    try:
        yield
    finally:
        _bounds.value = previous


def write_slot(cache, new, index, update_slices):
    """`write_cache` of one token (`new` `(B, 1, H, D)`, `index` in `[0, L)`)
    without a select over every slot: a `slice_update` (TFLite's
    `DYNAMIC_UPDATE_SLICE`, in place when the runtime aliases the cache) or,
    without `update_slices`, a `scatter_update` (ONNX `ScatterND`: one copy
    of the cache where the select costs three passes). As `write_cache`, an
    `index` outside the cache drops the write (the slot it is clipped to is
    written back as it was), so an unchecked bad request changes nothing."""
    index = ops.cast(index, "int32")
    length = shapes.dim(cache, 1)
    slot = ops.clip(index, 0, length - 1)
    batch = ops.shape(cache)[0]
    kept = ops.slice(cache, [0, slot, 0, 0], [batch, 1, cache.shape[2], cache.shape[3]])
    inside = ops.logical_and(ops.greater_equal(index, 0), ops.less(index, length))
    new = ops.where(inside, ops.cast(new, cache.dtype), kept)
    if update_slices:
        return ops.slice_update(cache, [0, slot, 0, 0], new)
    rows = ops.stack([ops.arange(batch, dtype="int32"),
                      ops.broadcast_to(slot, ops.shape(ops.arange(batch)))], axis=1)
    return ops.scatter_update(cache, rows, new[:, 0])


def read_bound():
    """`(bucket, update_slices)` inside `bounded_reads`, else None."""
    return getattr(_bounds, "value", None)


def filled_part(key, value, positions, valid, first, last, bucket, sliding_window=None):
    """The slots `[start, end)` of a non-ring cache that a call's queries can see.

    `key`/`value` `(B, L, H, D)`, `positions` `(L,)` and `valid` `(1, L)`
    (None: all) are cut to `end = min(L, ceil((last + 1) / bucket) * bucket)`
    and, with a `sliding_window` W, from `start = floor(max(0, first - W + 1)
    / bucket) * bucket`; `first`/`last` are the call's first and last query
    positions (int32 scalars). Returns the four, cut.
    """
    length = shapes.dim(key, 1)
    last = ops.cast(last, "int32")
    # At least one slot, for positions outside the cache too (an unchecked bad
    # request): a read of zero keys fails in XNNPACK instead of giving garbage.
    end = ops.minimum(length, ops.maximum(last // bucket + 1, 1) * bucket)
    start = ops.zeros((), "int32")
    if sliding_window is not None:
        start = ops.maximum(ops.cast(first, "int32") - (sliding_window - 1), 0)
        start = ops.minimum(start, end - 1) // bucket * bucket
    size = end - start
    batch = ops.shape(key)[0]

    def cut(x):
        return ops.slice(x, [0, start, 0, 0], [batch, size, x.shape[2], x.shape[3]])

    positions = ops.slice(positions, [start], [size])
    if valid is not None:
        valid = ops.slice(valid, [0, start], [1, size])
    return cut(key), cut(value), positions, valid
