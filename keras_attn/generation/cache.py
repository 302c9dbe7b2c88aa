"""Key/value caches for incremental decoding.

A model's cache is a list with one dict per `TransformerDecoderBlock`:
`{"self_attention": (key, value), "cross_attention": (key, value) or None}`,
each tensor `(batch, max_length, num_key_value_heads, head_dim)` (grouped-query
models store only the key/value heads). The cache is written in place by
`MultiHeadAttention(cache=..., cache_index=...)` with a comparison/gather/where
update (`keras_attn.ops.write_cache`), which lowers to
TFLite builtins and ONNX, unlike a scatter or `XlaDynamicUpdateSlice`.

For export the cache travels as one tensor per model,
`(num_layers, 2, batch, max_length, num_key_value_heads, head_dim)`
(`stack_cache` / `unstack_cache`), and the cross-attention cache likewise.
"""

from keras import ops

from keras_attn.ops.cache import check_cache_write  # noqa: F401  (used by generation)
from keras_attn.ops.cache import write_cache  # noqa: F401


def empty_cache(batch_size, max_length, num_layers, num_key_value_heads, head_dim,
                dtype="float32"):
    """Zero self-attention caches: a list of `num_layers` dicts."""
    shape = (batch_size, max_length, num_key_value_heads, head_dim)
    return [
        {
            "self_attention": (ops.zeros(shape, dtype), ops.zeros(shape, dtype)),
            "cross_attention": None,
        }
        for _ in range(num_layers)
    ]


def stack_cache(cache, part="self_attention"):
    """One `(num_layers, 2, B, L, H_kv, D)` tensor from a cache list.

    Every layer's cache must have the same length `L`: a model with a
    window on some layers only (ring buffers beside full caches) has no
    stacked layout, and gets a ValueError naming the lengths.
    """
    lengths = [layer[part][0].shape[1] for layer in cache]
    if len(set(lengths)) > 1:
        raise ValueError(
            "The layers' caches have different lengths (a sliding window on some layers "
            "only: ring buffers beside full caches), so they cannot be stacked into one "
            f"tensor. Received cache lengths per layer: {lengths}"
        )
    heads = [tuple(layer[part][0].shape[2:]) for layer in cache]
    if len(set(heads)) > 1:
        raise ValueError(
            "The layers' caches have different key/value heads or head sizes (`head_dim` / "
            "`num_key_value_heads` per layer), so they cannot be stacked into one tensor. "
            f"Received (num_key_value_heads, head_dim) per layer: {heads}"
        )
    return ops.stack([ops.stack(list(layer[part]), axis=0) for layer in cache], axis=0)


def unstack_cache(stacked, cross=None):
    """Inverse of `stack_cache`; `cross` is an optional stacked cross-attention cache."""
    # Unstacked, not indexed: TFLite's UNPACK copies rows, its 6-D strided
    # slices go element by element (half of a decode step at 4096 slots).
    layers = [ops.unstack(t, axis=0) for t in ops.unstack(stacked, axis=0)]
    crosses = ([None] * len(layers) if cross is None
               else [tuple(ops.unstack(t, axis=0)) for t in ops.unstack(cross, axis=0)])
    return [{"self_attention": tuple(pair), "cross_attention": c}
            for pair, c in zip(layers, crosses)]


def gather_batch(cache, indices):
    """Reorders every cache tensor along the batch axis (beam search)."""
    out = []
    for layer in cache:
        entry = {}
        for name, pair in layer.items():
            entry[name] = None if pair is None else tuple(ops.take(t, indices, axis=0) for t in pair)
        out.append(entry)
    return out
