"""KV cache in MultiHeadAttention / TransformerDecoderBlock against NumPy references."""

import numpy as np
import pytest
import tensorflow as tf

from keras_attn.generation.cache import check_cache_write
from keras_attn.layers import MultiHeadAttention, RotaryEmbedding, TransformerDecoderBlock
from keras_attn.ops import write_cache
from tests import reference as ref
from tests import tolerance


def _np_write(cache, new, index, ring=False):
    out = cache.copy()
    length = cache.shape[1]
    for t in range(new.shape[1]):
        pos = index + t
        if ring:
            out[:, pos % length] = new[:, t]
        elif pos < length:
            out[:, pos] = new[:, t]
    return out


@pytest.mark.parametrize(
    "length, t, index, ring",
    [(8, 1, 0, False), (8, 1, 5, False), (8, 3, 2, False), (8, 3, 6, False),
     (4, 1, 6, True), (4, 3, 3, True), (4, 6, 5, True)],
)
def test_write_cache_matches_numpy(rng, length, t, index, ring):
    cache = rng.normal(size=(2, length, 3, 4)).astype("float32")
    new = rng.normal(size=(2, t, 3, 4)).astype("float32")
    got = write_cache(cache, new, index, ring=ring)
    np.testing.assert_array_equal(np.asarray(got), _np_write(cache, new, index, ring))


def _np_mha(layer, x, enc=None, mask=None, rotary=False):
    """Full (non-incremental) attention from the layer's weights, in float64."""
    w = ref.mha_weights(layer, np.float64)
    kv_in = x if enc is None else enc
    q = np.einsum("btd,dhk->bthk", x, w["wq"]) + w["bq"]
    k = np.einsum("btd,dhk->bthk", kv_in, w["wk"]) + w["bk"]
    v = np.einsum("btd,dhk->bthk", kv_in, w["wv"]) + w["bv"]
    if rotary:
        q, k = ref.rotary(q), ref.rotary(k)
    out, _ = ref.attention(q, k, v, mask=mask)
    return np.einsum("bthk,hkd->btd", out, w["wo"]) + w["bo"]


def _run_chunks(layer, x, cache, chunks, **kwargs):
    outs, index = [], 0
    for n in chunks:
        part = x[:, index:index + n]
        out, cache = layer(part, part, use_causal_mask=True, cache=cache, cache_index=index,
                           **kwargs)
        outs.append(np.asarray(out))
        index += n
    return np.concatenate(outs, axis=1), cache


def test_mha_cached_gqa_rotary_matches_numpy(rng):
    layer = MultiHeadAttention(num_heads=4, key_dim=4, num_key_value_heads=2,
                               rotary_embedding=RotaryEmbedding())
    x = rng.normal(size=(2, 9, 12)).astype("float32")
    layer(x, x)
    cache = (np.zeros((2, 12, 2, 4), "float32"),) * 2
    got, (k_cache, _) = _run_chunks(layer, x, cache, [4, 1, 2, 1, 1])
    assert tuple(k_cache.shape) == (2, 12, 2, 4)  # only the key/value heads are stored
    expected = _np_mha(layer, x, mask=ref.causal(9)[None, None], rotary=True)
    tolerance.assert_close(got, expected, terms=tolerance.LAYER_TERMS)
    # Cached positions beyond the written ones stay zero.
    np.testing.assert_array_equal(np.asarray(k_cache)[:, 9:], 0.0)


def test_mha_ring_buffer_matches_sliding_window(rng):
    window = 3
    layer = MultiHeadAttention(num_heads=2, key_dim=4, sliding_window=window,
                               rotary_embedding=RotaryEmbedding())
    x = rng.normal(size=(2, 12, 8)).astype("float32")
    layer(x, x)
    cache = (np.zeros((2, window, 2, 4), "float32"),) * 2  # bounded memory
    got, _ = _run_chunks(layer, x, cache, [4, 1, 2, 1, 1, 3])
    i, j = np.arange(12)[:, None], np.arange(12)[None, :]
    mask = (j <= i) & (i - j < window)
    expected = _np_mha(layer, x, mask=mask[None, None], rotary=True)
    tolerance.assert_close(got, expected, terms=tolerance.LAYER_TERMS)


def test_mha_cache_key_mask_for_left_padding(rng):
    layer = MultiHeadAttention(num_heads=2, key_dim=4)
    x = rng.normal(size=(2, 6, 8)).astype("float32")
    layer(x, x)
    key_mask = np.ones((2, 8), bool)
    key_mask[1, :2] = False  # row 1 is left-padded by two tokens
    cache = (np.zeros((2, 8, 2, 4), "float32"),) * 2
    got, _ = _run_chunks(layer, x, cache, [3, 1, 1, 1], value_mask=key_mask)
    mask = ref.causal(6)[None, None] & key_mask[:, None, None, :6]
    expected = _np_mha(layer, x, mask=mask)
    tolerance.assert_close(got, expected, terms=tolerance.LAYER_TERMS)


def test_cross_attention_cache_is_computed_once(rng):
    layer = MultiHeadAttention(num_heads=2, key_dim=4, num_key_value_heads=1)
    x = rng.normal(size=(2, 3, 8)).astype("float32")
    enc = rng.normal(size=(2, 5, 6)).astype("float32")
    enc_mask = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], bool)
    layer(x, enc)
    cache = layer.project_key_value(enc)
    assert tuple(cache[0].shape) == (2, 5, 1, 4)
    out, same = layer(x, None, value_mask=enc_mask, cache=cache)
    assert same[0] is cache[0] and same[1] is cache[1]
    expected = _np_mha(layer, x, enc=enc, mask=enc_mask[:, None, None, :])
    tolerance.assert_close(np.asarray(out), expected, terms=tolerance.LAYER_TERMS)


def test_decoder_block_cached_equals_full(rng):
    block = TransformerDecoderBlock(num_heads=4, intermediate_dim=24, num_key_value_heads=2,
                                    normalize_first=True, rotary_embedding=RotaryEmbedding())
    dec = rng.normal(size=(2, 7, 16)).astype("float32")
    enc = rng.normal(size=(2, 5, 16)).astype("float32")
    enc_mask = np.array([[1, 1, 1, 1, 0], [1, 1, 0, 0, 0]], bool)
    full = np.asarray(block(dec, enc, encoder_padding_mask=enc_mask))
    cache = {"self_attention": (np.zeros((2, 10, 2, 4), "float32"),) * 2}
    out, cache = block(dec[:, :3], enc, encoder_padding_mask=enc_mask, cache=cache, cache_index=0)
    outs = [np.asarray(out)]
    cross = cache["cross_attention"]
    for i in range(3, 7):
        out, cache = block(dec[:, i:i + 1], None, encoder_padding_mask=enc_mask, cache=cache,
                           cache_index=i)
        assert cache["cross_attention"][0] is cross[0]  # reused, not recomputed
        outs.append(np.asarray(out))
    tolerance.assert_close(np.concatenate(outs, axis=1), full, terms=tolerance.LAYER_TERMS)


def test_cache_argument_errors(rng):
    layer = MultiHeadAttention(num_heads=2, key_dim=4)
    x = rng.normal(size=(1, 2, 8)).astype("float32")
    layer(x, x)
    with pytest.raises(ValueError, match="cache"):
        layer(x, x, cache=np.zeros((1, 4, 2, 4), "float32"), cache_index=0)
    with pytest.raises(ValueError, match="cache_index"):
        layer(x, x, cache_index=0)
    block = TransformerDecoderBlock(num_heads=2, intermediate_dim=8)
    block(x)
    with pytest.raises(ValueError, match="cache_index"):
        block(x, cache={"self_attention": (np.zeros((1, 4, 2, 4), "float32"),) * 2})
    with pytest.raises(ValueError, match="cross-attention"):
        block(x, x, cache={"self_attention": (np.zeros((1, 4, 2, 4), "float32"),) * 2},
              cache_index=0)


def test_cache_update_has_no_xla_or_scatter_ops():
    spec = tf.TensorSpec((2, 16, 2, 4), tf.float32)

    @tf.function(input_signature=[spec, tf.TensorSpec((2, None, 2, 4)), tf.TensorSpec((), tf.int32)])
    def update(cache, new, index):
        return write_cache(cache, new, index), write_cache(cache, new, index, ring=True)

    ops = {op.type for op in update.get_concrete_function().graph.get_operations()}
    bad = {o for o in ops if "Xla" in o or "Scatter" in o or "DynamicUpdateSlice" in o}
    assert not bad, bad


@pytest.mark.parametrize(
    "length, t, index",
    [(4, 6, 0), (4, 1, 4), (4, 3, 2), (8, 9, tf.constant(0))],
)
def test_check_cache_write_rejects_static_overflow(rng, length, t, index):
    # The premise: `write_cache` silently loses the last new position.
    cache = rng.normal(size=(1, length, 1, 2)).astype("float32")
    new = rng.normal(size=(1, t, 1, 2)).astype("float32")
    written = np.asarray(write_cache(cache, new, index))
    assert not any(np.array_equal(written[:, s], new[:, -1]) for s in range(length))
    with pytest.raises(ValueError, match=f"cache holds {length} positions"):
        check_cache_write(length, t, index)


def test_check_cache_write_accepts_in_range_ring_and_dynamic():
    check_cache_write(4, 4, 0)
    check_cache_write(4, 1, np.int64(3))
    check_cache_write(4, 6, 5, ring=True)  # a ring buffer wraps by design
    check_cache_write(4, 1, tf.Variable(9))  # unknown until run time
    check_cache_write(None, 6, 0)
    with pytest.raises(ValueError, match="cache_index"):
        check_cache_write(4, 1, -1)
