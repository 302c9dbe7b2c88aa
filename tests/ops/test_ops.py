"""keras_attn.ops against the NumPy reference."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_attn import ops as ka_ops
from tests import reference as ref
from tests import tolerance


def _qkv(rng, b=2, tq=5, tk=7, h=4, hkv=4, d=8, dv=6):
    q = rng.standard_normal((b, tq, h, d)).astype("float32")
    k = rng.standard_normal((b, tk, hkv, d)).astype("float32")
    v = rng.standard_normal((b, tk, hkv, dv)).astype("float32")
    return q, k, v


@pytest.mark.parametrize("hkv", [4, 2, 1])
@pytest.mark.parametrize("causal", [False, True])
def test_dot_product_attention_matches_reference(rng, hkv, causal):
    q, k, v = _qkv(rng, hkv=hkv, tq=6, tk=6)
    out, scores = ka_ops.dot_product_attention(
        q, k, v, is_causal=causal, return_attention_scores=True
    )
    mask = ref.causal(6)[None, None] if causal else None
    want, want_probs = ref.attention(q, k, v, mask=mask)
    tolerance.assert_close(out, want, terms=tolerance.LAYER_TERMS)
    tolerance.assert_close(scores, want_probs, terms=tolerance.LAYER_TERMS)


@pytest.mark.parametrize(
    "mask_shape", [(5, 7), (1, 7), (4, 5, 7), (1, 5, 7), (2, 1, 5, 7), (2, 4, 5, 7), (2, 4, 1, 7)]
)
def test_explicit_mask_shapes_broadcast_right_aligned(rng, mask_shape):
    """As keras.ops.dot_product_attention and torch SDPA: the mask broadcasts
    against (B, H, T_q, T_k) from the right (NumPy's rule)."""
    q, k, v = _qkv(rng)
    mask = rng.random(mask_shape) > 0.4
    out = ka_ops.dot_product_attention(q, k, v, attention_mask=mask)
    full = np.broadcast_to(mask.reshape((1,) * (4 - mask.ndim) + mask_shape), (2, 4, 5, 7))
    want, _ = ref.attention(q, k, v, mask=full)
    tolerance.assert_close(out, want, terms=tolerance.LAYER_TERMS)


def test_key_padding_mask_has_its_own_argument(rng):
    q, k, v = _qkv(rng)
    valid = rng.random((2, 7)) > 0.4
    out = ka_ops.dot_product_attention(q, k, v, key_padding_mask=valid)
    want, _ = ref.attention(q, k, v, mask=valid[:, None, None, :])
    tolerance.assert_close(out, want, terms=tolerance.LAYER_TERMS)
    with pytest.raises(ValueError, match=r"key_padding_mask.*\(2, 5\)"):
        ka_ops.dot_product_attention(q, k, v, key_padding_mask=valid[:, :5])


def test_batch_by_key_mask_is_rejected_not_guessed(rng):
    """A (B, T_k) or (B, T_q, T_k) mask does not broadcast to (B, H, T_q, T_k):
    a clear error naming the way out, never a guess from the batch size."""
    q, k, v = _qkv(rng)
    with pytest.raises(ValueError, match="key_padding_mask"):
        ka_ops.dot_product_attention(q, k, v, attention_mask=np.ones((2, 7), bool))
    with pytest.raises(ValueError, match="expand_dims"):
        ka_ops.dot_product_attention(q, k, v, attention_mask=np.ones((2, 5, 7), bool))


def test_mask_bias_scale_and_causal_combine(rng):
    q, k, v = _qkv(rng, tq=5, tk=5)
    mask = rng.random((2, 5)) > 0.3
    bias = rng.standard_normal((1, 4, 5, 5)).astype("float32")
    out = ka_ops.dot_product_attention(
        q, k, v, key_padding_mask=mask, bias=bias, is_causal=True, scale=0.3
    )
    full = mask[:, None, None, :] & ref.causal(5)[None, None]
    want, _ = ref.attention(q, k, v, mask=full, bias=bias, scale=0.3)
    tolerance.assert_close(out, want, terms=tolerance.LAYER_TERMS)


@pytest.mark.tensorflow_only
def test_fully_masked_rows_are_zero_with_zero_gradients(rng):
    q, k, v = _qkv(rng)
    mask = np.ones((2, 5, 7), bool)
    mask[0, 2] = False
    mask[1] = False
    q_t, k_t, v_t = (tf.Variable(x) for x in (q, k, v))
    for dropout in (0.0, 0.5):
        with tf.GradientTape() as tape:
            out, scores = ka_ops.dot_product_attention(
                q_t, k_t, v_t, attention_mask=mask[:, None], return_attention_scores=True,
                dropout_rate=dropout, training=True, seed=3,
            )
            loss = tf.reduce_sum(out[0, 2] ** 2) + tf.reduce_sum(out[1] ** 2)
        assert np.all(np.isfinite(out.numpy()))
        np.testing.assert_array_equal(out.numpy()[0, 2], 0.0)
        np.testing.assert_array_equal(out.numpy()[1], 0.0)
        np.testing.assert_array_equal(scores.numpy()[0, :, 2], 0.0)
        grads = tape.gradient(loss, [q_t, k_t, v_t])
        for g in grads:
            assert g is None or np.all(np.asarray(g) == 0.0)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_low_precision_large_logits_stay_finite(rng, dtype):
    # Logits far beyond the float16 range when computed in float16.
    q = np.full((1, 3, 2, 64), 60.0, "float32")
    k = np.full((1, 4, 2, 64), 60.0, "float32")
    v = rng.standard_normal((1, 4, 2, 8)).astype("float32")
    mask = np.array([[True, True, False, False]])
    out = ka_ops.dot_product_attention(
        keras.ops.cast(q, dtype), keras.ops.cast(k, dtype), keras.ops.cast(v, dtype),
        attention_mask=mask,
    )
    assert keras.backend.standardize_dtype(out.dtype) == dtype
    out = np.asarray(keras.ops.cast(out, "float32"))
    assert np.all(np.isfinite(out))
    want, _ = ref.attention(q, k, v, mask=mask[:, None, None, :])
    # An average of the values in `dtype`: a few roundings of |v|.
    tolerance.assert_close(out, want, scale=tolerance.magnitude(v), ulps=8, dtype=dtype)


def test_empty_batch_and_length_one(rng):
    q, k, v = _qkv(rng, b=0)
    assert tuple(ka_ops.dot_product_attention(q, k, v, is_causal=True).shape) == (0, 5, 4, 6)
    q, k, v = _qkv(rng, tq=1, tk=1)
    out = ka_ops.dot_product_attention(q, k, v, is_causal=True)
    tolerance.assert_close(out, np.asarray(v, np.float64), terms=tolerance.LAYER_TERMS)


def test_mask_helpers():
    np.testing.assert_array_equal(ka_ops.causal_mask(3, 5, start_index=2), ref.causal(3, 5, offset=2))
    m = ka_ops.padding_mask_to_attention_mask(
        query_mask=np.array([[1, 1, 0]]), value_mask=np.array([[1, 0]])
    )
    np.testing.assert_array_equal(
        np.asarray(m)[0, 0], np.array([[1, 0], [1, 0], [0, 0]], bool)
    )
    both = ka_ops.combine_masks(None, np.array([True, False]), np.array([True, True]), None)
    np.testing.assert_array_equal(both, [True, False])
    assert ka_ops.combine_masks(None, None) is None
    band = ka_ops.sliding_window_mask(4, window=2)
    np.testing.assert_array_equal(band, np.abs(np.arange(4)[:, None] - np.arange(4)[None]) < 2)


def test_dropout_is_a_scaled_mask_of_the_probabilities(rng):
    q, k, v = _qkv(rng)
    _, probs = ka_ops.dot_product_attention(q, k, v, return_attention_scores=True)
    v_eye = np.broadcast_to(np.eye(7, dtype="float32")[None, :, None, :], (2, 7, 4, 7)).copy()
    out = np.asarray(ka_ops.dot_product_attention(
        q, k, v_eye, dropout_rate=0.5, training=True, seed=keras.random.SeedGenerator(1)
    ))
    # With identity values the output is the dropped-out probability matrix.
    kept = out.transpose(0, 2, 1, 3)
    nz = kept != 0
    assert 0.3 < nz.mean() < 0.7
    np.testing.assert_allclose(kept[nz], 2.0 * np.asarray(probs)[nz], rtol=1e-5)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(dropout_rate=1.0), "dropout_rate"),
        (dict(dropout_rate=float("nan")), "dropout_rate"),
        (dict(attention_mask=np.ones((2, 3, 4, 5, 7), bool)), "attention_mask"),
        (dict(attention_mask=np.ones((3, 5, 7), bool)), "attention_mask"),
    ],
)
def test_bad_arguments(rng, kwargs, match):
    q, k, v = _qkv(rng)
    with pytest.raises(ValueError, match=match):
        ka_ops.dot_product_attention(q, k, v, **kwargs)


def test_bad_shapes(rng):
    q, k, v = _qkv(rng, hkv=3 if False else 4)
    with pytest.raises(ValueError, match="rank 4"):
        ka_ops.dot_product_attention(q[..., 0], k, v)
    with pytest.raises(ValueError, match="multiple"):
        ka_ops.dot_product_attention(q, k[:, :, :3], v[:, :, :3])
    with pytest.raises(ValueError, match="head size"):
        ka_ops.dot_product_attention(q, k[..., :4], v)
    with pytest.raises(ValueError, match="sequence length"):
        ka_ops.dot_product_attention(q, k, v[:, :3])
    with pytest.raises(TypeError, match="attention_mask"):
        ka_ops.dot_product_attention(q, k, v, attention_mask=np.array([["a"] * 7] * 2))


def test_mask_dtype_check_reads_every_backend_dtype():
    """`torch.bool` / `torch.float16` (how torch spells them) are masks;
    strings are not."""
    torch = pytest.importorskip("torch")
    from keras_attn import checks

    for dtype in (torch.bool, torch.float16, torch.int64, np.dtype("bool")):
        checks.check_mask_dtype("attention_mask", type("M", (), {"dtype": dtype})())
    with pytest.raises(TypeError, match="attention_mask.dtype=<U1"):
        checks.check_mask_dtype("attention_mask", np.array(["a"]))


def test_sliding_window_without_causal_is_the_band(rng):
    q, k, v = _qkv(rng, tq=9, tk=9)
    out = ka_ops.dot_product_attention(q, k, v, sliding_window=2)
    band = np.abs(np.arange(9)[:, None] - np.arange(9)[None, :]) < 2
    want, _ = ref.attention(q, k, v, mask=band[None, None])
    tolerance.assert_close(out, want, terms=tolerance.LAYER_TERMS)
    with pytest.raises(ValueError, match="sliding_window=0"):
        ka_ops.dot_product_attention(q, k, v, sliding_window=0)


@pytest.mark.parametrize("causal,window", [(False, None), (True, None), (False, 2), (True, 3)])
def test_mask_from_positions_matches_numpy(rng, causal, window):
    """Arbitrary (ring-buffer-like, unordered, negative) key positions,
    padding and an explicit mask, against a NumPy mask."""
    q_pos = np.array([5, 6, 7], "int32")
    k_pos = np.array([-1, 8, 3, 4, 7, 6, 5], "int32")
    query_valid = rng.random((2, 3)) > 0.3
    key_valid = rng.random((2, 7)) > 0.3
    explicit = rng.random((2, 1, 3, 7)) > 0.2
    want = np.ones((2, 1, 3, 7), bool)
    diff = q_pos[:, None] - k_pos[None, :]
    if causal:
        want &= diff >= 0
    if window is not None:
        want &= np.abs(diff) < window
    want &= query_valid[:, None, :, None] & key_valid[:, None, None, :] & explicit
    got = ka_ops.mask_from_positions(
        q_pos, k_pos, is_causal=causal, sliding_window=window, query_valid=query_valid,
        key_valid=key_valid, attention_mask=explicit,
    )
    np.testing.assert_array_equal(np.broadcast_to(np.asarray(got), want.shape), want)
    band = ka_ops.band(q_pos, k_pos, is_causal=causal, sliding_window=window)
    if not causal and window is None:
        assert band is None
    else:
        np.testing.assert_array_equal(
            np.asarray(band), (diff >= 0 if causal else True) & (
                np.abs(diff) < window if window else True))
