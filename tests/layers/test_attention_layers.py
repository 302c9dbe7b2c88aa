"""Attention layers against NumPy references and keras.layers.MultiHeadAttention."""

import keras
import numpy as np
import pytest

import keras_attn
from keras_attn import layers as kal
from tests import reference as ref
from tests import tolerance
from tests.model_zoo import randomize


def test_public_api_is_reexported():
    for name in kal.__all__:
        assert getattr(keras_attn, name) is getattr(kal, name)


# --- DotProductAttention -------------------------------------------------------

@pytest.mark.parametrize("scale", ["sqrt", None, 0.25])
def test_dot_product_attention_layer(rng, scale):
    q = rng.standard_normal((2, 4, 8)).astype("float32")
    v = rng.standard_normal((2, 6, 5)).astype("float32")
    k = rng.standard_normal((2, 6, 8)).astype("float32")
    value_mask = np.array([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]], bool)
    out, scores = kal.DotProductAttention(scale=scale)(
        q, v, k, value_mask=value_mask, return_attention_scores=True
    )
    s = {"sqrt": 1 / np.sqrt(8), None: 1.0, 0.25: 0.25}[scale]
    want, probs = ref.attention(
        q[:, :, None], k[:, :, None], v[:, :, None], mask=value_mask[:, None, None, :], scale=s
    )
    tolerance.assert_close(out, want[:, :, 0], terms=tolerance.LAYER_TERMS)
    tolerance.assert_close(scores, probs[:, 0], terms=tolerance.LAYER_TERMS)


# --- AdditiveAttention -----------------------------------------------------------

def test_additive_attention_matches_bahdanau(rng):
    layer = kal.AdditiveAttention(units=7)
    q = rng.standard_normal((2, 3, 5)).astype("float32")
    v = rng.standard_normal((2, 6, 4)).astype("float32")
    k = rng.standard_normal((2, 6, 9)).astype("float32")
    layer(q, v, k)
    randomize(layer, rng)
    mask = np.array([[1, 1, 1, 0, 0, 0], [1] * 6], bool)
    out, scores = layer(q, v, k, value_mask=mask, return_attention_scores=True)
    wq, bq = layer.query_dense.kernel.numpy(), layer.query_dense.bias.numpy()
    wk = layer.key_dense.kernel.numpy()
    vw = layer.score_weight.numpy()
    want = np.zeros((2, 3, 4))
    want_scores = np.zeros((2, 3, 6))
    for b in range(2):
        for i in range(3):
            e = np.array(
                [vw @ np.tanh(wq.T @ q[b, i] + bq + wk.T @ k[b, j]) if mask[b, j] else -np.inf for j in range(6)]
            )
            a = np.exp(e - e.max())
            a /= a.sum()
            want_scores[b, i] = a
            want[b, i] = a @ v[b]
    tolerance.assert_close(out, want, terms=tolerance.LAYER_TERMS)
    tolerance.assert_close(scores, want_scores, terms=tolerance.LAYER_TERMS)


# --- MultiHeadAttention ----------------------------------------------------------

@pytest.mark.parametrize("num_kv_heads", [None, 2, 1])
@pytest.mark.parametrize("causal", [False, True])
def test_mha_matches_reference_with_explicit_weights(rng, num_kv_heads, causal):
    layer = kal.MultiHeadAttention(num_heads=4, key_dim=3, value_dim=5, num_key_value_heads=num_kv_heads)
    x = rng.standard_normal((2, 6, 8)).astype("float32")
    mask = np.array([[1, 1, 1, 1, 0, 0], [1] * 6], bool)
    layer(x, x)
    randomize(layer, rng)
    out, scores = layer(x, x, value_mask=mask, use_causal_mask=causal, return_attention_scores=True)
    full = mask[:, None, None, :]
    if causal:
        full = full & ref.causal(6)[None, None]
    want, probs = ref.mha(x, x, x, ref.mha_weights(layer), 4, num_kv_heads or 4, mask=full)
    tolerance.assert_close(out, want, terms=tolerance.LAYER_TERMS)
    tolerance.assert_close(scores, probs, terms=tolerance.LAYER_TERMS)
    hkv = num_kv_heads or 4
    assert tuple(layer.key_dense.kernel.shape) == (8, hkv, 3)


KERAS_CASES = {
    "self": dict(cross=False, causal=False, mask=False),
    "cross": dict(cross=True, causal=False, mask=False),
    "causal": dict(cross=False, causal=True, mask=False),
    "masked": dict(cross=False, causal=False, mask=True),
    "cross_masked_causal": dict(cross=True, causal=True, mask=True),
}


@pytest.mark.parametrize("case", sorted(KERAS_CASES))
@pytest.mark.parametrize("scores", [False, True])
def test_from_keras_parity(rng, case, scores):
    c = KERAS_CASES[case]
    # Keras's own layer fails on JAX when value_dim != key_dim
    # (jax.nn.dot_product_attention needs equal head sizes): equal there.
    value_dim = 4 if keras.backend.backend() == "jax" else 6
    theirs = keras.layers.MultiHeadAttention(num_heads=3, key_dim=4, value_dim=value_dim, output_shape=10)
    q = rng.standard_normal((2, 5, 8)).astype("float32")
    v = rng.standard_normal((2, 7 if c["cross"] else 5, 9 if c["cross"] else 8)).astype("float32")
    if not c["cross"]:
        v = q
    theirs(q, v)
    randomize(theirs, rng)
    ours = kal.MultiHeadAttention.from_keras(theirs)
    kwargs = dict(use_causal_mask=c["causal"], return_attention_scores=scores)
    valid_q = np.ones((2, q.shape[1]), bool)
    if c["mask"]:
        value_mask = np.ones((2, v.shape[1]), bool)
        value_mask[0, -2:] = False
        kwargs["attention_mask"] = np.broadcast_to(value_mask[:, None, :], (2, q.shape[1], v.shape[1]))
    a = ours(q, v, **kwargs)
    b = theirs(q, v, **kwargs)
    if scores:
        tolerance.assert_close(a[1], b[1], terms=tolerance.LAYER_TERMS)
        a, b = a[0], b[0]
    tolerance.assert_close(np.asarray(a)[valid_q], np.asarray(b)[valid_q], terms=tolerance.LAYER_TERMS)


@pytest.mark.parametrize("use_gate", [False, True])
def test_from_keras_gqa_and_errors(rng, use_gate):
    theirs = keras.layers.GroupQueryAttention(
        head_dim=4, num_query_heads=4, num_key_value_heads=2, use_gate=use_gate
    )
    x = rng.standard_normal((2, 5, 8)).astype("float32")
    theirs(x, x)
    randomize(theirs, rng)
    ours = kal.MultiHeadAttention.from_keras(theirs)
    tolerance.assert_close(ours(x, x, use_causal_mask=True), theirs(x, x, use_causal_mask=True), terms=tolerance.LAYER_TERMS)
    with pytest.raises(ValueError, match="built"):
        kal.MultiHeadAttention.from_keras(keras.layers.MultiHeadAttention(2, 4))
    with pytest.raises(TypeError, match="MultiHeadAttention"):
        kal.MultiHeadAttention.from_keras(keras.layers.Dense(3))


def test_keras_masks_propagate_like_keras(rng):
    """Embedding(mask_zero) -> our MHA equals Keras' MHA on the valid positions."""
    tokens = np.array([[3, 4, 5, 0, 0], [6, 7, 8, 9, 2]])
    inp = keras.Input((None,), dtype="int32")
    emb = keras.layers.Embedding(12, 8, mask_zero=True)
    theirs = keras.layers.MultiHeadAttention(2, 4)
    x = emb(inp)
    keras_model = keras.Model(inp, theirs(x, x))
    ours = kal.MultiHeadAttention.from_keras(theirs)
    y = ours(x, x)
    pooled = keras.layers.GlobalAveragePooling1D()(y)
    our_model = keras.Model(inp, [y, pooled])
    out, pooled_out = our_model(tokens)
    valid = tokens != 0
    tolerance.assert_close(np.asarray(out)[valid], np.asarray(keras_model(tokens))[valid], terms=tolerance.LAYER_TERMS)
    # The mask reaches the pooling layer: pooled = mean over valid positions.
    want = np.stack([np.asarray(out)[b][valid[b]].mean(0) for b in range(2)])
    tolerance.assert_close(pooled_out, want, terms=tolerance.LAYER_TERMS)


def test_fully_masked_query_rows_output_bias_only(rng):
    layer = kal.MultiHeadAttention(2, 4)
    x = rng.standard_normal((2, 4, 8)).astype("float32")
    layer(x, x)
    randomize(layer, rng)
    mask = np.ones((2, 4, 4), bool)
    mask[0, 1] = False
    out, scores = layer(x, x, attention_mask=mask, return_attention_scores=True)
    # Zero attention output, so only the output projection's bias remains.
    tolerance.assert_close(out[0, 1], layer.output_dense.bias.numpy(), terms=tolerance.LAYER_TERMS)
    np.testing.assert_array_equal(np.asarray(scores)[0, :, 1], 0.0)


# --- Properties --------------------------------------------------------------------

def test_causality(rng):
    layer = kal.MultiHeadAttention(2, 4, num_key_value_heads=1)
    x = rng.standard_normal((1, 6, 8)).astype("float32")
    base = np.asarray(layer(x, x, use_causal_mask=True))
    x2 = x.copy()
    x2[0, 4:] += 5.0
    changed = np.asarray(layer(x2, x2, use_causal_mask=True))
    tolerance.assert_close(changed[0, :4], base[0, :4], terms=tolerance.LAYER_TERMS)
    assert not np.allclose(changed[0, 4:], base[0, 4:])


def test_padding_invariance(rng):
    layer = kal.MultiHeadAttention(2, 4)
    x = rng.standard_normal((1, 6, 8)).astype("float32")
    mask = np.array([[1, 1, 1, 1, 0, 0]], bool)
    base = np.asarray(layer(x, x, query_mask=mask, value_mask=mask))
    x2 = x.copy()
    x2[0, 4:] = rng.standard_normal((2, 8))
    tolerance.assert_close(np.asarray(layer(x2, x2, query_mask=mask, value_mask=mask))[0, :4], base[0, :4], terms=tolerance.LAYER_TERMS)


def test_scores_rows_sum_to_one(rng):
    x = rng.standard_normal((2, 5, 8)).astype("float32")
    _, scores = kal.MultiHeadAttention(4, 2)(x, x, use_causal_mask=True, return_attention_scores=True)
    tolerance.assert_close(np.asarray(scores).sum(-1), 1.0, terms=tolerance.LAYER_TERMS)


def test_permutation_equivariance_without_positions(rng):
    layer = kal.MultiHeadAttention(2, 4)
    x = rng.standard_normal((1, 6, 8)).astype("float32")
    perm = rng.permutation(6)
    tolerance.assert_close(np.asarray(layer(x, x))[:, perm], np.asarray(layer(x[:, perm], x[:, perm])), terms=tolerance.LAYER_TERMS)


def test_causal_flag_equals_explicit_lower_triangular_mask(rng):
    layer = kal.MultiHeadAttention(2, 4)
    q = rng.standard_normal((2, 4, 8)).astype("float32")
    v = rng.standard_normal((2, 6, 8)).astype("float32")
    tri = ref.causal(4, 6)
    tolerance.assert_close(layer(q, v, use_causal_mask=True), layer(q, v, attention_mask=tri[None]), terms=tolerance.LAYER_TERMS)


def test_sliding_window_matches_keras(rng):
    theirs = keras.layers.MultiHeadAttention(2, 4, sliding_window=2)
    x = rng.standard_normal((2, 6, 8)).astype("float32")
    theirs(x, x)
    ours = kal.MultiHeadAttention.from_keras(theirs)
    tolerance.assert_close(ours(x, x, use_causal_mask=True), theirs(x, x, use_causal_mask=True), terms=tolerance.LAYER_TERMS)


def test_rotary_inside_attention(rng):
    rope = kal.RotaryEmbedding()
    layer = kal.MultiHeadAttention(2, 4, rotary_embedding=rope, use_bias=False)
    x = rng.standard_normal((1, 5, 8)).astype("float32")
    out = layer(x, x)
    w = ref.mha_weights(layer)
    q = ref.rotary(np.einsum("btd,dhk->bthk", x, w["wq"]))
    k = ref.rotary(np.einsum("btd,dhk->bthk", x, w["wk"]))
    v = np.einsum("btd,dhk->bthk", x, w["wv"])
    o, _ = ref.attention(q, k, v)
    tolerance.assert_close(out, np.einsum("bthk,hkd->btd", o, w["wo"]), terms=tolerance.LAYER_TERMS)


def test_attention_bias_from_alibi(rng):
    layer = kal.MultiHeadAttention(4, 2, use_bias=False)
    x = rng.standard_normal((1, 5, 8)).astype("float32")
    bias = kal.AlibiBias(4)(x)
    out = layer(x, x, attention_bias=bias, use_causal_mask=True)
    want, _ = ref.mha(x, x, x, ref.mha_weights(layer), 4, 4, mask=ref.causal(5)[None, None], bias=np.asarray(bias))
    tolerance.assert_close(out, want, terms=tolerance.LAYER_TERMS)


def test_compute_output_shape_and_spec_with_tq_ne_tk():
    layer = kal.MultiHeadAttention(3, 4, output_shape=(2, 5))
    q = keras.Input((4, 8))
    v = keras.Input((9, 6))
    out, scores = layer(q, v, return_attention_scores=True)
    assert tuple(out.shape) == (None, 4, 2, 5)
    assert tuple(scores.shape) == (None, 3, 4, 9)
    assert layer.compute_output_shape((None, 4, 8), (None, 9, 6)) == (None, 4, 2, 5)
    model = keras.Model([q, v], [out, scores])
    a, b = model([np.zeros((2, 4, 8)), np.zeros((2, 9, 6))])
    assert tuple(a.shape) == (2, 4, 2, 5) and tuple(b.shape) == (2, 3, 4, 9)
    for layer, scores_shape in (
        (kal.DotProductAttention(), (None, 4, 9)),
        (kal.AdditiveAttention(3), (None, 4, 9)),
    ):
        q3 = keras.Input((4, 6))
        o, s = layer(q3, v, return_attention_scores=True)
        assert tuple(o.shape) == (None, 4, 6) and tuple(s.shape) == scores_shape


@pytest.mark.parametrize(
    "make, inputs",
    [
        (lambda: kal.MultiHeadAttention(4, 8, use_gate=True), lambda x: (x, x)),
        (lambda: kal.MultiHeadAttention(4, 8, num_key_value_heads=4), lambda x: (x, x)),
        (lambda: kal.AdditiveAttention(units=16), lambda x: (x, x)),
        (lambda: kal.TransformerEncoderBlock(num_heads=4, intermediate_dim=32), lambda x: (x,)),
        (lambda: kal.TransformerDecoderBlock(num_heads=4, intermediate_dim=32), lambda x: (x, x)),
    ],
    ids=["mha_gate", "mha", "additive", "encoder", "decoder"],
)
def test_sublayers_start_from_different_random_weights(make, inputs):
    # One unseeded Keras initializer instance repeats its values at every
    # call; sharing it made the query, key and value kernels identical.
    keras.utils.set_random_seed(3)
    layer = make()
    layer(*inputs(np.zeros((1, 5, 16), "float32")))
    kernels = [(w.path, w.numpy()) for w in layer.weights if w.numpy().std() > 0]
    assert len(kernels) >= 3
    for i, (path_a, a) in enumerate(kernels):
        for path_b, b in kernels[:i]:
            if a.size == b.size:
                assert not np.allclose(a.ravel(), b.ravel()), (path_a, path_b)
    # As Keras: a seeded initializer stays deterministic.
    twins = [kal.MultiHeadAttention(2, 4, kernel_initializer=keras.initializers.GlorotUniform(seed=7))
             for _ in range(2)]
    for twin in twins:
        twin(np.zeros((1, 3, 8), "float32"), np.zeros((1, 3, 8), "float32"))
    for a, b in zip(twins[0].weights, twins[1].weights):
        np.testing.assert_array_equal(a.numpy(), b.numpy())


@pytest.mark.parametrize("layer_cls", [kal.DotProductAttention, kal.AdditiveAttention])
def test_single_head_layers_are_recorded_for_visualize(rng, layer_cls):
    """keras_attn.visualize also reads the one-head layers: their maps equal
    `return_attention_scores`, with a head axis, masked positions exactly 0."""
    from keras_attn.visualize import attention_maps

    layer = layer_cls() if layer_cls is kal.DotProductAttention else layer_cls(6)
    q = rng.standard_normal((2, 4, 6)).astype("float32")
    v = rng.standard_normal((2, 5, 6)).astype("float32")
    value_mask = np.array([[1, 1, 1, 0, 0], [1] * 5], bool)
    out, scores = layer(q, v, value_mask=value_mask, return_attention_scores=True)
    maps = attention_maps(lambda x: layer(x, v, value_mask=value_mask), q)
    assert len(maps) == 1 and maps[0].scores.shape == (2, 1, 4, 5)
    np.testing.assert_array_equal(maps[0].scores[:, 0], keras.ops.convert_to_numpy(scores))
    assert np.all(maps[0].scores[0, :, :, 3:] == 0.0)
    np.testing.assert_array_equal(maps[0].key_padding(), ~value_mask)
    # Outside a recording the call is unchanged.
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(layer(q, v, value_mask=value_mask)),
                                  keras.ops.convert_to_numpy(out))
