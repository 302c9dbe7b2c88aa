"""The layer and model options Gemma 4 needs, usable from scratch, each
against NumPy written here: a `MultiHeadAttention` that attends over
another layer's keys and values (`shared_key_value`, uncached and through a
ring-buffer cache), the value norm, the decoder block's per-layer input and
output scale, "proportional" rotary; `DecoderOnlyLM`'s `key_value_sources`,
per-layer input embeddings and head sizes, key/value heads and
feed-forward widths per layer (cached decoding equal to the full
computation, caches only for layers with their own keys, each of its
layer's shape); their configs, `.keras` round trips and the errors naming a
bad argument.
(`tests/convert/test_convert_gemma4.py` checks the whole model against
transformers.)"""

import math

import keras
import numpy as np
import pytest

from keras_attn.generation.models import DecoderOnlyLM
from keras_attn.layers import MultiHeadAttention
from keras_attn.layers import RotaryEmbedding
from keras_attn.layers import TransformerDecoderBlock
from tests import reference
from tests import tolerance


def np_rms(x, scale=1.0, eps=1e-6):
    x = np.asarray(x, np.float64)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def np_heads(x, dense):
    """`x @ kernel` of an EinsumDense `(D, H, d)` -> `(B, T, H, d)`."""
    return np.einsum("btd,dhk->bthk", np.asarray(x, np.float64), dense.kernel.numpy())


def np_attention(q, k, v, mask):
    groups = q.shape[2] // k.shape[2]
    k, v = np.repeat(k, groups, axis=2), np.repeat(v, groups, axis=2)
    logits = np.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
    probs = reference.softmax(np.where(mask, logits, -np.inf))
    return np.einsum("bhqk,bkhd->bqhd", probs, v)


def inv_freq(dim, base):
    return base ** (-np.arange(0, dim, 2) / dim)


def _set_random(layer, rng, scale):
    for w in layer.weights:
        w.assign(rng.normal(size=w.shape).astype("float32") * scale)


def _pair(window=3):
    """A layer with its own keys and values and one reusing them."""
    options = dict(num_heads=4, key_dim=6, num_key_value_heads=2, use_qk_norm=True,
                   use_value_norm=True, rotary_embedding=RotaryEmbedding(100.0),
                   sliding_window=window, use_bias=False)
    return MultiHeadAttention(**options), MultiHeadAttention(**options, shared_key_value=True)


def test_shared_key_value_attention_matches_numpy(rng):
    """Layer b attends with its own queries over layer a's keys and values
    (key norm, rotary and value norm applied by a); b has no key/value weights."""
    a, b = _pair()
    x1, x2 = (rng.normal(size=(2, 7, 10)).astype("float32") for _ in range(2))
    a(x1, x1)
    b(x2, x2, key_value=a(x1, x1, return_key_value=True)[1])
    assert b.key_dense is None and b.value_dense is None and b.key_norm is None
    assert len(b.weights) == len(a.weights) - 3  # key, value, key norm
    for layer in (a, b):
        _set_random(layer, rng, 0.6)
    out_a, kv = a(x1, x1, use_causal_mask=True, return_key_value=True)
    got = b(x2, x2, use_causal_mask=True, key_value=kv)

    freqs = inv_freq(6, 100.0)
    k = reference.rotary(np_rms(np_heads(x1, a.key_dense), a.key_norm.scale.numpy()), inv_freq=freqs)
    v = np_rms(np_heads(x1, a.value_dense))
    t = np.arange(7)
    band = (t[None, :] <= t[:, None]) & (t[:, None] - t[None, :] < 3)
    for layer, x, out in ((a, x1, out_a), (b, x2, got)):
        q = reference.rotary(np_rms(np_heads(x, layer.query_dense), layer.query_norm.scale.numpy()),
                             inv_freq=freqs)
        heads = np_attention(q, k, v, band[None, None])
        want = np.einsum("bthk,hkd->btd", heads, layer.output_dense.kernel.numpy())
        tolerance.assert_close(np.asarray(out), want, terms=tolerance.LAYER_TERMS)


def test_shared_key_value_through_a_ring_cache_equals_uncached(rng):
    """A prefill longer than the window (the ring wraps inside the call),
    then single steps: the reusing layer sees what it sees uncached."""
    a, b = _pair(window=3)
    x1, x2 = (rng.normal(size=(2, 8, 10)).astype("float32") for _ in range(2))
    _, kv = a(x1, x1, use_causal_mask=True, return_key_value=True)
    want = np.asarray(b(x2, x2, use_causal_mask=True, key_value=kv))
    cache = (np.zeros((2, 3, 2, 6), "float32"),) * 2
    steps = []
    for start, stop in ((0, 5), (5, 6), (6, 7), (7, 8)):
        _, cache, kv = a(x1[:, start:stop], x1[:, start:stop], use_causal_mask=True, cache=cache,
                         cache_index=start, return_key_value=True)
        steps.append(np.asarray(b(x2[:, start:stop], x2[:, start:stop], use_causal_mask=True,
                                  cache_index=start, key_value=kv)))
    tolerance.assert_close(np.concatenate(steps, axis=1), want, terms=tolerance.LAYER_TERMS)


def test_shared_key_value_errors(rng):
    a, b = _pair()
    x = rng.normal(size=(1, 4, 10)).astype("float32")
    _, kv = a(x, x, return_key_value=True)
    with pytest.raises(ValueError, match="`key_value` is for a layer built with `shared_key_value=True`"):
        a(x, x, key_value=kv)
    with pytest.raises(ValueError, match="shared_key_value=True` has no keys.*Received: key_value=NoneType"):
        b(x, x)
    with pytest.raises(ValueError, match="cache_index` if and only if"):
        b(x, x, key_value=kv, cache_index=0)
    with pytest.raises(TypeError, match="`shared_key_value`, expected a bool"):
        MultiHeadAttention(num_heads=2, key_dim=4, shared_key_value="yes")


def test_block_per_layer_input_and_output_scale_match_numpy(rng):
    """`(x' + norm(projection(silu(gate(x')) * p))) * scale`, `x'` the
    output of the same block without them."""
    options = dict(num_heads=2, intermediate_dim=12, normalize_first=True, normalization="rms_norm",
                   use_gated_feedforward=True, activation="silu", layer_norm_epsilon=1e-6)
    block = TransformerDecoderBlock(**options, per_layer_input_dim=3, use_output_scale=True)
    plain = TransformerDecoderBlock(**options)
    x = rng.normal(size=(2, 5, 8)).astype("float32")
    p = rng.normal(size=(2, 5, 3)).astype("float32")
    block(x, per_layer_input=p)
    plain(x)
    _set_random(block, rng, 0.5)
    block.output_scale.assign(np.array([0.7], "float32"))
    plain.set_weights([w.numpy() for w in block.weights if not w.path.split("/")[-2].startswith("per_layer")
                       and "output_scale" not in w.path])
    got = np.asarray(block(x, per_layer_input=p))
    inner = np.asarray(plain(x), np.float64)
    gate = inner @ block.per_layer_input_gate.kernel.numpy()
    h = gate / (1.0 + np.exp(-gate)) * p
    h = np_rms(h @ block.per_layer_input_projection.kernel.numpy(),
               block.per_layer_input_norm.scale.numpy())
    tolerance.assert_close(got, (inner + h) * 0.7, terms=tolerance.LAYER_TERMS)
    with pytest.raises(ValueError, match=r"needs `per_layer_input` of shape \(batch, seq, 3\)"):
        block(x)
    with pytest.raises(ValueError, match="`per_layer_input` needs a block built with"):
        plain(x, per_layer_input=p)


@pytest.mark.parametrize("factor", [1.0, 2.0])
def test_proportional_rotary_matches_numpy(rng, factor):
    """Whole-head frequencies on the first int(p * D // 2) pairs (i, i + D/2), the rest unrotated."""
    x = rng.normal(size=(2, 5, 3, 12)).astype("float32")
    rope = RotaryEmbedding(1000.0, rope_scaling={"rope_type": "proportional",
                                                 "partial_rotary_factor": 0.5, "factor": factor})
    freqs = np.concatenate([inv_freq(12, 1000.0)[:3], np.zeros(3)]) / factor
    want = reference.rotary(x, start=4, inv_freq=freqs)
    tolerance.assert_close(np.asarray(rope(x, start_index=4)), want)
    again = RotaryEmbedding.from_config(rope.get_config())
    assert again.rope_scaling == {"rope_type": "proportional", "partial_rotary_factor": 0.5,
                                  "factor": factor}
    with pytest.raises(ValueError, match="partial_rotary_factor.*fraction"):
        RotaryEmbedding(rope_scaling={"rope_type": "proportional", "partial_rotary_factor": 2.0})


def _gemma4_like_lm():
    """Windows on layers 0, 2 and 3; layer 3 reuses layer 2's keys, layer 4
    layer 1's; as the released Gemma 4s, the full layers (1, 4) have larger
    heads and fewer key/value heads, the KV-shared ones (3, 4) twice as wide
    feed-forwards."""
    return DecoderOnlyLM(
        29, 16, 12, num_layers=5, num_heads=4, num_key_value_heads=[2, 1, 2, 2, 1],
        intermediate_dim=[16, 16, 16, 32, 32], head_dim=[6, 10, 6, 6, 10],
        position="rotary", sliding_window=[3, None, 3, 3, None],
        key_value_sources=[None, None, None, 2, 1], per_layer_input_dim=4,
        per_layer_input_vocabulary_size=31, use_value_norm=True, use_output_scale=True,
        use_qk_norm=True, normalization="rms_norm", use_sandwich_norm=True,
        use_gated_feedforward=True, local_rope_max_wavelength=50.0,
        rope_scaling={"rope_type": "proportional", "partial_rotary_factor": 0.5},
        final_logit_soft_cap=5.0, mask_padded_queries=False,
    )


def test_decoder_lm_shared_layers_and_per_layer_inputs_cached_equals_full(rng):
    """Caches for layers 0-2 only (rings of the window where windowed), each
    of its layer's heads and head size; a prefill past the window, then
    single steps, equal the full computation."""
    lm = _gemma4_like_lm()
    ids = rng.integers(3, 29, size=(2, 7)).astype("int32")
    lm(ids)
    _set_random(lm, rng, 0.7)
    full = np.asarray(lm(ids))
    cache = lm.init_cache(2, 7)
    assert [tuple(c["self_attention"][0].shape) for c in cache] == [(2, 3, 2, 6), (2, 7, 1, 10), (2, 3, 2, 6)]
    assert [tuple(c["self_attention"][0].shape) for c in lm.init_cache(1, 7, ring_buffers=False)] == [
        (1, 7, 2, 6), (1, 7, 1, 10), (1, 7, 2, 6)]
    assert [b.self_attention.shared_key_value for b in lm.blocks] == [False] * 3 + [True] * 2
    # Each block's weights have its layer's sizes: queries (hidden, heads, head_dim),
    # keys (hidden, kv_heads, head_dim) where it projects its own, feed-forward width.
    assert [tuple(b.self_attention.query_dense.kernel.shape) for b in lm.blocks] == [
        (12, 4, 6), (12, 4, 10), (12, 4, 6), (12, 4, 6), (12, 4, 10)]
    assert [tuple(b.self_attention.key_dense.kernel.shape) for b in lm.blocks[:3]] == [
        (12, 2, 6), (12, 1, 10), (12, 2, 6)]
    assert [tuple(b.feedforward_output_dense.kernel.shape) for b in lm.blocks] == [
        (16, 12), (16, 12), (16, 12), (32, 12), (32, 12)]
    logits, cache = lm.call_with_cache(ids[:, :5], cache, 0)
    steps = [np.asarray(logits)]
    for i in range(5, 7):
        logits, cache = lm.call_with_cache(ids[:, i:i + 1], cache, i)
        steps.append(np.asarray(logits))
    tolerance.assert_close(np.concatenate(steps, axis=1), full, terms=5 * 64)
    assert lm.per_layer_embedding.embeddings.shape == (31, 5 * 4)


def test_decoder_lm_gemma4_options_config_and_keras_file(tmp_path, rng):
    lm = _gemma4_like_lm()
    ids = rng.integers(3, 29, size=(1, 6)).astype("int32")
    want = np.asarray(lm(ids))
    again = DecoderOnlyLM.from_config(lm.get_config())
    for name in ("key_value_sources", "per_layer_input_dim", "per_layer_input_vocabulary_size",
                 "use_value_norm", "use_output_scale", "rope_scaling", "head_dim",
                 "num_key_value_heads", "intermediate_dim"):
        assert getattr(again, name) == getattr(lm, name), name
    path = str(tmp_path / "lm.keras")
    lm.save(path)
    loaded = keras.saving.load_model(path)
    np.testing.assert_array_equal(np.asarray(loaded(ids)), want)
    block = lm.blocks[3]
    copy = TransformerDecoderBlock.from_config(block.get_config())
    assert (copy.shared_key_value, copy.per_layer_input_dim, copy.use_output_scale,
            copy.use_value_norm) == (True, 4, True, True)


@pytest.mark.parametrize("changes, match", [
    (dict(key_value_sources=[None, 0]), r"`key_value_sources`, expected None or a list of one entry per layer \(5\)"),
    (dict(key_value_sources=[None, None, None, 4, None]), r"key_value_sources\[3\]"),
    (dict(key_value_sources=[None, None, None, 2, 3]), r"key_value_sources\[4\]"),
    (dict(key_value_sources=[None, 0, None, None, None]),
     r"Layer 1 reuses the keys and values of layer 0, which has another sliding window \(3 vs None\)"),
    (dict(per_layer_input_dim=None), r"`per_layer_input_vocabulary_size` needs `per_layer_input_dim`"),
    (dict(per_layer_input_dim=0), r"per_layer_input_dim"),
    (dict(head_dim=[6, 10]), r"`head_dim`, expected None, a positive int or a list of one value per "
                             r"layer \(5\). Received: head_dim=\[6, 10\]"),
    (dict(head_dim=[6, 10, 6, 6, 0]), r"`head_dim\[4\]`, expected a positive integer"),
    (dict(num_key_value_heads=[2, 1, 2, 2, 3]), r"`num_key_value_heads\[4\]`, expected a divisor of "
                                                r"num_heads=4. Received: num_key_value_heads\[4\]=3"),
    (dict(intermediate_dim=[16, 16, 16, 32]), r"`intermediate_dim`, expected a positive int or a list"),
    (dict(head_dim=[6, 10, 6, 8, 10]),
     r"Layer 3 reuses the keys and values of layer 2, which has another head size \(6 vs 8\)"),
    (dict(num_key_value_heads=[2, 1, 2, 2, 2]),
     r"Layer 4 reuses the keys and values of layer 1, which has another number of key/value "
     r"heads \(1 vs 2\)"),
])
def test_decoder_lm_gemma4_option_errors(changes, match):
    config = {**_gemma4_like_lm().get_config(), **changes}
    with pytest.raises(ValueError, match=match):
        DecoderOnlyLM.from_config(config)


def test_layout_map_checks_the_per_layer_table():
    """The per-layer input table is sharded as the token table, over its vocabulary."""
    import types

    lm = DecoderOnlyLM(30, 16, 8, num_layers=2, num_heads=2, intermediate_dim=16,
                       position="rotary", per_layer_input_dim=2, per_layer_input_vocabulary_size=31)
    mesh = types.SimpleNamespace(axis_names=("model",), shape=(2,))
    with pytest.raises(ValueError, match="`per_layer_input_vocabulary_size`=31 is not divisible by the 2"):
        lm.get_layout_map(mesh)


def test_decoder_lm_key_value_heads_per_layer_are_ints():
    config = {**_gemma4_like_lm().get_config(), "num_key_value_heads": [2, None, 2, 2, 1]}
    config.pop("name")
    with pytest.raises(TypeError, match=r"`num_key_value_heads\[1\]`, expected a positive integer\. "
                                        r"Received: num_key_value_heads\[1\]=None"):
        DecoderOnlyLM(**config)


def test_seq2seq_lm_refuses_sizes_per_layer():
    from keras_attn.generation.models import Seq2SeqLM

    with pytest.raises(ValueError, match=r"`head_dim`, expected one value for every layer \(a list "
                                         r"of one per layer is for DecoderOnlyLM\)"):
        Seq2SeqLM(30, 16, 8, num_layers=2, num_heads=2, intermediate_dim=16, head_dim=[4, 8])


def test_layout_map_checks_sizes_per_layer():
    """Each layer's feed-forward width must split over the model axis."""
    import types

    lm = DecoderOnlyLM(32, 16, 8, num_layers=2, num_heads=4, intermediate_dim=[16, 10],
                       position="rotary")
    mesh = types.SimpleNamespace(axis_names=("model",), shape=(4,))
    with pytest.raises(ValueError, match=r"`intermediate_dim`=\[16, 10\] is not divisible by the 4"):
        lm.get_layout_map(mesh)
