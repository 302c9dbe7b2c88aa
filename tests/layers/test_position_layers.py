"""Position layers against NumPy references."""

import math

import keras
import numpy as np
import pytest

from keras_attn import layers as kal
from tests import reference as ref
from tests import tolerance


@pytest.mark.parametrize("dim, start", [(8, 0), (7, 3)])
def test_sinusoidal(dim, start):
    x = np.zeros((2, 6, dim), "float32")
    out = kal.SinusoidalPositionEncoding(max_wavelength=1000)(x, start_index=start)
    want = ref.sinusoidal(6, dim, 1000.0, start)
    tolerance.assert_close(out[1], want, terms=tolerance.LAYER_TERMS)
    assert tuple(out.shape) == x.shape


def test_sinusoidal_extrapolates_beyond_training_lengths():
    out = kal.SinusoidalPositionEncoding()(np.zeros((1, 3, 4), "float32"), start_index=100000)
    # sin is 1-Lipschitz: the error is that of the float32 angle pos * freq
    # (the frequency's and the product's roundings), i.e. ulps of the position.
    tolerance.assert_close(out[0], ref.sinusoidal(3, 4, start=100000), scale=100003, ulps=4)


def test_learned_position_embedding_slices_and_errors():
    layer = kal.LearnedPositionEmbedding(sequence_length=10)
    x = np.zeros((2, 4, 3), "float32")
    out = layer(x, start_index=5)
    np.testing.assert_array_equal(out[0], layer.position_embeddings.numpy()[5:9])
    with pytest.raises(ValueError, match="covers 10 positions"):
        layer(np.zeros((1, 11, 3), "float32"))
    with pytest.raises(ValueError, match="start_index"):
        layer(x, start_index=7)
    with pytest.raises(ValueError, match="start_index"):
        layer(x, start_index=-1)


@pytest.mark.parametrize("shape", [(2, 5, 3, 8), (2, 5, 6)])
def test_rotary(rng, shape):
    x = rng.standard_normal(shape).astype("float32")
    out = kal.RotaryEmbedding(max_wavelength=500, scaling_factor=2.0)(x, start_index=4)
    tolerance.assert_close(out, ref.rotary(x, 500.0, start=4, scaling_factor=2.0), terms=tolerance.LAYER_TERMS)


def test_rotary_relative_property(rng):
    """q.k after RoPE depends only on the distance between positions."""
    rope = kal.RotaryEmbedding()
    q = np.broadcast_to(rng.standard_normal((1, 1, 8)), (1, 12, 8)).astype("float32")
    k = np.broadcast_to(rng.standard_normal((1, 1, 8)), (1, 12, 8)).astype("float32")
    rq, rk = np.asarray(rope(q)), np.asarray(rope(k))
    dots = np.einsum("qd,kd->qk", rq[0], rk[0])
    tolerance.assert_close(dots[5, 2], dots[9, 6], terms=tolerance.LAYER_TERMS)


@pytest.mark.parametrize("heads", [4, 6, 8])
def test_alibi(heads):
    q = np.zeros((2, 3, 16), "float32")
    k = np.zeros((2, 7, 16), "float32")
    out = np.asarray(kal.AlibiBias(heads)(q, k, start_index=4))
    slopes = np.array(ref.alibi_slopes(heads))
    dist = np.abs((np.arange(3)[:, None] + 4) - np.arange(7)[None])
    np.testing.assert_allclose(out[0], -slopes[:, None, None] * dist[None], rtol=1e-6)


@pytest.mark.parametrize("bidirectional", [True, False])
def test_relative_position_bias(rng, bidirectional):
    layer = kal.RelativePositionBias(3, num_buckets=16, max_distance=40, bidirectional=bidirectional)
    q = np.zeros((1, 50, 4), "float32")
    layer(q)
    table = rng.standard_normal((16, 3)).astype("float32")
    layer.set_weights([table])
    out = np.asarray(layer(q, start_index=2))
    for i in range(0, 50, 7):
        for j in range(0, 50, 3):
            bucket = ref.t5_bucket(j - (i + 2), bidirectional, 16, 40)
            tolerance.assert_close(out[0, :, i, j], table[bucket], terms=tolerance.LAYER_TERMS)


@pytest.mark.parametrize("position", ["sinusoidal", "learned"])
def test_token_and_position_embedding(position):
    layer = kal.TokenAndPositionEmbedding(20, 8, 6, position=position, mask_zero=True)
    ids = np.array([[3, 4, 0, 0], [5, 6, 7, 1]])
    out = np.asarray(layer(ids, start_index=2))
    tokens = layer.token_embedding.embeddings.numpy()[ids]
    if position == "sinusoidal":
        pos = ref.sinusoidal(4, 6, start=2)
    else:
        pos = layer.position_embedding.position_embeddings.numpy()[2:6]
    tolerance.assert_close(out, tokens + pos[None], terms=tolerance.LAYER_TERMS)
    np.testing.assert_array_equal(layer.compute_mask(ids), ids != 0)


def test_start_index_matches_full_pass():
    """Positions of a suffix computed with start_index equal those of the full pass."""
    x = np.zeros((1, 9, 6), "float32")
    for layer in (kal.SinusoidalPositionEncoding(), kal.LearnedPositionEmbedding(12), kal.RotaryEmbedding()):
        inp = x + np.arange(6, dtype="float32") if isinstance(layer, kal.RotaryEmbedding) else x
        full = np.asarray(layer(inp))
        tolerance.assert_close(np.asarray(layer(inp[:, 5:], start_index=5)), full[:, 5:], terms=tolerance.LAYER_TERMS)


def test_positions_are_float32_under_mixed_precision():
    keras.mixed_precision.set_global_policy("mixed_float16")
    layer = kal.SinusoidalPositionEncoding()
    out = layer(np.zeros((1, 3, 4), "float16"), start_index=30000)
    assert keras.backend.standardize_dtype(out.dtype) == "float16"
    # Angles in float32 (ulps of the position), then one float16 rounding of
    # values <= 1; at 30000 a float16 angle would be off by up to 16.
    want = ref.sinusoidal(3, 4, start=30000)
    got = np.asarray(out, "float32")[0]
    assert np.abs(got - want).max() <= tolerance.bound(30003, ulps=4) + tolerance.bound(1.0, ulps=1, dtype="float16")


@pytest.mark.tensorflow_only
def test_learned_positions_past_the_table_raise_when_static():
    import tensorflow as tf

    layer = kal.LearnedPositionEmbedding(sequence_length=10)
    x = np.zeros((1, 4, 3), "float32")
    layer(x)  # builds the table
    table = layer.position_embeddings.numpy()
    # NumPy integers are static too (they used to reach the slice unchecked).
    np.testing.assert_array_equal(np.asarray(layer(x, start_index=np.int64(6)))[0], table[6:10])
    with pytest.raises(ValueError, match=r"positions \[7, 11\)"):
        layer(x, start_index=np.int64(7))
    with pytest.raises(ValueError, match="start_index"):
        layer(x, start_index=np.array(-1))
    # A tensor start_index under XLA: in range is exact, a static length longer
    # than the table is rejected while tracing (XLA would clamp the slice).
    run = tf.function(lambda x, start: layer(x, start_index=start), jit_compile=True)
    np.testing.assert_array_equal(np.asarray(run(x, tf.constant(3)))[0], table[3:7])
    with pytest.raises(ValueError, match="covers 10 positions"):
        run(np.zeros((1, 11, 3), "float32"), tf.constant(0))
    tape = kal.TokenAndPositionEmbedding(20, 4, 6, position="learned")
    with pytest.raises(ValueError, match=r"positions \[2, 5\)"):
        tape(np.array([[3, 4, 5]]), start_index=np.int32(2))


def _llama3_inv_freq(dim, base, factor, low, high, original):
    """Llama 3.1's frequency rule, written out per frequency (float64)."""
    out = []
    for i in range(dim // 2):
        freq = base ** (-2 * i / dim)
        wavelength = 2 * math.pi / freq
        if wavelength < original / high:  # short wavelengths: kept
            out.append(freq)
        elif wavelength > original / low:  # long wavelengths: interpolated
            out.append(freq / factor)
        else:
            smooth = (original / wavelength - low) / (high - low)
            out.append((1 - smooth) * freq / factor + smooth * freq)
    return np.array(out)


@pytest.mark.parametrize("start", [0, 37])
def test_rotary_scaling_variants_match_numpy(rng, start):
    dim, length = 16, 11
    x = rng.standard_normal((2, length, 3, dim)).astype("float32")
    base = 500.0

    def check(scaling, inv_freq):
        layer = kal.RotaryEmbedding(max_wavelength=base, rope_scaling=scaling)
        want = ref.rotary(x, start=start, inv_freq=inv_freq)
        tolerance.assert_close(layer(x, start_index=start), want, scale=start + length, terms=dim)
        again = kal.RotaryEmbedding.from_config(layer.get_config())
        np.testing.assert_array_equal(again(x, start_index=start), layer(x, start_index=start))

    plain = base ** (-np.arange(0, dim, 2) / dim)
    check({"rope_type": "linear", "factor": 4.0}, plain / 4.0)
    llama3 = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                  original_max_position_embeddings=64)
    inv = _llama3_inv_freq(dim, base, 8.0, 1.0, 4.0, 64)
    assert (inv == plain).any() and (inv == plain / 8).any() and len(set(inv / plain)) > 2, (
        "the test frequencies must cover the kept, divided and blended bands")
    check(llama3, inv)
    # Dynamic NTK: unchanged up to the original length, a larger base past it.
    original, factor = 20, 2.0
    seq = max(start + length, original)
    dyn_base = base * (factor * seq / original - (factor - 1)) ** (dim / (dim - 2))
    check({"rope_type": "dynamic", "factor": factor, "original_max_position_embeddings": original},
          dyn_base ** (-np.arange(0, dim, 2) / dim))
    check({"rope_type": "default"}, plain)


@pytest.mark.parametrize(
    "scaling, match",
    [
        ({"rope_type": "yarn", "factor": 2.0}, "rope_type"),
        ({"rope_type": "linear"}, "factor"),
        ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0,
          "original_max_position_embeddings": 64}, "high_freq_factor"),
        ("linear", "rope_scaling"),
    ],
)
def test_rotary_scaling_errors(scaling, match):
    with pytest.raises((ValueError, TypeError), match=match):
        kal.RotaryEmbedding(rope_scaling=scaling)
