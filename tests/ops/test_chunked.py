"""The blocked (memory-efficient) attention path: numerics and gradients.

Every expected value comes from the NumPy reference below (forward and the
analytic softmax-attention backward), written independently of the code under
test; the unblocked path is compared too, as a second witness.
"""

import os
import tempfile

import numpy as np
import pytest
import tensorflow as tf

from keras_attn.layers import DotProductAttention
from keras_attn.layers import MultiHeadAttention
from keras_attn.ops import attention as attention_ops
from keras_attn import ops as ka_ops
from keras_attn import config
from keras_attn.ops import dispatch
from keras_attn.ops import tf_kernels
from keras_attn.ops import chunked
from keras_attn.ops import dot_product_attention
from tests import tolerance
from tests.reference import attention_with_grads as np_attention


@pytest.fixture
def auto_kernels():
    """For tests of the automatic kernel choice itself: "auto" even when the
    suite runs with KERAS_ATTN_ATTENTION_IMPLEMENTATION forced."""
    with config.attention_implementation("auto"):
        yield


def _grads(fn, q, k, v, bias, d_out):
    q, k, v, d_out = (tf.constant(x) for x in (q, k, v, d_out))
    bias = None if bias is None else tf.constant(bias)
    with tf.GradientTape() as tape:
        tape.watch([q, k, v] + ([bias] if bias is not None else []))
        out = fn(q, k, v, bias)
        loss = tf.reduce_sum(out * d_out)
    grads = tape.gradient(loss, [q, k, v] + ([bias] if bias is not None else []))
    return [out.numpy()] + [g.numpy() for g in grads]


CASES = {
    # name: (B, Tq, Tk, H, Hkv, causal, padding, bias, fully_masked_row, chunk)
    "plain": (2, 24, 24, 4, 4, False, False, False, False, 8),
    "uneven_lengths_cross": (2, 19, 29, 4, 4, False, True, False, False, (8, 16)),
    "causal_padding": (2, 33, 33, 4, 4, True, True, False, False, 8),
    "bias_gqa": (2, 21, 21, 4, 2, False, True, True, False, (16, 8)),
    "causal_bias_mqa": (1, 40, 40, 4, 1, True, False, True, False, 16),
    "fully_masked_rows": (2, 17, 17, 2, 2, True, True, True, True, 8),
}


# The backward pass has its own blocks (at most BACKWARD_MAX_CHUNK per axis):
# "own_blocks" makes them smaller than, and not divisors of, the forward's.
# "head_groups" splits the attention into as many head groups as the
# key/value heads allow, whatever the size (large blocks use them).
BACKWARD_BLOCKS = {"same_blocks": None, "own_blocks": 5, "head_groups": None}


@pytest.fixture(params=list(BACKWARD_BLOCKS))
def backward_max_chunk(request, monkeypatch):
    value = BACKWARD_BLOCKS[request.param]
    if value is not None:
        monkeypatch.setattr(chunked, "BACKWARD_MAX_CHUNK", value)
    if request.param == "head_groups":
        monkeypatch.setattr(tf_kernels, "GROUP_MIN_SCORE_BYTES", 0)
        monkeypatch.setattr(tf_kernels, "GROUP_SCORE_BYTES", 1)
    return value


@pytest.mark.parametrize("name", list(CASES))
def test_chunked_matches_numpy_and_unblocked(name, rng, backward_max_chunk):
    b, tq, tk, h, hkv, causal, padding, use_bias, empty_row, chunk = CASES[name]
    d = 8
    q = rng.normal(size=(b, tq, h, d)).astype("float32")
    k = rng.normal(size=(b, tk, hkv, d)).astype("float32")
    v = rng.normal(size=(b, tk, hkv, d)).astype("float32")
    d_out = rng.normal(size=(b, tq, h, d)).astype("float32")
    bias = rng.normal(size=(1, h, tq, tk)).astype("float32") if use_bias else None
    key_valid = np.ones((b, tk), bool)
    if padding:
        key_valid[-1, tk // 2 :] = False
    mask4 = np.broadcast_to(key_valid[:, None, None, :], (b, h, tq, tk)).copy()
    if causal:
        mask4 &= np.tril(np.ones((tq, tk), bool))[None, None]
    explicit = None
    if empty_row:
        explicit = np.ones((b, tq, tk), bool)
        explicit[0, 5, :] = False  # query 5 of example 0 sees nothing
        explicit[1, :, :] = key_valid[1][None, :]
        mask4 &= explicit[:, None]
    attention_mask = key_padding = None
    if explicit is None:
        key_padding = key_valid
    else:
        attention_mask = (explicit & key_valid[:, None, :])[:, None]

    def run(chunk_size):
        def fn(q, k, v, bias):
            return dot_product_attention(
                q, k, v, attention_mask=attention_mask, key_padding_mask=key_padding,
                bias=bias, is_causal=causal, chunk_size=chunk_size,
            )
        return fn

    expected = np_attention(q, k, v, mask4, bias, 1.0 / np.sqrt(d), d_out)
    got = _grads(run(chunk), q, k, v, bias, d_out)
    unblocked = _grads(run(0), q, k, v, bias, d_out)
    ref = list(expected[:4])
    if use_bias:
        ref.append(expected[4].sum(axis=0, keepdims=True))
    terms = k.shape[1] * d
    tolerance.assert_outputs_and_grads(got, ref, terms=terms, err_msg="blocked vs NumPy")
    tolerance.assert_outputs_and_grads(got, unblocked, terms=terms, err_msg="blocked vs unblocked")
    if empty_row:
        assert np.all(got[0][0, 5] == 0.0)
        assert np.all(got[1][0, 5] == 0.0)


def test_backward_blocks_differ_from_forward_blocks(monkeypatch):
    monkeypatch.setattr(chunked, "BACKWARD_MAX_CHUNK", 5)
    assert chunked.backward_chunks((8, 16)) == (5, 5)
    assert chunked.backward_chunks((4, 8)) == (4, 5)


OFFSET_CASES = {
    # name: (B, Tq, Tk, start_index, sliding_window, causal)
    "window_cached_decoding": (1, 12, 30, 18, 7, True),
    "causal_start_0": (2, 19, 43, 0, None, True),
    "causal_start_5": (2, 19, 43, 5, None, True),
    "causal_start_23": (2, 19, 43, 23, None, True),
    "symmetric_window": (2, 29, 43, 0, 7, False),
    "symmetric_window_offset": (1, 12, 30, 9, 5, False),
}


@pytest.mark.parametrize("name", list(OFFSET_CASES))
def test_causal_offset_window_ragged_blocks(rng, backward_max_chunk, name):
    """Causal with an offset first query (cached decoding), with and without
    a sliding window, lengths not multiples of the blocks, query and key
    blocks of different sizes."""
    b, tq, tk, start, window, causal = OFFSET_CASES[name]
    h, d = 2, 8
    q = rng.normal(size=(b, tq, h, d)).astype("float32")
    k = rng.normal(size=(b, tk, h, d)).astype("float32")
    v = rng.normal(size=(b, tk, h, d)).astype("float32")
    d_out = rng.normal(size=(b, tq, h, d)).astype("float32")
    q_pos = np.arange(tq)[:, None] + start
    k_pos = np.arange(tk)[None, :]
    mask = q_pos >= k_pos if causal else np.ones((tq, tk), bool)
    if window is not None:
        mask &= np.abs(q_pos - k_pos) < window
    mask4 = np.broadcast_to(mask, (b, h, tq, tk))

    def run(chunk_size):
        def fn(q, k, v, bias):
            return dot_product_attention(
                q, k, v, is_causal=causal, start_index=start, sliding_window=window,
                chunk_size=chunk_size,
            )
        return fn

    expected = np_attention(q, k, v, mask4, None, 1.0 / np.sqrt(d), d_out)
    for chunk_size in ((6, 8), 0):
        got_all = _grads(run(chunk_size), q, k, v, None, d_out)
        tolerance.assert_outputs_and_grads(
            got_all, list(expected[:4]), terms=tk * d, err_msg=f"chunk_size={chunk_size}"
        )


def test_graph_xla_and_dynamic_length(rng):
    """tf.function with an unknown length, and jit_compile=True, match NumPy."""
    q = rng.normal(size=(2, 37, 2, 8)).astype("float32")
    mask4 = np.broadcast_to(np.tril(np.ones((37, 37), bool)), (2, 2, 37, 37))
    ref = np_attention(q, q, q, mask4, None, 1 / np.sqrt(8), np.zeros_like(q))[0]
    spec = tf.TensorSpec((None, None, 2, 8), tf.float32)

    def fn(x):
        return dot_product_attention(x, x, x, is_causal=True, chunk_size=16)

    dynamic = tf.function(fn, input_signature=[spec])
    tolerance.assert_close(dynamic(q).numpy(), ref, terms=tolerance.LAYER_TERMS)
    xla = tf.function(fn, jit_compile=True)
    tolerance.assert_close(xla(q).numpy(), ref, terms=tolerance.LAYER_TERMS)


def test_saved_model_round_trip(rng):
    q = rng.normal(size=(1, 20, 2, 8)).astype("float32")
    mask4 = np.ones((1, 2, 20, 20), bool)
    ref = np_attention(q, q, q, mask4, None, 1 / np.sqrt(8), np.zeros_like(q))[0]
    module = tf.Module()
    module.f = tf.function(
        lambda x: dot_product_attention(x, x, x, chunk_size=8),
        input_signature=[tf.TensorSpec((None, None, 2, 8), tf.float32)],
    )
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "sm")
        tf.saved_model.save(module, path)
        loaded = tf.saved_model.load(path)
        tolerance.assert_close(loaded.f(q).numpy(), ref, terms=tolerance.LAYER_TERMS)


def test_low_precision_inputs_keep_dtype(rng):
    q = rng.normal(size=(1, 16, 2, 8)).astype("float16")
    out = dot_product_attention(q, q, q, chunk_size=8)
    assert out.dtype == "float16"
    q32 = q.astype("float32")
    ref = np_attention(q32, q32, q32, np.ones((1, 2, 16, 16), bool), None, 1 / np.sqrt(8), q32)[0]
    # float16 inputs and output, float32 inside: the output's rounding dominates.
    tolerance.assert_close(np.asarray(out, np.float32), ref, scale=tolerance.magnitude(q32),
                           ulps=8, dtype="float16")


def test_layers_accept_chunk_size_and_match_unblocked(rng):
    x = rng.normal(size=(2, 23, 16)).astype("float32")
    valid = np.ones((2, 23), bool)
    valid[1, 15:] = False
    dense = MultiHeadAttention(num_heads=4, key_dim=4, num_key_value_heads=2, chunk_size=0)
    blocked = MultiHeadAttention(num_heads=4, key_dim=4, num_key_value_heads=2, chunk_size=(8, 4))
    dense(x, x)
    blocked(x, x)
    blocked.set_weights(dense.get_weights())
    for causal in (False, True):
        a = dense(x, x, query_mask=valid, value_mask=valid, use_causal_mask=causal)
        b = blocked(x, x, query_mask=valid, value_mask=valid, use_causal_mask=causal)
        tolerance.assert_close(np.asarray(a), np.asarray(b), terms=tolerance.LAYER_TERMS)
    config = blocked.get_config()
    assert config["chunk_size"] == [8, 4]
    clone = MultiHeadAttention.from_config(config)
    assert clone.chunk_size == [8, 4]

    layer = DotProductAttention(chunk_size=8)
    q = rng.normal(size=(2, 11, 8)).astype("float32")
    v = rng.normal(size=(2, 13, 8)).astype("float32")
    expected = np_attention(
        q[:, :, None], v[:, :, None], v[:, :, None], np.ones((2, 1, 11, 13), bool), None,
        1 / np.sqrt(8), np.zeros_like(q[:, :, None]),
    )[0][:, :, 0]
    tolerance.assert_close(np.asarray(layer(q, v)), expected, terms=tolerance.LAYER_TERMS)
    assert DotProductAttention.from_config(layer.get_config()).chunk_size == 8


@pytest.mark.usefixtures("auto_kernels")
def test_blocks_accept_chunk_size_and_match_unblocked(monkeypatch, rng):
    """Encoder and decoder blocks pass `chunk_size` to every attention sublayer:
    same outputs and weight gradients as the unblocked blocks with the same weights."""
    from keras_attn.layers import TransformerDecoderBlock
    from keras_attn.layers import TransformerEncoderBlock

    blocked_calls = []
    original = chunked.chunked_dot_product_attention

    def spy(*args, **kwargs):
        blocked_calls.append(kwargs["chunk_size"])
        return original(*args, **kwargs)

    monkeypatch.setattr(chunked, "chunked_dot_product_attention", spy)

    x = rng.normal(size=(2, 21, 16)).astype("float32")
    enc = rng.normal(size=(2, 13, 12)).astype("float32")
    x_valid = np.ones((2, 21), bool)
    x_valid[1, 14:] = False
    enc_valid = np.ones((2, 13), bool)
    enc_valid[0, 9:] = False
    cases = [
        (TransformerEncoderBlock, dict(normalize_first=False),
         lambda b: b(x, padding_mask=x_valid)),
        (TransformerEncoderBlock, dict(normalize_first=True, num_key_value_heads=2),
         lambda b: b(x, padding_mask=x_valid, use_causal_mask=True)),
        (TransformerDecoderBlock, dict(),
         lambda b: b(x, enc, decoder_padding_mask=x_valid, encoder_padding_mask=enc_valid)),
    ]
    for cls, kwargs, call in cases:
        dense = cls(num_heads=4, intermediate_dim=32, chunk_size=0, **kwargs)
        blocked = cls(num_heads=4, intermediate_dim=32, chunk_size=(8, 4), **kwargs)
        call(dense)
        call(blocked)
        blocked.set_weights(dense.get_weights())
        results = []
        for block in (dense, blocked):
            del blocked_calls[:]
            with tf.GradientTape() as tape:
                out = call(block)
                loss = tf.reduce_sum(out * out)
            grads = tape.gradient(loss, block.trainable_weights)
            results.append([out.numpy()] + [g.numpy() for g in grads])
        # One blocked call per attention sublayer, none in the dense block.
        expected_calls = 2 if cls is TransformerDecoderBlock else 1
        assert blocked_calls == ([(8, 4)] * expected_calls if block is blocked else [])
        # Weight gradients of a whole block: against the largest of them.
        tolerance.assert_outputs_and_grads(results[1], results[0], terms=64, err_msg=cls.__name__)
        assert blocked.get_config()["chunk_size"] == [8, 4]
        assert cls.from_config(blocked.get_config()).chunk_size == [8, 4]
    with pytest.raises(ValueError, match="chunk_size"):
        TransformerEncoderBlock(num_heads=2, intermediate_dim=8, chunk_size=(4, -1))


def test_invalid_chunk_size_and_unsupported_combinations(rng):
    q = rng.normal(size=(1, 8, 2, 4)).astype("float32")
    for bad in (-1, 2.5, (4,), (4, 0), True):
        with pytest.raises(ValueError, match="chunk_size"):
            dot_product_attention(q, q, q, chunk_size=bad)
        with pytest.raises(ValueError, match="chunk_size"):
            MultiHeadAttention(num_heads=2, key_dim=4, chunk_size=bad)
    with pytest.raises(ValueError, match="return_attention_scores"):
        dot_product_attention(q, q, q, chunk_size=4, return_attention_scores=True)
    with pytest.raises(ValueError, match="dropout"):
        dot_product_attention(q, q, q, chunk_size=4, dropout_rate=0.5, training=True)


@pytest.mark.usefixtures("auto_kernels")
def test_large_blocks_run_in_head_groups(monkeypatch, rng):
    """(1, 8, 1024, 1024) float32 blocks (32 MiB) run in several groups of
    heads; small blocks or unknown lengths as one group. Values: NumPy."""
    heads = []
    original = chunked.chunked_dot_product_attention

    def spy(query, *args, **kwargs):
        heads.append(query.shape[2])
        return original(query, *args, **kwargs)

    monkeypatch.setattr(chunked, "chunked_dot_product_attention", spy)
    q, k, v = (rng.normal(size=(1, 1100, 8, 4)).astype("float32") for _ in range(3))
    out = dot_product_attention(q, k, v, chunk_size=1024)
    assert len(heads) > 1 and sum(heads) == 8
    mask4 = np.ones((1, 8, 1100, 1100), bool)
    tolerance.assert_close(out, np_attention(q, k, v, mask4, None, 0.5, np.zeros_like(q))[0],
                           terms=1100 * 4)
    heads.clear()
    dot_product_attention(q[:, :300], k[:, :300], v[:, :300], chunk_size=64)
    assert heads == [8]
    heads.clear()
    fn = tf.function(
        lambda q: dot_product_attention(q, q, q, chunk_size=1024),
        input_signature=[tf.TensorSpec((1, None, 8, 4))],
    )
    fn(q)
    assert heads == [8]


@pytest.mark.usefixtures("auto_kernels")
def test_automatic_dispatch_above_threshold(monkeypatch, rng):
    """Above the threshold the blocked path runs by itself, never when scores are asked for."""
    monkeypatch.setattr(dispatch, "AUTO_CHUNK_MIN_SCORES", 15 * 15)
    q = rng.normal(size=(1, 16, 2, 4)).astype("float32")
    attention_ops.dot_product_attention(q, q, q)
    assert ka_ops.last_kernel() == "blocked"
    for args, kwargs in [
        ((q[:, :15],) * 3, {}),
        ((q,) * 3, {"return_attention_scores": True}),
        ((q,) * 3, {"chunk_size": 0}),
    ]:
        attention_ops.dot_product_attention(*args, **kwargs)
        assert ka_ops.last_kernel() != "blocked"


@pytest.mark.slow
def test_blocked_layer_exports_to_saved_model_tflite_and_onnx(tmp_path, rng, monkeypatch):
    """The blocked path (while loops) exports with a dynamic batch, TFLite builtins only.

    Head groups are forced on (static length): the 4-head `MultiHeadAttention`
    runs two blocked loops of two heads, the one-head `DotProductAttention` a
    single loop, so both shapes of the graph are exported.

    `DotProductAttention` with query and key padding masks has fully masked
    rows (padded queries, and the block padding of 40 queries to 48): they
    must stay zeros in every format (tf2onnx turns float `where`s into
    multiply-adds, where an infinite branch would give NaN).
    """
    import keras

    from keras_attn.export import export_all

    monkeypatch.setattr(tf_kernels, "GROUP_MIN_SCORE_BYTES", 0)
    # One (1, 4, 16, 8) float32 block is 2048 bytes: 2 groups of 1024.
    monkeypatch.setattr(tf_kernels, "GROUP_SCORE_BYTES", 1024)
    assert tf_kernels.head_groups((None, 4, 16, 8), 4) == 2
    length, dim = 40, 16
    x_in = keras.Input((length, dim), name="x")
    keys_in = keras.Input((length,), dtype="bool", name="keys")

    def build(chunk_size):
        mha = MultiHeadAttention(num_heads=4, key_dim=4, chunk_size=chunk_size, name="mha")
        out = mha(x_in, x_in, attention_mask=keys_in[:, None, :], use_causal_mask=True)
        dpa = DotProductAttention(chunk_size=chunk_size, name="dpa")
        out = out + dpa(x_in, x_in, query_mask=keys_in, value_mask=keys_in)
        return keras.Model([x_in, keys_in], out)

    blocked, unblocked = build((16, 8)), build(0)
    unblocked.set_weights(blocked.get_weights())
    samples = []
    for batch in (1, 3):
        keys = np.ones((batch, length), bool)
        keys[-1, 29:] = False  # padded keys in the last example
        samples.append({"x": rng.normal(size=(batch, length, dim)).astype("float32"), "keys": keys})
    for sample in samples:  # the blocked model itself agrees with the unblocked path
        tolerance.assert_close(blocked.predict(sample, verbose=0), unblocked.predict(sample, verbose=0), terms=tolerance.LAYER_TERMS)
    reports = export_all(blocked, str(tmp_path), sample_inputs=samples, verbose=False)
    assert set(reports) == {"saved_model", "tflite", "onnx"}
    for report in reports.values():
        assert report.max_abs_error <= 1e-4


@pytest.mark.parametrize("causal", [False, True])
def test_empty_batch_and_empty_sequence(causal):
    """Batch 0 (eager, with gradients) and length 0 (dynamic shapes) give empty results."""
    q = tf.zeros((0, 37, 4, 8))
    with tf.GradientTape() as tape:
        tape.watch(q)
        out = dot_product_attention(q, q, q, is_causal=causal, chunk_size=16)
        loss = tf.reduce_sum(out)
    assert out.shape == (0, 37, 4, 8)
    assert tape.gradient(loss, q).shape == (0, 37, 4, 8)
    fn = tf.function(
        lambda x: dot_product_attention(x, x, x, is_causal=causal, chunk_size=16),
        input_signature=[tf.TensorSpec((None, None, 4, 8), tf.float32)],
    )
    assert fn(tf.zeros((2, 0, 4, 8))).shape == (2, 0, 4, 8)
    assert fn(tf.zeros((0, 5, 4, 8))).shape == (0, 5, 4, 8)
    empty = tf.zeros((2, 0, 4, 8))
    assert dot_product_attention(empty, empty, empty, is_causal=causal, chunk_size=16).shape == (
        2, 0, 4, 8
    )
    # Queries without any key: zeros, as for fully masked rows.
    out = dot_product_attention(tf.ones((2, 5, 4, 8)), empty, empty, chunk_size=16)
    np.testing.assert_array_equal(out.numpy(), np.zeros((2, 5, 4, 8), "float32"))
