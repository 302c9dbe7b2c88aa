"""MultiHeadAttention as a drop-in for keras.layers.MultiHeadAttention.

Every numeric check compares against Keras's own layer with copied weights
(or NumPy). Runs on every Keras backend.
"""

import keras
import numpy as np
import pytest
from keras import ops

from keras_attn import layers as kal
from tests import tolerance

C = ops.convert_to_numpy


def _keras_and_ours(rng, query_shape, value_shape=None, **kwargs):
    value_shape = value_shape or query_shape
    theirs = keras.layers.MultiHeadAttention(**kwargs)
    theirs.build(query_shape, value_shape)
    theirs.set_weights(
        [rng.standard_normal(w.shape).astype("float32") * 0.3 for w in theirs.get_weights()]
    )
    return theirs, kal.MultiHeadAttention.from_keras(theirs)


# --- N-D attention_axes -------------------------------------------------------

ND_CASES = {
    # query (B, ...), value (B, ...), attention_axes
    "image_hw": ((2, 3, 4, 8), (2, 3, 4, 8), (1, 2)),
    "rows_only": ((2, 3, 4, 8), (2, 3, 2, 8), (2,)),
    "rows_negative": ((2, 3, 4, 8), (2, 3, 2, 8), (-2,)),
    "5d_two_axes": ((2, 2, 3, 4, 8), (2, 2, 3, 2, 8), (2, 3)),
    "5d_default_all_axes": ((2, 2, 3, 2, 8), (2, 1, 2, 5, 8), None),
}


@pytest.mark.parametrize("case", sorted(ND_CASES))
@pytest.mark.parametrize("use_gate", [False, True])
def test_nd_attention_axes_match_keras(rng, case, use_gate):
    q_shape, v_shape, axes = ND_CASES[case]
    theirs, ours = _keras_and_ours(
        rng, q_shape, v_shape, num_heads=2, key_dim=3, attention_axes=axes, use_gate=use_gate
    )
    assert ours.attention_axes == theirs.attention_axes
    q = rng.standard_normal(q_shape).astype("float32")
    v = rng.standard_normal(v_shape).astype("float32")
    want, want_scores = theirs(q, v, return_attention_scores=True)
    got, got_scores = ours(q, v, return_attention_scores=True)
    tolerance.assert_close(C(got), C(want), terms=tolerance.LAYER_TERMS)
    tolerance.assert_close(C(got_scores), C(want_scores), terms=tolerance.LAYER_TERMS)
    tolerance.assert_close(C(ours(q, v)), C(want), terms=tolerance.LAYER_TERMS)
    assert ours.compute_output_shape(q_shape, v_shape) == tuple(got.shape)


def test_nd_attention_masks_match_keras(rng):
    # Attention over axis 1; axis 2 acts as a batch axis. (Keras builds the
    # causal mask over axis 1, so only this layout has a causal meaning.)
    q_shape = (2, 4, 3, 8)
    theirs, ours = _keras_and_ours(rng, q_shape, q_shape, num_heads=2, key_dim=3, attention_axes=(1,))
    q = rng.standard_normal(q_shape).astype("float32")
    # Keras's N-D mask layout: (B, *other, *q_axes, *k_axes) gains the head axis.
    mask = rng.random((2, 3, 4, 4)) > 0.3
    mask[..., 0] = True
    for kwargs in ({"attention_mask": mask}, {"use_causal_mask": True}):
        want = theirs(q, q, **kwargs)
        tolerance.assert_close(C(ours(q, q, **kwargs)), C(want), terms=tolerance.LAYER_TERMS)


def test_nd_attention_in_a_functional_model_saves_and_reloads(rng, tmp_path):
    x = keras.Input((3, 4, 8))
    layer = kal.MultiHeadAttention(num_heads=2, key_dim=4, attention_axes=(1, 2))
    model = keras.Model(x, layer(x, x))
    data = rng.standard_normal((2, 3, 4, 8)).astype("float32")
    path = str(tmp_path / "nd.keras")
    model.save(path)
    restored = keras.saving.load_model(path)
    tolerance.assert_close(C(restored(data)), C(model(data)), terms=tolerance.LAYER_TERMS)
    peer = keras.layers.MultiHeadAttention(num_heads=2, key_dim=4, attention_axes=(1, 2))
    peer.build(data.shape, data.shape)
    peer.set_weights(layer.get_weights())
    tolerance.assert_close(C(model(data)), C(peer(data, data)), terms=tolerance.LAYER_TERMS)


# --- Keras's public properties, LoRA, shape checks ----------------------------


def test_public_sublayer_properties_and_lora_recipe(rng):
    theirs, ours = _keras_and_ours(rng, (2, 5, 8), num_heads=2, key_dim=4, use_bias=False)
    for name in ("query_dense", "key_dense", "value_dense", "output_dense"):
        assert getattr(ours, name) is getattr(ours, "_" + name)
        assert getattr(ours, name).kernel.shape == getattr(theirs, name).kernel.shape
    for layer in (ours, theirs):
        for name in ("query_dense", "key_dense", "value_dense"):
            getattr(layer, name).enable_lora(2)
    assert len(ours.trainable_variables) == len(theirs.trainable_variables)
    assert len(ours.non_trainable_variables) == len(theirs.non_trainable_variables)
    # Non-zero LoRA factors, the same in both layers.
    for name in ("query_dense", "key_dense", "value_dense"):
        for a, b in ((getattr(ours, name).lora_kernel_a, getattr(theirs, name).lora_kernel_a),
                     (getattr(ours, name).lora_kernel_b, getattr(theirs, name).lora_kernel_b)):
            value = rng.standard_normal(a.shape).astype("float32") * 0.3
            a.assign(value)
            b.assign(value)
    x = rng.standard_normal((2, 5, 8)).astype("float32")
    tolerance.assert_close(C(ours(x, x)), C(theirs(x, x)), terms=tolerance.LAYER_TERMS)


@pytest.mark.parametrize(
    "query_shape,value_shape,key_shape",
    [((2, 4, 8), (2, 2, 7), (2,)), ((2, 4, 8), (2, 2, 8), (2, 1, 7)),
     ((2, 4, 2, 3, 8), (2, 1, 1, 5, 8), (2, 1, 15, 5, 2))],
)
def test_value_key_shape_mismatch_is_rejected_like_keras(query_shape, value_shape, key_shape):
    layer = kal.MultiHeadAttention(num_heads=2, key_dim=2)
    with pytest.raises(ValueError, match="All dimensions of `value` and `key`, except the last one, must be equal"):
        layer.compute_output_shape(query_shape, value_shape, key_shape)
    with pytest.raises(ValueError, match="must be equal"):
        layer(np.ones(query_shape), np.ones(value_shape), np.ones(key_shape))


def test_output_shape_argument_errors_like_keras():
    with pytest.raises(ValueError, match=r"Invalid `output_shape`: 8.0"):
        kal.MultiHeadAttention(num_heads=2, key_dim=4, output_shape=8.0)
    with pytest.raises(ValueError, match="`attention_axes` must be an int, list, or tuple"):
        kal.MultiHeadAttention(num_heads=2, key_dim=4, attention_axes="1")
    with pytest.raises(ValueError, match="attention_axes"):
        kal.MultiHeadAttention(num_heads=2, key_dim=4, attention_axes=3)(
            np.ones((1, 2, 3)), np.ones((1, 2, 3))
        )


def test_symbolic_scores_shape_matches_eager(rng):
    layer = kal.MultiHeadAttention(num_heads=2, key_dim=4)
    q, v = keras.Input((5, 8), batch_size=2), keras.Input((3, 6), batch_size=2)
    out, scores = layer(q, v, return_attention_scores=True)
    eager_out, eager_scores = layer(
        np.ones((2, 5, 8), "float32"), np.ones((2, 3, 6), "float32"), return_attention_scores=True
    )
    assert tuple(out.shape) == tuple(eager_out.shape) == (2, 5, 8)
    assert tuple(scores.shape) == tuple(eager_scores.shape) == (2, 2, 5, 3)


# --- flash_attention ----------------------------------------------------------


def test_flash_attention_argument_behaves_as_keras(rng):
    with pytest.raises(ValueError, match="Dropout is not supported when flash attention is enabled"):
        kal.MultiHeadAttention(num_heads=2, key_dim=4, flash_attention=True, dropout=0.1)
    layer = kal.MultiHeadAttention(num_heads=2, key_dim=4, flash_attention=True)
    assert layer._flash_attention
    x = rng.standard_normal((2, 3, 8)).astype("float32")
    with pytest.raises(ValueError, match="Returning attention scores is not supported"):
        layer(x, x, return_attention_scores=True)
    theirs, ours = _keras_and_ours(rng, (2, 3, 8), num_heads=2, key_dim=4, flash_attention=False)
    assert not ours._flash_attention and not theirs._flash_attention
    tolerance.assert_close(C(ours(x, x)), C(theirs(x, x)), terms=tolerance.LAYER_TERMS)


def test_flash_attention_true_works_or_fails_where_keras_does(rng):
    # Flash kernels need accelerators: on a CPU Keras's op raises. Either
    # way, ours does what keras.layers.MultiHeadAttention does.
    x = rng.standard_normal((2, 4, 16)).astype("float16")

    def run(cls):
        layer = cls(num_heads=2, key_dim=8, flash_attention=True, dtype="float16")
        layer.build(x.shape, x.shape)
        layer.set_weights([np.full(w.shape, 0.05, "float16") for w in layer.get_weights()])
        try:
            return C(layer(x, x))
        except Exception as error:  # noqa: BLE001 - compared below
            return type(error)

    want, got = run(keras.layers.MultiHeadAttention), run(kal.MultiHeadAttention)
    if isinstance(want, type):
        assert got is want
    else:
        # Both in float16: a few roundings of the inputs' magnitude.
        tolerance.assert_close(got, want, scale=tolerance.magnitude(x), ulps=10, dtype="float16")


# --- the _compute_attention override point ------------------------------------


class _Recording(kal.MultiHeadAttention):
    """Keras's documented override, with Keras's signature (no causal flag)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls = []

    def _compute_attention(self, query, key, value, attention_mask=None, training=None,
                           return_attention_scores=False):
        self.calls.append((tuple(query.shape), tuple(key.shape),
                           None if attention_mask is None else C(attention_mask)))
        return super()._compute_attention(
            query, key, value, attention_mask, training, return_attention_scores
        )


class _Uniform(kal.MultiHeadAttention):
    """Replaces attention by the plain mean of the values over keys."""

    def _compute_attention(self, query, key, value, attention_mask=None, training=None,
                           return_attention_scores=False):
        mean = ops.mean(value, axis=1, keepdims=True)
        return ops.broadcast_to(mean, query.shape[:2] + tuple(value.shape[2:])), None


def test_override_sees_the_causal_mask_and_matches_keras(rng):
    theirs = keras.layers.MultiHeadAttention(num_heads=2, key_dim=4)
    theirs.build((2, 5, 8), (2, 5, 8))
    sub = _Recording(num_heads=2, key_dim=4)
    sub.build((2, 5, 8), (2, 5, 8))
    sub.set_weights(theirs.get_weights())
    x = rng.standard_normal((2, 5, 8)).astype("float32")
    got = sub(x, x, use_causal_mask=True)
    tolerance.assert_close(C(got), C(theirs(x, x, use_causal_mask=True)), terms=tolerance.LAYER_TERMS)
    mask = sub.calls[-1][2]
    assert mask is not None
    np.testing.assert_array_equal(np.broadcast_to(mask, (2, 5, 5))[0], np.tril(np.ones((5, 5), bool)))


def test_override_is_used_uncached_and_cached(rng):
    layer = _Uniform(num_heads=2, key_dim=4, use_bias=False)
    x = rng.standard_normal((1, 4, 8)).astype("float32")
    out = C(layer(x, x))
    w_v = C(layer.value_dense.kernel)
    w_o = C(layer.output_dense.kernel)
    v = np.einsum("btf,fhd->bthd", x, w_v)
    want = np.einsum("bhd,hdo->bo", v.mean(1), w_o)[:, None, :]
    tolerance.assert_close(out, np.broadcast_to(want, out.shape), terms=tolerance.LAYER_TERMS)
    # Cached: the cache (4 slots) holds the projected values; the override
    # averages over every slot (zeros included), as it was written to.
    cache = (np.zeros((1, 4, 2, 4), "float32"), np.zeros((1, 4, 2, 4), "float32"))
    out_c, new_cache = layer(x[:, :1], x[:, :1], cache=cache, cache_index=0, use_causal_mask=True)
    v1 = np.einsum("btf,fhd->bthd", x[:, :1], w_v)
    tolerance.assert_close(C(new_cache[1])[:, :1], v1, terms=tolerance.LAYER_TERMS)
    want_c = np.einsum("bhd,hdo->bo", v1[:, 0] / 4, w_o)[:, None, :]
    tolerance.assert_close(C(out_c), want_c, terms=tolerance.LAYER_TERMS)


def test_recording_override_matches_base_layer_with_cache(rng):
    base = kal.MultiHeadAttention(num_heads=2, key_dim=4)
    sub = _Recording(num_heads=2, key_dim=4)
    x = rng.standard_normal((1, 3, 8)).astype("float32")
    base(x, x)
    sub(x, x)
    sub.set_weights(base.get_weights())
    sub.calls.clear()
    cache = (np.zeros((1, 6, 2, 4), "float32"),) * 2
    want, _ = base(x, x, cache=cache, cache_index=0, use_causal_mask=True)
    got, _ = sub(x, x, cache=cache, cache_index=0, use_causal_mask=True)
    tolerance.assert_close(C(got), C(want), terms=tolerance.LAYER_TERMS)
    assert len(sub.calls) == 1 and sub.calls[0][1] == (1, 6, 2, 4)
    # Equal to uncached causal attention over the 3 tokens.
    tolerance.assert_close(C(got), C(base(x, x, use_causal_mask=True)), terms=tolerance.LAYER_TERMS)


@pytest.mark.parametrize("use_gate", [False, True])
def test_set_weights_from_keras_get_weights(rng, use_gate):
    theirs = keras.layers.MultiHeadAttention(num_heads=2, key_dim=4, use_gate=use_gate)
    theirs.build((2, 5, 8), (2, 3, 6))
    theirs.set_weights([rng.standard_normal(w.shape).astype("float32") for w in theirs.get_weights()])
    ours = kal.MultiHeadAttention(num_heads=2, key_dim=4, use_gate=use_gate)
    ours.build((2, 5, 8), (2, 3, 6))
    ours.set_weights(theirs.get_weights())
    q = rng.standard_normal((2, 5, 8)).astype("float32")
    v = rng.standard_normal((2, 3, 6)).astype("float32")
    tolerance.assert_close(C(ours(q, v)), C(theirs(q, v)), terms=tolerance.LAYER_TERMS)
