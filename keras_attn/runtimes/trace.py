"""One trace of a keras_attn language model, shared by every runtime writer.

A runtime writer (the prefill/decode signatures, LiteRT-LM, ONNX Runtime
GenAI) owns its I/O contract: names, dtypes, shapes, the layout its caches
travel in. What the model is (its cache, how many layers, heads and slots,
whether the cache is a ring buffer, how it prefills and steps) is read here
once, from the model's generation protocol (`init_cache`, `call_with_cache`
and, for encoder-decoder models, `encode`; see `keras_attn.generation`):

    trace = DecoderTrace(model, max_length=256, cache_dtype="float16")
    logits, cache, encoder_padding_mask = trace.prefill(token_ids)
    logits, cache = trace.decode(token_ids, trace.cache(keys_values), index)
    outputs = [trace.store(t) for t in trace.keys_values(cache)]

`prefill` starts from an empty cache at position 0; `decode` continues a
cache at `index` with any number of tokens (LiteRT-LM's chunked
`prefill_<T>` signatures are `decode` calls). Caches are the model's own
(`keras_attn.generation.cache`), in float32 inside a call; between calls a
writer keeps them in `cache_dtype` (`store` on the way out, `cache` or
`load` on the way in). A writer wraps these in its `tf.function`s.
"""

import contextlib

import tensorflow as tf

from keras_attn.ops import cache as cache_ops

CACHE_DTYPES = ("float32", "float16")
# The writers' `decode` reads the filled part of the caches rounded up to this
# many slots (`keras_attn.ops.cache.bounded_reads`): a step at fill 128 reads
# 256 slots whatever `max_length` is. Read when a writer traces; None: every
# slot (benchmarks/bench_long_context.py compares the two).
READ_BUCKET = 128


def cache_storage_dtype(cache_dtype):
    """The `tf.DType` the exported caches travel in between calls (validated)."""
    if cache_dtype not in CACHE_DTYPES:
        raise ValueError(
            f"Received an invalid value for argument `cache_dtype`, expected one of "
            f"{list(CACHE_DTYPES)}. Received: cache_dtype={cache_dtype!r}")
    return tf.as_dtype(cache_dtype)


def num_caches(model):
    """How many self-attention caches `model.init_cache` returns: one per
    layer that projects its own keys and values (`DecoderOnlyLM`'s
    `key_value_sources`: the other layers reuse an earlier layer's)."""
    sources = getattr(model, "key_value_sources", None)
    return model.num_layers if sources is None else sum(source is None for source in sources)


def check_runtime_decoder(model, runtime="ONNX Runtime GenAI"):
    """`model` must be a keras_attn decoder-only LM: what the LLM runtimes (ONNX
    Runtime GenAI, LiteRT-LM) drive (their caches hold every position; a
    sliding window is a band over them: `DecoderTrace(ring_buffers=False)`)."""
    if hasattr(model, "encode"):
        raise ValueError(
            f"{runtime} exports support decoder-only models (`DecoderOnlyLM`); "
            f"encoder-decoder models have no layout there. Received: {type(model).__name__}"
        )
    for name in ("init_cache", "call_with_cache", "num_layers", "num_key_value_heads", "head_dim"):
        if not hasattr(model, name):
            raise ValueError(
                "`model` must be a keras_attn decoder such as `DecoderOnlyLM` (it needs "
                f"`{name}`). Received: {type(model).__name__}"
            )
    if not model.built:
        # The writers read its weights before any traced call would build it.
        model(tf.zeros((1, 1), tf.int32))


class DecoderTrace:
    """A model's prefill and decode steps, and its cache layout, for runtime writers.

    Args:
        model: a model with the generation protocol (`DecoderOnlyLM`,
            `Seq2SeqLM` or any model offering `init_cache`,
            `call_with_cache` and, encoder-decoder, `encode`).
        max_length: the context the exported caches hold (prompt and
            generated tokens).
        cache_dtype: "float32" or "float16": what the caches travel in
            between calls (each call computes in float32).
        ring_buffers: whether windowed layers keep ring buffers of their
            window (`init_cache`'s); None: where every layer has the same
            window (one cache length for the stacked caches), else False:
            every cache holds `max_length` positions, the window a band.
        read_bucket: None (attention in `decode` reads every slot) or a
            positive int: `decode` reads the filled slots only, rounded up
            to a multiple of it (`keras_attn.ops.cache.bounded_reads`; the
            same function, masked slots contribute exactly zero).
        update_slices: with `read_bucket`, one-token writes are
            `DYNAMIC_UPDATE_SLICE`s (in place in LiteRT-LM; TFLite only,
            tf2onnx has no converter for them).

    Attributes:
        model, max_length: as given.
        cache_dtype: the storage `tf.DType`.
        num_layers: the number of self-attention caches (decoder blocks).
        layer_cache_shapes: `(num_key_value_heads, head_dim)`, each cache's
            last two axes, one pair per cache (`DecoderOnlyLM` with
            `head_dim` / `num_key_value_heads` per layer: not all equal).
        num_key_value_heads, head_dim: those of every cache, or None when
            the caches' shapes differ (`uniform` is False).
        cache_length: its slots: `max_length`, or the window of a
            sliding-window model, whose cache is then a ring buffer.
        ring: whether it is one (the cache wraps; any position is valid).
        seq2seq: the model has an encoder (`encode`).
        vocabulary_size: the logits' size, or None if the model does not say.
        max_positions: the model's position bound (a learned table), or None.
    """

    def __init__(self, model, *, max_length, cache_dtype="float32", ring_buffers=None,
                 read_bucket=None, update_slices=False):
        self.model = model
        self.read_bucket = read_bucket
        self.update_slices = update_slices
        self.max_length = max_length
        self.cache_dtype = cache_storage_dtype(cache_dtype)
        windows = model.layer_sliding_windows() if hasattr(model, "layer_sliding_windows") else [None]
        if ring_buffers is None:
            ring_buffers = len(set(windows)) == 1
        # Only a model with windows knows the argument.
        self._cache_kwargs = {} if ring_buffers or set(windows) == {None} else {"ring_buffers": False}
        # A batch of zero rows: the shapes without allocating a cache.
        empty = model.init_cache(0, max_length, **self._cache_kwargs)
        keys = [layer["self_attention"][0] for layer in empty]
        self.num_layers = len(empty)
        self.cache_length = int(keys[0].shape[1])
        self.layer_cache_shapes = [(int(k.shape[2]), int(k.shape[3])) for k in keys]
        self.uniform = len(set(self.layer_cache_shapes)) == 1
        self.num_key_value_heads, self.head_dim = (
            self.layer_cache_shapes[0] if self.uniform else (None, None))
        self.ring = self.cache_length < max_length
        self.seq2seq = hasattr(model, "encode")
        vocab = getattr(model, "vocabulary_size", None)
        self.vocabulary_size = (vocab if isinstance(vocab, int) and not isinstance(vocab, bool)
                                else None)
        self.max_positions = getattr(model, "max_positions", None)

    def cache_shape(self, batch_size, length, layer=None):
        """One key or value cache: `(batch_size, length, num_key_value_heads, head_dim)`
        (None for a dynamic axis; `length` is `cache_length` for self-attention),
        of cache `layer`, or of every cache (a ValueError if they differ)."""
        if layer is None:
            self.check_uniform("one cache shape for every layer")
            layer = 0
        return (batch_size, length, *self.layer_cache_shapes[layer])

    def check_uniform(self, needs):
        """A ValueError, saying the writer `needs`, unless every cache has one shape."""
        if not self.uniform:
            raise ValueError(
                f"This export needs {needs}, and the model's layers have caches of other "
                "key/value heads or head sizes (`head_dim` / `num_key_value_heads` per layer). "
                f"Received (num_key_value_heads, head_dim) per cache: {self.layer_cache_shapes}"
            )

    def load(self, tensor):
        """A stored cache tensor in float32, what a call computes in (None stays None)."""
        return None if tensor is None else tf.cast(tensor, tf.float32)

    def store(self, tensor):
        """A cache tensor in `cache_dtype`, what travels between calls."""
        return tf.cast(tensor, self.cache_dtype)

    def cache(self, keys_values, cross_keys_values=None):
        """The model's cache from flat per-layer tensors `[key_0, value_0, key_1, ...]`
        (`(B, S, H_kv, D)`, stored or float32), loaded into float32."""
        layers = []
        for i in range(self.num_layers):
            cross = None
            if cross_keys_values is not None:
                cross = tuple(self.load(t) for t in cross_keys_values[2 * i: 2 * i + 2])
            layers.append({"self_attention": tuple(self.load(t)
                                                   for t in keys_values[2 * i: 2 * i + 2]),
                           "cross_attention": cross})
        return layers

    @staticmethod
    def keys_values(cache, part="self_attention"):
        """The flat `[key_0, value_0, key_1, ...]` of a model cache (inverse of `cache`)."""
        return [t for layer in cache for t in layer[part]]

    def prefill(self, token_ids, encoder_ids=None):
        """`token_ids` at positions `[0, P)` from an empty cache.

        Returns `(logits, cache, encoder_padding_mask)`: the model's cache
        (float32; an encoder-decoder model's holds the cross-attention
        caches too) and the encoder's padding mask (None for a decoder).
        """
        cache = self.model.init_cache(tf.shape(token_ids)[0], self.max_length, **self._cache_kwargs)
        if encoder_ids is None:
            logits, cache = self.model.call_with_cache(token_ids, cache, 0)
            return logits, cache, None
        encoded, mask = self.model.encode(encoder_ids)
        logits, cache = self.model.call_with_cache(
            token_ids, cache, 0, encoder_outputs=encoded, encoder_padding_mask=mask)
        return logits, cache, mask

    def decode(self, token_ids, cache, index, *, padding_mask=None, encoder_padding_mask=None):
        """`token_ids` at positions `[index, ...)` after `cache`; returns `(logits, cache)`.

        `padding_mask` `(B, cache_length)` marks the cache slots holding a
        token (None: all up to the causal bound); `encoder_padding_mask`
        is the encoder's (encoder-decoder models).
        """
        kwargs = {}
        if padding_mask is not None:
            kwargs["padding_mask"] = padding_mask
        if encoder_padding_mask is not None:
            kwargs["encoder_padding_mask"] = encoder_padding_mask
        bounded = (contextlib.nullcontext() if self.read_bucket is None or padding_mask is not None
                   else cache_ops.bounded_reads(self.read_bucket, self.update_slices))
        with bounded:
            return self.model.call_with_cache(token_ids, cache, index, **kwargs)
