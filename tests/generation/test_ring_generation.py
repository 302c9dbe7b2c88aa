"""Sliding-window LMs generate with a ring-buffer cache of `window` positions.

Every step of cached decoding is checked against a NumPy float64 forward pass
of the whole model over the full prefix with a causal sliding-window mask
(written here from the weights, no keras_attn code involved), for
generation several times longer than the window, with rotary positions and
grouped-query heads.
"""

import numpy as np
import pytest
import tensorflow as tf

from keras_attn.generation import DecoderOnlyLM, greedy_search
from keras_attn.runtimes import signatures as gen_export
from keras_attn.layers import TransformerDecoderBlock, TransformerEncoderBlock
from tests import reference as ref
from tests import tolerance

VOCAB, WINDOW, MAX_LEN = 29, 4, 15
HEADS, KV_HEADS, HIDDEN = 4, 2, 16
# Right-padded prompts (0 = padding); the full-width one is longer than the window.
PROMPTS = np.array([[5, 6, 7, 8, 9, 10], [3, 4, 0, 0, 0, 0], [11, 12, 13, 0, 0, 0]], np.int32)
FULL = np.array([[5, 6, 7, 8, 9, 10], [3, 4, 5, 6, 7, 8]], np.int32)


@pytest.fixture(scope="module")
def ring_lm():
    lm = DecoderOnlyLM(VOCAB, 64, HIDDEN, num_layers=2, num_heads=HEADS, intermediate_dim=32,
                       num_key_value_heads=KV_HEADS, position="rotary", sliding_window=WINDOW)
    lm(PROMPTS)
    # Larger logits than at initialisation, so a wrong mask cannot hide.
    head = lm.lm_head
    head.kernel.assign(head.kernel * 4.0)
    return lm


def _window_mask(t, window):
    i, j = np.arange(t)[:, None], np.arange(t)[None, :]
    return (j <= i) & (i - j < window)


def _np_logits(lm, ids, window):
    """Full forward pass of the pre-norm LM in float64 from its weights."""
    w = lambda v: np.asarray(v, np.float64)  # noqa: E731
    x = w(lm.embedding.embeddings)[np.asarray(ids)]
    mask = _window_mask(x.shape[1], window)[None, None]
    for block in lm.blocks:
        att = block.self_attention
        h = ref.layer_norm(x, w(block.self_attention_layer_norm.gamma),
                           w(block.self_attention_layer_norm.beta), 1e-5)
        q = np.einsum("btd,dhk->bthk", h, w(att.query_dense.kernel)) + w(att.query_dense.bias)
        k = np.einsum("btd,dhk->bthk", h, w(att.key_dense.kernel)) + w(att.key_dense.bias)
        v = np.einsum("btd,dhk->bthk", h, w(att.value_dense.kernel)) + w(att.value_dense.bias)
        out, _ = ref.attention(ref.rotary(q), ref.rotary(k), v, mask=mask)
        x = x + np.einsum("bthk,hkd->btd", out, w(att.output_dense.kernel)) + w(
            att.output_dense.bias)
        h = ref.layer_norm(x, w(block.feedforward_layer_norm.gamma),
                           w(block.feedforward_layer_norm.beta), 1e-5)
        h = ref.relu(ref.linear(h, w(block.feedforward_intermediate_dense.kernel),
                                w(block.feedforward_intermediate_dense.bias)))
        x = x + ref.linear(h, w(block.feedforward_output_dense.kernel),
                           w(block.feedforward_output_dense.bias))
    x = ref.layer_norm(x, w(lm.final_norm.gamma), w(lm.final_norm.beta), 1e-5)
    return ref.linear(x, w(lm.lm_head.kernel), w(lm.lm_head.bias))


def _np_greedy(lm, prompt, max_length, window):
    seq = [int(t) for t in prompt if t != 0]
    while len(seq) < max_length:
        seq.append(int(np.argmax(_np_logits(lm, np.array([seq]), window)[0, -1])))
    return seq


def test_ring_cache_logits_equal_windowed_recomputation_every_step(ring_lm):
    lm = ring_lm
    length = 14  # 3.5 windows
    ids = np.random.default_rng(0).integers(1, VOCAB, size=(2, length)).astype(np.int32)
    expected = _np_logits(lm, ids, WINDOW)
    # The window matters: without it the logits differ.
    assert np.abs(_np_logits(lm, ids, length) - expected)[:, WINDOW:].max() > 1e-2
    # The plain (uncached) Keras pass applies the window too.
    tolerance.assert_close(np.asarray(lm(ids)), expected, terms=tolerance.LAYER_TERMS)

    step = tf.function(lambda t, c, i: lm.call_with_cache(t, c, i), reduce_retracing=True)
    cache = lm.init_cache(2, length)
    for layer in cache:
        assert tuple(layer["self_attention"][0].shape) == (2, WINDOW, KV_HEADS, HIDDEN // HEADS)
    # A prefill longer than the window (it wraps inside the block), then single tokens.
    index, got = 0, []
    for n in [6, 1, 1, 1, 2, 1, 1, 1]:
        logits, cache = step(ids[:, index:index + n], cache, tf.constant(index))
        got.append(np.asarray(logits))
        index += n
        for layer in cache:
            for part in layer["self_attention"]:
                assert tuple(part.shape) == (2, WINDOW, KV_HEADS, HIDDEN // HEADS)
    assert index == length
    tolerance.assert_close(np.concatenate(got, axis=1), expected, terms=tolerance.LAYER_TERMS)


@pytest.mark.parametrize(
    "prompts, jit_compile",
    [(FULL, False), (PROMPTS, False), (PROMPTS, True)],
    ids=["full_width", "right_padded", "right_padded_xla"],
)
def test_ring_greedy_matches_windowed_recomputation(ring_lm, prompts, jit_compile):
    # Right-padded rows cannot be prefilled whole into a ring buffer (the
    # loop would have to step back over it): the search then feeds them
    # token by token, which this case checks.
    got = greedy_search(ring_lm, prompts, MAX_LEN, jit_compile=jit_compile).numpy()
    expected = [_np_greedy(ring_lm, row, MAX_LEN, WINDOW) for row in prompts]
    np.testing.assert_array_equal(got, np.array(expected))
    # Generation goes well past the window, from a cache of `window` slots.
    assert MAX_LEN > 3 * WINDOW
    assert ring_lm.init_cache(1, MAX_LEN)[0]["self_attention"][0].shape[1] == WINDOW


@pytest.mark.slow
def test_ring_tflite_greedy_loop_matches_keras(ring_lm):
    from ai_edge_litert import interpreter as litert

    content = gen_export.tflite_bytes(ring_lm, max_length=MAX_LEN, batch_size=3,
                                      prompt_length=PROMPTS.shape[1])
    interpreter = litert.Interpreter(model_content=content)
    decode = interpreter.get_signature_runner("decode")
    assert tuple(decode.get_input_details()["cache"]["shape"]) == (
        2, 2, 3, WINDOW, KV_HEADS, HIDDEN // HEADS)
    got = gen_export.greedy_loop(interpreter.get_signature_runner("prefill"), decode,
                                 PROMPTS, MAX_LEN, sliding_window=WINDOW)
    expected = [_np_greedy(ring_lm, row, MAX_LEN, WINDOW) for row in PROMPTS]
    np.testing.assert_array_equal(got, np.array(expected))


def test_blocks_sliding_window_config_and_errors():
    block = TransformerDecoderBlock(2, intermediate_dim=16, sliding_window=3)
    block(np.zeros((1, 5, 8), np.float32))
    assert block.self_attention.sliding_window == 3
    assert TransformerDecoderBlock.from_config(block.get_config()).sliding_window == 3
    encoder = TransformerEncoderBlock(2, intermediate_dim=16, sliding_window=2)
    encoder(np.zeros((1, 5, 8), np.float32))
    assert encoder.self_attention.sliding_window == 2
    lm = DecoderOnlyLM(VOCAB, 16, 8, num_layers=1, num_heads=2, intermediate_dim=16,
                       sliding_window=5)
    assert DecoderOnlyLM.from_config(lm.get_config()).sliding_window == 5
    assert lm.init_cache(1, 3)[0]["self_attention"][0].shape[1] == 3  # shorter than the window
    for bad in (0, -2, 2.5):
        with pytest.raises(ValueError, match="sliding_window"):
            TransformerDecoderBlock(2, intermediate_dim=16, sliding_window=bad)
        with pytest.raises(ValueError, match="sliding_window"):
            DecoderOnlyLM(VOCAB, 16, 8, num_layers=1, num_heads=2, intermediate_dim=16,
                          sliding_window=bad)


@pytest.mark.slow
def test_ring_saved_model_generate_signature(ring_lm, tmp_path):
    """The SavedModel `generate` signature takes prompts of any width (a
    dynamic width in the ring-buffer prefill choice), full or right-padded."""
    loaded = tf.saved_model.load(gen_export.export_saved_model(ring_lm, str(tmp_path / "ring"),
                                                               max_length=MAX_LEN))
    for prompts in (PROMPTS, FULL):
        got = loaded.signatures["generate"](prompt_ids=tf.constant(prompts))["tokens"].numpy()
        expected = [_np_greedy(ring_lm, row, MAX_LEN, WINDOW) for row in prompts]
        np.testing.assert_array_equal(got, np.array(expected))
