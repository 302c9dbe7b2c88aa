"""Key padding masks in cached calls: over the cache axis, over the new tokens
(e.g. Keras masks from `Embedding(mask_zero=True)`), `key_mask`, ring buffers.

Expected values: NumPy attention from the layer's weights (`tests.layers.test_cache`).
"""

import keras
import numpy as np
import pytest

from keras_attn.layers import MultiHeadAttention, TransformerDecoderBlock
from tests import reference as ref
from tests.layers.test_cache import _np_mha, _run_chunks
from tests import tolerance


@pytest.fixture(scope="module")
def layer():
    mha = MultiHeadAttention(num_heads=2, key_dim=4, name="mha")
    x = np.zeros((2, 6, 8), "float32")
    mha(x, x)
    mha.set_weights(
        [np.random.default_rng(1).normal(size=w.shape).astype("float32") * 0.5
         for w in mha.get_weights()]
    )
    return mha


def _cache(length=8):
    return (np.zeros((2, length, 2, 4), "float32"),) * 2


def test_keras_mask_of_new_tokens_in_prefill(layer, rng):
    """A Keras mask on the prompt covers the prompt's own positions of the cache."""
    ids = np.array([[3, 4, 0], [5, 6, 7]])  # row 0: one padding token
    x = keras.layers.Embedding(10, 8, mask_zero=True)(ids)
    assert getattr(x, "_keras_mask", None) is not None
    got, _ = layer(x, x, use_causal_mask=True, cache=_cache(), cache_index=0)
    valid = ids > 0
    mask = ref.causal(3)[None, None] & valid[:, None, None, :]
    expected = _np_mha(layer, np.asarray(x), mask=mask)
    tolerance.assert_close(np.asarray(got)[valid], expected[valid], terms=tolerance.LAYER_TERMS)


@pytest.mark.parametrize("name", ["value_mask", "key_mask"])
def test_cache_axis_key_masks_are_applied(layer, rng, name):
    x = rng.normal(size=(2, 6, 8)).astype("float32")
    key_valid = np.ones((2, 8), bool)
    key_valid[0, 1] = key_valid[1, 4] = False
    got, _ = _run_chunks(layer, x, _cache(), [3, 1, 2], **{name: key_valid})
    mask = ref.causal(6)[None, None] & key_valid[:, None, None, :6]
    tolerance.assert_close(got, _np_mha(layer, x, mask=mask), terms=tolerance.LAYER_TERMS)


def _steps(layer, x, cache, step_valid):
    """Cached calls over consecutive blocks of `x`, each with its block's
    `(B, n)` key mask; returns the outputs and the NumPy mask they imply:
    a query sees earlier positions, and the positions of its own block that
    its mask keeps (a new-token mask covers only the new tokens)."""
    outs, index = [], 0
    batch, total = x.shape[0], x.shape[1]
    mask = np.zeros((batch, 1, total, total), bool)
    for part_valid in step_valid:
        n = part_valid.shape[1]
        part = x[:, index:index + n]
        out, cache = layer(part, part, use_causal_mask=True, cache=cache, cache_index=index,
                           value_mask=part_valid)
        outs.append(np.asarray(out))
        keys = np.ones((batch, total), bool)
        keys[:, index:index + n] = part_valid
        keys[:, index + n:] = False
        mask[:, 0, index:index + n] = keys[:, None, :]
        index += n
    return np.concatenate(outs, axis=1), mask


def test_new_token_mask_in_decode_steps(layer, rng):
    """A `(B, T_new)` mask hides only the new tokens it marks."""
    x = rng.normal(size=(2, 5, 8)).astype("float32")
    step_valid = [np.array([[True, True], [True, False]]), np.array([[False], [True]]),
                  np.array([[True, False], [True, True]])]
    got, mask = _steps(layer, x, _cache(), step_valid)
    expected = _np_mha(layer, x, mask=mask & ref.causal(5)[None, None])
    tolerance.assert_close(got, expected, terms=tolerance.LAYER_TERMS)
    # Without the masks the same steps differ: the masks were used.
    unmasked, _ = _run_chunks(layer, x, _cache(), [2, 1, 2])
    assert np.abs(unmasked - expected).max() > 1e-3


def test_new_token_mask_with_ring_buffer(rng):
    window = 3
    layer = MultiHeadAttention(num_heads=2, key_dim=4, sliding_window=window)
    x = rng.normal(size=(1, 6, 8)).astype("float32")
    layer(x, x)
    cache = (np.zeros((1, window, 2, 4), "float32"),) * 2
    step_valid = [np.array([[True, False]]), np.array([[True]]),
                  np.array([[True, False, True]])]
    got, mask = _steps(layer, x, cache, step_valid)
    i, j = np.arange(6)[:, None], np.arange(6)[None, :]
    mask = mask & (j <= i) & (i - j < window)
    tolerance.assert_close(got, _np_mha(layer, x, mask=mask), terms=tolerance.LAYER_TERMS)
    with pytest.raises(ValueError, match="value_mask"):
        layer(x[:, :2], x[:, :2], use_causal_mask=True, cache=cache, cache_index=6,
              value_mask=np.ones((1, window), bool))


def test_key_mask_shape_errors(layer, rng):
    x = rng.normal(size=(2, 3, 8)).astype("float32")
    with pytest.raises(ValueError, match=r"value_mask.*\(2, 5\)"):
        layer(x, x, use_causal_mask=True, cache=_cache(), cache_index=0,
              value_mask=np.ones((2, 5), bool))
    with pytest.raises(ValueError, match="key_mask"):
        layer(x, x, use_causal_mask=True, cache=_cache(), cache_index=0,
              key_mask=np.ones((2, 3, 1), bool))


def test_decoder_block_prefill_with_keras_mask(rng):
    """The crash reported for Keras-masked decoder inputs in a cached prefill."""
    ids = np.array([[3, 4, 5, 0], [5, 6, 7, 8]])
    x = keras.layers.Embedding(10, 8, mask_zero=True)(ids)
    block = TransformerDecoderBlock(num_heads=2, intermediate_dim=16)
    full = block(np.asarray(x), decoder_padding_mask=ids > 0)
    cache = {"self_attention": _cache(), "cross_attention": None}
    got, _ = block(x, cache=cache, cache_index=0)
    valid = ids > 0
    tolerance.assert_close(np.asarray(got)[valid], np.asarray(full)[valid], terms=tolerance.LAYER_TERMS)
