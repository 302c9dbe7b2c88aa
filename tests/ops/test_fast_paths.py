"""The speed-motivated paths compute the same numbers as independent references.

- `dot_product_attention`'s hand-written softmax/weighted-sum gradient and its
  additive (oneDNN-fused) key-padding mask: outputs and gradients against the
  float64 NumPy forward/backward of `tests.reference.attention_with_grads`
  (which differentiates the softmax the textbook way, `P * (dP - sum(dP * P))`).
- `MultiHeadAttention` applies a query padding mask to whole output rows:
  against `keras.layers.MultiHeadAttention` with the same weights.
- The blocks' LayerNorm with its written-out backward: against
  `keras.layers.LayerNormalization` differentiated by TensorFlow, and NumPy.
- Attention in independent head groups (`tf_kernels.head_groups`): every
  NumPy case above again with the groups forced, plus per-head biases and
  returned scores.
- `MultiHeadAttention`'s fused input projections (one matmul per input
  tensor) and 2-D output projection: against Keras MHA and against the
  EinsumDense sublayers themselves (LoRA, quantized, mixed precision).
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_attn.layers import MultiHeadAttention
from keras_attn.layers._layer_norm import LastAxisLayerNorm
from keras_attn.ops import tf_kernels
from keras_attn.ops import dot_product_attention
from tests import reference as ref
from tests import tolerance


@pytest.fixture(params=["default", "head_groups"])
def grouping(request, monkeypatch):
    """Runs a test twice: as configured, and with attention split into as
    many head groups as the key/value heads allow, whatever the size."""
    if request.param == "head_groups":
        monkeypatch.setattr(tf_kernels, "GROUP_MIN_SCORE_BYTES", 0)
        monkeypatch.setattr(tf_kernels, "GROUP_SCORE_BYTES", 1)
    return request.param

# name: (B, Tq, Tk, H, Hkv, causal, mask kind, bias, value dtype)
CASES = {
    "no_mask": (2, 9, 9, 4, 4, False, None, False, "float32"),
    "key_padding_fused": (3, 7, 11, 4, 4, False, "keys", False, "float32"),
    "key_padding_some_rows_empty": (2, 6, 5, 2, 2, False, "keys_empty", False, "float32"),
    "key_padding_gqa": (2, 8, 8, 4, 2, False, "keys", False, "float32"),
    "causal_and_keys": (2, 10, 10, 2, 2, True, "keys", False, "float32"),
    "full_mask_with_bias": (2, 5, 7, 2, 2, False, "full", True, "float32"),
    "key_padding_float16": (2, 6, 6, 2, 2, False, "keys", False, "float16"),
    "gqa_causal_bias": (2, 9, 9, 8, 4, True, None, True, "float32"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_dense_attention_values_and_gradients_match_numpy(name, rng, grouping):
    b, tq, tk, h, hkv, causal, kind, use_bias, dtype = CASES[name]
    d = 8
    q = rng.normal(size=(b, tq, h, d)).astype("float32")
    k = rng.normal(size=(b, tk, hkv, d)).astype("float32")
    v = rng.normal(size=(b, tk, hkv, d)).astype("float32")
    d_out = rng.normal(size=(b, tq, h, d)).astype("float32")
    # A per-head bias as (H, T_q, T_k): split with the heads in groups.
    bias = rng.normal(size=(h, tq, tk)).astype("float32") if use_bias else None
    mask4 = np.ones((b, h, tq, tk), bool)
    attention_mask = key_padding_mask = None
    if kind in ("keys", "keys_empty"):
        valid = rng.random((b, tk)) > 0.3
        valid[:, 0] = kind == "keys"  # "keys_empty": example rows with no key
        if kind == "keys_empty":
            valid[1] = True
        key_padding_mask = valid
        mask4 &= valid[:, None, None, :]
    elif kind == "full":
        attention_mask = rng.random((b, tq, tk)) > 0.4
        attention_mask[0, 2] = False  # one query row sees nothing
        mask4 &= attention_mask[:, None]
        attention_mask = attention_mask[:, None]
    if causal:
        mask4 &= np.tril(np.ones((tq, tk), bool))[None, None]

    cast = lambda a: tf.cast(tf.constant(a), dtype)  # noqa: E731
    qt, kt, vt = cast(q), cast(k), cast(v)
    bt = None if bias is None else tf.constant(bias)
    watched = [qt, kt, vt] + ([bt] if bt is not None else [])
    with tf.GradientTape() as tape:
        tape.watch(watched)
        out = dot_product_attention(
            qt, kt, vt, attention_mask=attention_mask, key_padding_mask=key_padding_mask,
            bias=bt, is_causal=causal, chunk_size=0,
        )
        loss = tf.reduce_sum(tf.cast(out, "float32") * d_out)
    grads = tape.gradient(loss, watched)

    # The NumPy reference sees the same (rounded) inputs.
    q64, k64, v64 = (np.asarray(tf.cast(x, "float32")) for x in (qt, kt, vt))
    expected = ref.attention_with_grads(q64, k64, v64, mask4, bias, 1 / np.sqrt(d), d_out)
    got = [np.asarray(tf.cast(g, "float32")) for g in [out] + list(grads)]
    want = list(expected[:4])
    if use_bias:
        want.append(expected[4].sum(axis=0))
    assert all(np.all(np.isfinite(g)) for g in got)
    # float32: sums over T*D terms; float16: the final casts dominate.
    low = dtype != "float32"
    tolerance.assert_outputs_and_grads(
        got, want, ulps=20 if low else 64, terms=1 if low else k64.shape[1] * d,
        dtype=dtype, err_msg=dtype,
    )


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_head_groups_return_the_scores_of_every_head(kv_heads, rng, monkeypatch):
    """Grouped heads, scores requested: outputs and scores against NumPy."""
    monkeypatch.setattr(tf_kernels, "GROUP_MIN_SCORE_BYTES", 0)
    b, t, h, d = 2, 6, 4, 8
    q = rng.normal(size=(b, t, h, d)).astype("float32")
    k, v = (rng.normal(size=(b, t, kv_heads, d)).astype("float32") for _ in range(2))
    valid = rng.random((b, t, t)) > 0.3
    out, scores = dot_product_attention(
        q, k, v, attention_mask=valid[:, None], return_attention_scores=True
    )
    mask4 = np.broadcast_to(valid[:, None], (b, h, t, t))
    want = ref.attention_with_grads(q, k, v, mask4, None, 1 / np.sqrt(d), np.zeros((b, t, h, d)))
    tolerance.assert_close(np.asarray(out), want[0], terms=tolerance.LAYER_TERMS)
    group = h // kv_heads
    s = np.einsum("bqhd,bkhd->bhqk", q, np.repeat(k, group, axis=2)) / np.sqrt(d)
    s = np.where(mask4, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p = np.nan_to_num(p / p.sum(-1, keepdims=True))
    tolerance.assert_close(np.asarray(scores), p, terms=tolerance.LAYER_TERMS)


def test_head_groups_split_large_scores_into_whole_key_value_groups():
    """Properties of the split, not its tuning: small scores, unknown lengths,
    dropout and a single key/value head stay whole; large scores are split
    into at least 2 groups, a divisor of the key/value heads, more groups
    for larger scores."""
    small = tf_kernels.GROUP_MIN_SCORE_BYTES // 4 // 2 - 1  # float32 (1, 2, 1, small)
    assert tf_kernels.head_groups((1, 2, 1, small), 2) == 1
    large = (8, 8, 512, 512)
    for kv_heads in (2, 4, 8):
        groups = tf_kernels.head_groups(large, kv_heads)
        assert groups >= 2 and kv_heads % groups == 0
    assert tf_kernels.head_groups((8, 8, None, 512), 8) == 1
    assert tf_kernels.head_groups(large, 8, dropout_active=True) == 1
    assert tf_kernels.head_groups(large, 1) == 1
    assert tf_kernels.head_groups((64,) + large[1:], 8) >= tf_kernels.head_groups(
        (1, 8, 128, 128), 8
    )
    assert tf_kernels.head_groups((None,) + large[1:], 8) == tf_kernels.head_groups(
        (1,) + large[1:], 8
    )


def test_dropout_and_scores_paths_agree_with_the_fast_path(rng):
    """Scores requested (autodiff path) and not requested (hand-written
    gradient, fused mask) give the same outputs and gradients."""
    q, k, v = (tf.constant(rng.normal(size=(2, 6, 2, 4)).astype("float32")) for _ in range(3))
    valid = np.array([[1, 1, 1, 0, 0, 1], [1, 0, 1, 1, 1, 1]], bool)

    def run(scores):
        with tf.GradientTape() as tape:
            tape.watch([q, k, v])
            out = dot_product_attention(
                q, k, v, key_padding_mask=valid, return_attention_scores=scores
            )
            out = out[0] if scores else out
            loss = tf.reduce_sum(out * out)
        return [out] + tape.gradient(loss, [q, k, v])

    for a, b in zip(run(False), run(True)):
        tolerance.assert_close(np.asarray(a), np.asarray(b), terms=tolerance.LAYER_TERMS)


@pytest.mark.parametrize("cross", [False, True])
def test_query_padding_mask_matches_keras_mha(cross, rng):
    """Padded query rows: ours are zero before the output projection (so equal
    its bias); valid rows equal Keras MHA, values and gradients."""
    b, tq, tk, dim = 2, 7, 9 if cross else 7, 16
    query = tf.constant(rng.normal(size=(b, tq, dim)).astype("float32"))
    value = tf.constant(rng.normal(size=(b, tk, dim)).astype("float32")) if cross else query
    q_valid = np.ones((b, tq), bool)
    q_valid[0, 5:] = False
    v_valid = np.ones((b, tk), bool)
    v_valid[1, 3:] = False
    keras_mha = keras.layers.MultiHeadAttention(num_heads=2, key_dim=8)
    keras_mha(query, value)
    ours = MultiHeadAttention.from_keras(keras_mha)

    def run(layer):
        with tf.GradientTape() as tape:
            tape.watch([query, value])
            out = layer(query, value, query_mask=q_valid, value_mask=v_valid)
            loss = tf.reduce_sum(out * out * q_valid[..., None])
        return out, tape.gradient(loss, [query, value] if cross else [query])

    ours_out, ours_grads = run(ours)
    keras_out, keras_grads = run(keras_mha)
    rows = q_valid
    tolerance.assert_close(np.asarray(ours_out)[rows], np.asarray(keras_out)[rows], terms=tolerance.LAYER_TERMS)
    bias = np.asarray(ours.output_dense.bias)
    tolerance.assert_close(np.asarray(ours_out)[~rows], np.broadcast_to(bias, (int((~rows).sum()), dim)), terms=tolerance.LAYER_TERMS)
    for g_ours, g_keras in zip(ours_grads, keras_grads):
        # Keras lets padded queries attend; their rows carry no loss here, so
        # every gradient (as query, key and value) must agree.
        tolerance.assert_close(np.asarray(g_ours), np.asarray(g_keras), terms=tolerance.LAYER_TERMS)


@pytest.mark.parametrize("shape", [(2, 5, 16), (3, 7), (1, 1, 4)])
@pytest.mark.parametrize("policy", ["float32", "mixed_float16"])
def test_layer_norm_matches_keras_values_and_gradients(shape, policy, rng):
    x = rng.normal(loc=0.5, scale=2.0, size=shape).astype("float32")
    d_y = rng.normal(size=shape).astype("float32")
    gamma = rng.normal(size=shape[-1:]).astype("float32")
    beta = rng.normal(size=shape[-1:]).astype("float32")
    layers = {
        "ours": LastAxisLayerNorm(epsilon=1e-5, dtype=policy),
        "keras": keras.layers.LayerNormalization(epsilon=1e-5, dtype=policy),
    }
    results = {}
    for name, layer in layers.items():
        layer.build(shape)
        layer.gamma.assign(gamma)
        layer.beta.assign(beta)
        xt = tf.constant(x)
        with tf.GradientTape() as tape:
            tape.watch(xt)
            y = layer(xt)
            loss = tf.reduce_sum(tf.cast(y, "float32") * d_y)
        grads = tape.gradient(loss, [xt, layer.gamma, layer.beta])
        assert y.dtype == layer.compute_dtype
        results[name] = [np.asarray(tf.cast(t, "float32")) for t in [y] + grads]
    # float32: reductions over the feature axis and, for d_gamma/d_beta, the
    # rows; in float16/bfloat16 the final casts dominate.
    low = policy != "float32"
    kwargs = dict(ulps=20 if low else 64, terms=1 if low else x.size,
                  dtype="float16" if low else "float32")
    tolerance.assert_outputs_and_grads(results["ours"], results["keras"], err_msg=policy, **kwargs)
    tolerance.assert_close(results["ours"][0], ref.layer_norm(x, gamma, beta, 1e-5),
                           err_msg=f"{policy} vs NumPy", **kwargs)


def test_layer_norm_keeps_keras_behaviour_for_other_axes(rng):
    """Not the last axis: the layer is plain Keras LayerNormalization."""
    x = rng.normal(size=(2, 3, 4)).astype("float32")
    ours = LastAxisLayerNorm(axis=1)
    theirs = keras.layers.LayerNormalization(axis=1)
    tolerance.assert_close(np.asarray(ours(x)), np.asarray(theirs(x)), terms=tolerance.LAYER_TERMS)


def _second_order(fn, x):
    """Gradient of |d sum(fn(x)^2) / dx|^2 with respect to x (a gradient penalty)."""
    with tf.GradientTape() as outer:
        outer.watch(x)
        with tf.GradientTape() as inner:
            inner.watch(x)
            loss = tf.reduce_sum(fn(x) ** 2)
        penalty = tf.reduce_sum(inner.gradient(loss, x) ** 2)
    return outer.gradient(penalty, x)


def test_hand_written_gradients_support_second_order(rng):
    """Gradient penalties through the fast paths equal plain autodiff: the
    attention core against its scores path (autodiff), the blocks' LayerNorm
    against keras.layers.LayerNormalization."""
    q = tf.constant(rng.normal(size=(2, 5, 2, 4)).astype("float32"))
    k, v = (tf.constant(rng.normal(size=(2, 5, 2, 4)).astype("float32")) for _ in range(2))
    valid = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], bool)

    def attention(scores):
        def fn(x):
            out = dot_product_attention(
                x, k, v, key_padding_mask=valid, return_attention_scores=scores
            )
            return out[0] if scores else out
        return fn

    fast, plain = _second_order(attention(False), q), _second_order(attention(True), q)
    assert float(tf.reduce_max(tf.abs(plain))) > 0.1
    # Second-order gradients: several reductions in another order.
    tolerance.assert_close(np.asarray(fast), np.asarray(plain), terms=tolerance.LAYER_TERMS**2)

    x = tf.constant(rng.normal(size=(3, 6)).astype("float32"))
    ours, theirs = LastAxisLayerNorm(), keras.layers.LayerNormalization()
    for layer in (ours, theirs):
        layer.build((3, 6))
        layer.gamma.assign(rng.normal(size=6).astype("float32"))
    theirs.gamma.assign(ours.gamma)
    fast, plain = _second_order(ours, x), _second_order(theirs, x)
    assert float(tf.reduce_max(tf.abs(plain))) > 0.1
    # Second-order gradients: several reductions in another order.
    tolerance.assert_close(np.asarray(fast), np.asarray(plain), terms=tolerance.LAYER_TERMS**2)


def _mha_pair(rng, cross, use_gate=False, kv_heads=None):
    b, tq, tk, dim = 2, 5, 7 if cross else 5, 12
    query = tf.constant(rng.normal(size=(b, tq, dim)).astype("float32"))
    value = tf.constant(rng.normal(size=(b, tk, dim)).astype("float32")) if cross else query
    if kv_heads:
        keras_layer = keras.layers.GroupQueryAttention(
            head_dim=4, num_query_heads=4, num_key_value_heads=kv_heads
        )
        keras_layer(query, value)
    else:
        keras_layer = keras.layers.MultiHeadAttention(num_heads=3, key_dim=4, use_gate=use_gate)
        keras_layer(query, value)
    return query, value, keras_layer, MultiHeadAttention.from_keras(keras_layer)


@pytest.mark.parametrize(
    "cross,use_gate,kv_heads", [(False, False, None), (True, True, None), (False, False, 2), (True, False, 1)]
)
def test_fused_projections_match_keras_values_and_gradients(cross, use_gate, kv_heads, rng):
    """Self-attention (query, key, value [, gate] in one matmul) and
    cross-attention (query [+ gate] and key + value), MHA and GQA."""
    query, value, keras_layer, ours = _mha_pair(rng, cross, use_gate, kv_heads)
    d_out = tf.constant(rng.normal(size=query.shape).astype("float32"))

    def run(layer):
        # Weights by sublayer/name: Keras builds the gate before the value.
        weights = sorted(layer.trainable_weights, key=lambda w: w.path.split("/", 1)[1])
        with tf.GradientTape() as tape:
            tape.watch([query, value])
            out = layer(query, value)
            loss = tf.reduce_sum(out * d_out)
        return [out] + tape.gradient(loss, [query, value] + weights)

    got_all, want_all = run(ours), run(keras_layer)
    tolerance.assert_outputs_and_grads(
        [np.asarray(g) for g in got_all], [np.asarray(w) for w in want_all],
        terms=tolerance.LAYER_TERMS,
    )


def test_fused_projections_with_lora_quantized_and_mixed_precision(rng):
    """LoRA (the kernel includes the low-rank update), int8 quantization
    (projections called as layers) and mixed_float16 (float16 compute)
    give what the EinsumDense sublayers give when called one by one."""
    query, _, _, ours = _mha_pair(rng, cross=False)

    def by_sublayers(layer, x):
        q, k, v = (d(x) for d in (layer.query_dense, layer.key_dense, layer.value_dense))
        out = dot_product_attention(q, k, v)
        return layer.output_dense(out)

    ours.query_dense.enable_lora(2, b_initializer="ones")
    tolerance.assert_close(np.asarray(ours(query, query)), np.asarray(by_sublayers(ours, query)), terms=tolerance.LAYER_TERMS)
    for dense in (ours.key_dense, ours.value_dense, ours.output_dense):
        dense.quantize("int8")
    tolerance.assert_close(np.asarray(ours(query, query)), np.asarray(by_sublayers(ours, query)), terms=tolerance.LAYER_TERMS)

    keras.mixed_precision.set_global_policy("mixed_float16")
    mixed = MultiHeadAttention(num_heads=3, key_dim=4)
    keras_mixed = keras.layers.MultiHeadAttention(num_heads=3, key_dim=4)
    keras_mixed(query, query)
    mixed(query, query)
    mixed.set_weights(keras_mixed.get_weights())
    out = mixed(query, query)
    assert out.dtype == "float16"
    # Both in float16: a few roundings of the activations' magnitude.
    tolerance.assert_close(
        np.asarray(out, "float32"), np.asarray(keras_mixed(query, query), "float32"),
        scale=max(1.0, tolerance.magnitude(query)), ulps=20, dtype="float16",
    )
