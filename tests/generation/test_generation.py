"""Cached generation against full recomputation and NumPy references."""

import numpy as np
import pytest
import tensorflow as tf

from keras_attn.generation import (
    DecoderOnlyLM,
    Seq2SeqLM,
    beam_search,
    filter_logits,
    greedy_search,
    random_sampling,
)
from tests import reference as ref
from tests import tolerance

VOCAB = 23
MAX_LEN = 12
# Right-padded prompts of different lengths (0 = padding).
PROMPTS = np.array([[5, 6, 7, 0], [3, 4, 0, 0], [9, 8, 7, 6]], np.int32)


@pytest.fixture(scope="module")
def gqa_rotary_lm():
    lm = DecoderOnlyLM(VOCAB, 32, 16, num_layers=2, num_heads=4, intermediate_dim=32,
                       num_key_value_heads=2, position="rotary")
    lm(PROMPTS)
    return lm


@pytest.fixture(scope="module")
def sinusoidal_lm():
    lm = DecoderOnlyLM(VOCAB, 32, 16, num_layers=2, num_heads=2, intermediate_dim=32)
    lm(PROMPTS)
    return lm


@pytest.fixture(scope="module")
def relative_llama_lm():
    """T5-style relative bias (randomised: it starts at zero) with today's
    decoder switches and a head size unrelated to hidden/heads."""
    lm = DecoderOnlyLM(VOCAB, 32, 16, num_layers=2, num_heads=4, intermediate_dim=24,
                       num_key_value_heads=2, head_dim=6, position="relative",
                       relative_attention_num_buckets=8, relative_attention_max_distance=6,
                       normalization="rms_norm", use_gated_feedforward=True, activation="silu",
                       attention_use_bias=False, feedforward_use_bias=False)
    lm(PROMPTS)
    table = lm.position_bias.embeddings
    table.assign(np.random.default_rng(0).standard_normal(table.shape).astype("float32") * 3)
    return lm


@pytest.fixture(scope="module")
def learned_lm():
    lm = DecoderOnlyLM(VOCAB, 16, 16, num_layers=1, num_heads=2, intermediate_dim=32,
                       position="learned")
    lm(PROMPTS)
    return lm


@pytest.fixture(scope="module")
def seq2seq():
    model = Seq2SeqLM(VOCAB, 32, 16, num_layers=2, num_heads=4, intermediate_dim=32,
                      num_key_value_heads=2)
    enc = np.array([[5, 6, 7, 8, 0, 0], [3, 4, 5, 6, 7, 9]], np.int32)
    model((enc, np.array([[1], [1]], np.int32)))
    return model, enc


_FULL = {}


def _full_last_logits(lm, seq, encoder_ids=None, width=16):
    """Logits after `seq` from the plain (uncached) forward pass.

    The sequence is right-padded to a fixed width and read at its last real
    position, which causal attention makes independent of the padding; the
    fixed shape lets one traced function serve every step.
    """
    key = (id(lm), encoder_ids is not None)
    if key not in _FULL:
        _FULL[key] = tf.function(lambda *args: lm(args if len(args) > 1 else args[0]))
    padded = np.zeros((1, width), np.int32)
    padded[0, :len(seq)] = seq
    args = (padded,) if encoder_ids is None else (encoder_ids, padded)
    return np.asarray(_FULL[key](*args))[0, len(seq) - 1]


def _reference_greedy(next_logits, prompt, max_length, stops=(), pad=0):
    """Greedy decoding by recomputing the whole prefix at every step."""
    seq = [int(t) for t in prompt if t != pad]
    done = False
    while len(seq) < max_length:
        if done:
            seq.append(pad)
            continue
        seq.append(int(np.argmax(next_logits(seq))))
        done = seq[-1] in stops
    return seq


@pytest.mark.parametrize("fixture", ["gqa_rotary_lm", "sinusoidal_lm", "learned_lm",
                                     "relative_llama_lm"])
def test_cached_logits_equal_full_recomputation_every_step(request, fixture):
    lm = request.getfixturevalue(fixture)
    batch = len(PROMPTS)
    lengths = (PROMPTS != 0).sum(1)
    cache = lm.init_cache(batch, MAX_LEN)
    _, cache = lm.call_with_cache(PROMPTS, cache, 0)
    seqs = [list(p[:n]) for p, n in zip(PROMPTS, lengths)]
    tokens = np.zeros((batch, MAX_LEN), np.int32)
    tokens[:, :PROMPTS.shape[1]] = PROMPTS
    for index in range(int(lengths.min()), MAX_LEN):
        logits, cache = lm.call_with_cache(tokens[:, index - 1:index], cache, index - 1)
        logits = np.asarray(logits)[:, 0]
        for b in range(batch):
            if index <= lengths[b] - 1:
                continue  # still inside this row's prompt
            full = _full_last_logits(lm, seqs[b])
            tolerance.assert_close(logits[b], full, terms=tolerance.LAYER_TERMS)
            assert np.argmax(logits[b]) == np.argmax(full)
        for b in range(batch):
            if index >= lengths[b]:
                seqs[b].append(int(np.argmax(logits[b])))
                tokens[b, index] = seqs[b][-1]


def test_seq2seq_cached_logits_equal_full_recomputation(seq2seq):
    model, enc = seq2seq
    encoded, mask = model.encode(enc)
    cache = model.init_cache(2, 8)
    dec = [[1], [1]]
    logits, cache = model.call_with_cache(np.array(dec, np.int32), cache, 0,
                                          encoder_outputs=encoded, encoder_padding_mask=mask)
    for index in range(1, 8):
        full = np.stack([_full_last_logits(model, dec[b], enc[b:b + 1]) for b in range(2)])
        tolerance.assert_close(np.asarray(logits)[:, -1], full, terms=tolerance.LAYER_TERMS)
        for b in range(2):
            dec[b].append(int(np.argmax(full[b])))
        step = np.array([[d[-1]] for d in dec], np.int32)
        logits, cache = model.call_with_cache(step, cache, index, encoder_padding_mask=mask)


def test_greedy_search_padded_batch_matches_recomputation(gqa_rotary_lm):
    lm = gqa_rotary_lm
    expected = [_reference_greedy(lambda s: _full_last_logits(lm, s), p, MAX_LEN)
                for p in PROMPTS]
    got = greedy_search(lm, PROMPTS, MAX_LEN).numpy()
    np.testing.assert_array_equal(got, np.array(expected))
    # Each row decodes as it would alone (right padding needs no mask).
    alone = greedy_search(lm, PROMPTS[1:2, :2], MAX_LEN).numpy()
    np.testing.assert_array_equal(alone[0], got[1])
    # The whole loop compiles with XLA and gives the same tokens.
    xla = greedy_search(lm, PROMPTS, MAX_LEN, jit_compile=True).numpy()
    np.testing.assert_array_equal(xla, got)


def test_greedy_search_stop_tokens(sinusoidal_lm):
    lm = sinusoidal_lm
    free = [_reference_greedy(lambda s: _full_last_logits(lm, s), p, MAX_LEN) for p in PROMPTS]
    stop = free[0][6]  # a token that row 0 generates
    expected = [_reference_greedy(lambda s: _full_last_logits(lm, s), p, MAX_LEN, stops=(stop,))
                for p in PROMPTS]
    got = greedy_search(lm, PROMPTS, MAX_LEN, stop_token_ids=(stop,)).numpy()
    np.testing.assert_array_equal(got, np.array(expected))
    assert (got[0, 7:] == 0).all()


def test_seq2seq_greedy_matches_recomputation(seq2seq):
    model, enc = seq2seq
    start = np.array([[1], [1]], np.int32)
    expected = []
    for b in range(2):
        def next_logits(seq, b=b):
            return _full_last_logits(model, seq, enc[b:b + 1])
        expected.append(_reference_greedy(next_logits, [1], 8))
    got = greedy_search(model, start, 8, encoder_ids=enc).numpy()
    np.testing.assert_array_equal(got, np.array(expected))


def _np_filter(logits, temperature, top_k, top_p):
    logits = np.asarray(logits, np.float64) / temperature
    keep = np.ones_like(logits, bool)
    for b, row in enumerate(logits):
        order = np.argsort(-row)
        if top_k is not None:
            keep[b, order[top_k:]] = False
        if top_p is not None:
            probs = ref.softmax(np.where(keep[b], row, -np.inf))
            cumulative = np.cumsum(probs[order]) - probs[order]
            keep[b, order[cumulative >= top_p]] = False
    return keep


@pytest.mark.parametrize("temperature, top_k, top_p",
                         [(1.0, 3, None), (0.7, None, 0.8), (1.3, 5, 0.6), (1.0, None, None)])
def test_filter_logits_matches_numpy(rng, temperature, top_k, top_p):
    logits = rng.normal(size=(4, 11)).astype("float32") * 2
    got = filter_logits(logits, temperature, top_k, top_p).numpy()
    keep = _np_filter(logits, temperature, top_k, top_p)
    np.testing.assert_array_equal(got > -1e8, keep)
    np.testing.assert_allclose(got[keep], (logits / temperature)[keep], rtol=1e-6)


class _FixedLogits:
    """A stand-in model whose next-token logits never change (no cache)."""

    def __init__(self, logits):
        self.logits = tf.constant(logits, tf.float32)

    def init_cache(self, batch_size, max_length):
        return []

    def call_with_cache(self, token_ids, cache, cache_index):
        batch, length = tf.shape(token_ids)[0], tf.shape(token_ids)[1]
        return tf.tile(self.logits[None, None], (batch, length, 1)), cache


def test_sampling_distribution_matches_numpy(rng):
    logits = rng.normal(size=(7,)).astype("float32") * 1.5
    model = _FixedLogits(logits)
    n = 20000
    prompt = np.ones((n, 1), np.int32)
    samples = random_sampling(model, prompt, 2, seed=11, temperature=0.8, top_k=5,
                              top_p=0.9).numpy()[:, 1]
    keep = _np_filter(logits[None], 0.8, 5, 0.9)[0]
    expected = ref.softmax(np.where(keep, logits / 0.8, -np.inf))
    freq = np.bincount(samples, minlength=7) / n
    assert (freq[~keep] == 0).all()
    sigma = np.sqrt(expected * (1 - expected) / n)
    assert (np.abs(freq - expected) <= 5 * sigma + 1e-9).all(), (freq, expected)


def test_sampling_is_seeded(gqa_rotary_lm):
    lm = gqa_rotary_lm
    a = random_sampling(lm, PROMPTS, MAX_LEN, seed=3, top_k=8).numpy()
    b = random_sampling(lm, PROMPTS, MAX_LEN, seed=3, top_k=8).numpy()
    c = random_sampling(lm, PROMPTS, MAX_LEN, seed=4, top_k=8).numpy()
    np.testing.assert_array_equal(a, b)
    assert (a != c).any()
    np.testing.assert_array_equal(a[:, :2], PROMPTS[:, :2])  # prompts kept
    xla = random_sampling(lm, PROMPTS, MAX_LEN, seed=3, top_k=8, jit_compile=True).numpy()
    np.testing.assert_array_equal(xla, a)  # same draws under XLA
    top1 = random_sampling(lm, PROMPTS, MAX_LEN, seed=5, top_k=1).numpy()
    np.testing.assert_array_equal(top1, greedy_search(lm, PROMPTS, MAX_LEN).numpy())


def _reference_beam(lm, prompt, max_length, num_beams):
    beams = [(list(prompt), 0.0)]
    while len(beams[0][0]) < max_length:
        candidates = []
        for seq, score in beams:
            logp = np.log(ref.softmax(_full_last_logits(lm, seq).astype(np.float64)))
            candidates += [(seq + [t], score + logp[t]) for t in range(VOCAB)]
        candidates.sort(key=lambda c: -c[1])
        beams = candidates[:num_beams]
    return beams[0]


def test_beam_search_matches_numpy_reference(sinusoidal_lm):
    lm = sinusoidal_lm
    prompts = np.array([[5, 6, 7], [9, 8, 2]], np.int32)
    tokens, scores = beam_search(lm, prompts, 8, num_beams=3, return_scores=True)
    for b in range(2):
        seq, score = _reference_beam(lm, prompts[b], 8, 3)
        np.testing.assert_array_equal(tokens.numpy()[b], seq)
        tolerance.assert_close(scores.numpy()[b], score, terms=tolerance.LAYER_TERMS)
    one = beam_search(lm, PROMPTS, MAX_LEN, num_beams=1).numpy()
    np.testing.assert_array_equal(one, greedy_search(lm, PROMPTS, MAX_LEN).numpy())


def test_search_argument_errors(sinusoidal_lm):
    with pytest.raises(ValueError, match="max_length"):
        greedy_search(sinusoidal_lm, PROMPTS, 0)
    with pytest.raises(ValueError, match="prompt_ids"):
        greedy_search(sinusoidal_lm, PROMPTS, 3)
    with pytest.raises(ValueError, match="top_p"):
        random_sampling(sinusoidal_lm, PROMPTS, 8, seed=1, top_p=1.5)
    with pytest.raises(ValueError, match="num_beams"):
        beam_search(sinusoidal_lm, PROMPTS, 8, num_beams=0)


def test_call_with_cache_rejects_writes_past_the_cache(sinusoidal_lm):
    lm = sinusoidal_lm
    ids = np.array([[1, 2, 3, 4, 5, 6]], np.int32)
    with pytest.raises(ValueError, match=r"holds 4 positions.*\[0, 6\)"):
        lm.call_with_cache(ids, lm.init_cache(1, 4), 0)  # oversized prefill
    _, cache = lm.call_with_cache(ids[:, :4], lm.init_cache(1, 4), 0)
    with pytest.raises(ValueError, match=r"holds 4 positions.*\[4, 5\)"):
        lm.call_with_cache(ids[:, 4:5], cache, 4)  # a step past the end
    with pytest.raises(ValueError, match=r"holds 4 positions.*\[4, 5\)"):
        lm.call_with_cache(ids[:, 4:5], cache, tf.constant(4))  # eager: known too
    # The last slot is still writable and exact.
    _, cache = lm.call_with_cache(ids[:, :3], lm.init_cache(1, 4), 0)
    logits, _ = lm.call_with_cache(ids[:, 3:4], cache, 3)
    full = np.asarray(lm(ids[:, :4]))[0, 3]
    tolerance.assert_close(np.asarray(logits)[0, 0], full, terms=tolerance.LAYER_TERMS)


def test_ring_buffer_cache_may_be_written_past_its_length():
    lm = DecoderOnlyLM(VOCAB, 16, 16, num_layers=1, num_heads=2, intermediate_dim=32,
                       sliding_window=3)
    ids = np.array([[5, 6, 7, 8, 9, 1, 2]], np.int32)
    full = np.asarray(lm(ids))[0]  # windowed full pass
    cache = lm.init_cache(1, 7)
    assert cache[0]["self_attention"][0].shape[1] == 3
    for index in range(7):
        logits, cache = lm.call_with_cache(ids[:, index:index + 1], cache, index)
        tolerance.assert_close(np.asarray(logits)[0, 0], full[index], terms=tolerance.LAYER_TERMS)


def test_learned_positions_bound_max_length_up_front(learned_lm):
    # learned_lm has 16 learned positions. Under XLA a position past the
    # table is clamped to its last row (wrong tokens, no error), so every
    # search checks max_length before tracing, with and without XLA.
    assert learned_lm.max_positions == 16
    for jit in (False, True):
        for search in (
            lambda: greedy_search(learned_lm, PROMPTS, 17, jit_compile=jit),
            lambda: random_sampling(learned_lm, PROMPTS, 17, seed=0, jit_compile=jit),
            lambda: beam_search(learned_lm, PROMPTS, 17, num_beams=2, jit_compile=jit),
        ):
            with pytest.raises(ValueError, match=r"max_positions=16.*max_length=17"):
                search()
    # The whole table is usable: 16 positions decode as the full recomputation.
    expected = [_reference_greedy(lambda s: _full_last_logits(learned_lm, s), p, 16)
                for p in PROMPTS]
    np.testing.assert_array_equal(greedy_search(learned_lm, PROMPTS, 16).numpy(), expected)
    assert DecoderOnlyLM(VOCAB, 4, 16, num_layers=1, num_heads=2,
                         intermediate_dim=8).max_positions is None  # sinusoidal
    s2s = Seq2SeqLM(VOCAB, 6, 16, num_layers=1, num_heads=2, intermediate_dim=8,
                    position="learned")
    with pytest.raises(ValueError, match=r"encoder_ids.*max_positions=6.*length=7"):
        greedy_search(s2s, [[1]], 6, encoder_ids=np.ones((1, 7), np.int32))


def test_prompt_lists_and_integer_dtypes_are_converted(sinusoidal_lm):
    expected = greedy_search(sinusoidal_lm, PROMPTS, 8).numpy()
    for prompt in (PROMPTS.tolist(), PROMPTS.astype(np.int64), tf.constant(PROMPTS, tf.int64)):
        np.testing.assert_array_equal(greedy_search(sinusoidal_lm, prompt, 8).numpy(), expected)


def test_prompt_and_top_k_errors_name_the_argument(sinusoidal_lm):
    lm = sinusoidal_lm
    with pytest.raises(ValueError, match=r"prompt_ids.*2-D.*shape=\(3,\)"):
        greedy_search(lm, np.array([5, 6, 7]), 8)
    with pytest.raises(ValueError, match=r"prompt_ids.*rectangular"):
        greedy_search(lm, [[5, 6], [7]], 8)
    with pytest.raises(ValueError, match=r"prompt_ids.*integer.*float"):
        beam_search(lm, PROMPTS.astype("float32"), 8)
    with pytest.raises(ValueError, match=r"encoder_ids.*2-D"):
        greedy_search(lm, PROMPTS, 8, encoder_ids=np.array([1, 2]))
    # top_k is not clamped (KerasHub's TopKSampler fails too): a clear error.
    with pytest.raises(ValueError, match=rf"top_k.*vocabulary size \({VOCAB}\).*top_k=50"):
        random_sampling(lm, PROMPTS, 8, seed=0, top_k=50)
    with pytest.raises(ValueError, match=r"top_k.*vocabulary size \(11\)"):
        filter_logits(np.zeros((2, 11), "float32"), top_k=12)
    # A model without `vocabulary_size` is checked from its logits while tracing.
    with pytest.raises(ValueError, match=r"top_k.*vocabulary size \(7\)"):
        random_sampling(_FixedLogits(np.zeros(7)), np.ones((2, 1), np.int32), 3, seed=0, top_k=8)


def test_attention_mask_gives_hugging_face_layout_for_every_search(gqa_rotary_lm):
    """Left-padded prompts with a mask: each row continues its own prompt, by
    full recomputation (greedy), as a lone row (sampling) and as the
    right-padded row (beam search); the result keeps the prompt as given and
    adds `max_length - width` tokens."""
    lm = gqa_rotary_lm
    ids = np.array([[0, 0, 5, 6], [3, 4, 7, 8], [0, 9, 2, 4]], np.int32)
    mask = (ids != 0).astype("int32")
    width, new = ids.shape[1], MAX_LEN - ids.shape[1]
    got = greedy_search(lm, ids, MAX_LEN, attention_mask=mask).numpy()
    for row in range(3):
        prompt = ids[row][mask[row] == 1]
        seq = _reference_greedy(lambda s: _full_last_logits(lm, s), prompt, MAX_LEN)
        np.testing.assert_array_equal(got[row, :width], ids[row])
        np.testing.assert_array_equal(got[row, width:], seq[len(prompt):len(prompt) + new])
    sampled = random_sampling(lm, ids, MAX_LEN, seed=3, attention_mask=mask).numpy()
    lone = random_sampling(lm, ids[:1, 2:], MAX_LEN, seed=3).numpy()
    np.testing.assert_array_equal(sampled[0, width:], lone[0, 2:2 + new])
    # Beam search (checked against NumPy elsewhere): the masked call is the
    # right-padded one, laid out as Hugging Face's; a NumPy beam reference
    # here would flip on near-ties of this random model under other kernels.
    beams = beam_search(lm, ids[:1], MAX_LEN, num_beams=2, attention_mask=mask[:1]).numpy()
    right = beam_search(lm, np.array([[5, 6, 0, 0]], np.int32), MAX_LEN, num_beams=2).numpy()
    np.testing.assert_array_equal(beams[0], np.concatenate([ids[0], right[0, 2:2 + new]]))
    with pytest.raises(ValueError, match="attention_mask"):
        greedy_search(lm, ids, MAX_LEN, attention_mask=mask[:, :2])
    with pytest.raises(ValueError, match="at least one token"):
        greedy_search(lm, ids, MAX_LEN, attention_mask=np.zeros_like(mask))


@pytest.mark.parametrize("search", ["greedy", "beam", "stop_tokens"])
def test_searches_first_call_with_one_row(search):
    """First (non-relaxed) traces with a static batch of one: the loop keeps
    the cache's static shape through the beam reordering and the token
    buffer (tests/runtimes/test_onnx_genai.py hit the latter with an exported model)."""
    lm = DecoderOnlyLM(VOCAB, 32, 16, num_layers=1, num_heads=4, intermediate_dim=32,
                       num_key_value_heads=2, position="rotary")
    prompt = np.array([[5, 6, 7]], np.int32)
    if search == "beam":
        tokens = beam_search(lm, prompt, 8, num_beams=1).numpy()
    else:
        stops = (VOCAB - 1,) if search == "stop_tokens" else ()
        tokens = greedy_search(lm, prompt, 8, stop_token_ids=stops).numpy()
    want = _reference_greedy(lambda s: _full_last_logits(lm, s), prompt[0], 8,
                             stops=(VOCAB - 1,) if search == "stop_tokens" else ())
    np.testing.assert_array_equal(tokens[0], want)


def test_lm_option_errors():
    with pytest.raises(ValueError, match="sliding_window"):
        DecoderOnlyLM(VOCAB, 32, 16, num_layers=1, num_heads=2, intermediate_dim=8,
                      position="relative", sliding_window=4)
    with pytest.raises(ValueError, match="num_decoder_layers"):
        DecoderOnlyLM(VOCAB, 32, 16, num_layers=1, num_heads=2, intermediate_dim=8,
                      num_decoder_layers=2)
    with pytest.raises(ValueError, match="rope_scaling"):
        DecoderOnlyLM(VOCAB, 32, 16, num_layers=1, num_heads=2, intermediate_dim=8,
                      rope_scaling={"rope_type": "linear", "factor": 2.0})
    with pytest.raises(ValueError, match="head_dim"):
        DecoderOnlyLM(VOCAB, 32, 16, num_layers=1, num_heads=3, intermediate_dim=8)
