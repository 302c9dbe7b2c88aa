"""The layer options that the Qwen3, Gemma 2/3, SmolLM3 and Phi-3 families
need, usable from scratch, each against NumPy written here: logit
soft-capping on every kernel, RMSNorm of query and key heads, sandwich
norms, partial rotary and LongRoPE, and `DecoderOnlyLM`'s per-layer
windows, rotary bases and rotary-free layers; ModernBERT's encoder block
without an attention norm or norm biases. Plus their configs and the
errors naming a bad argument."""

import math

import keras
import numpy as np
import pytest

import keras_attn
from keras_attn.generation.models import DecoderOnlyLM
from keras_attn.layers import MultiHeadAttention
from keras_attn.layers import RotaryEmbedding
from keras_attn.layers import TransformerDecoderBlock
from keras_attn.layers import TransformerEncoderBlock
from keras_attn.ops import dot_product_attention
from keras_attn.ops import last_kernel
from tests import reference
from tests import tolerance


def np_soft_cap(x, cap):
    return cap * np.tanh(x / cap)


def np_attention(q, k, v, mask, cap=None):
    """float64 attention with grouped heads and an optional soft cap
    applied to the scaled logits before the mask."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    groups = q.shape[2] // k.shape[2]
    k, v = np.repeat(k, groups, axis=2), np.repeat(v, groups, axis=2)
    logits = np.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
    if cap is not None:
        logits = np_soft_cap(logits, cap)
    logits = np.where(mask, logits, -np.inf)
    probs = reference.softmax(logits)
    return np.einsum("bhqk,bkhd->bqhd", probs, v)


def np_rms(x, scale, eps):
    x = np.asarray(x, np.float64)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def np_rotary(x, inv_freq, start=0, rotary_dim=None, factor=1.0):
    """Rotates the first `rotary_dim` features of `x` (B, T, H, D)."""
    rotary_dim = x.shape[-1] if rotary_dim is None else rotary_dim
    rotated = reference.rotary(x[..., :rotary_dim], start=start, inv_freq=inv_freq) * factor
    return np.concatenate([rotated, np.asarray(x[..., rotary_dim:], np.float64)], axis=-1)


def inv_freq(dim, base):
    return base ** (-np.arange(0, dim, 2) / dim)


# ---------------------------------------------------------------------------
# Soft-capping


def _kernels():
    names = ["reference", "auto", "blocked", "keras"]
    if keras.backend.backend() == "tensorflow":
        names.append("tf_cpu")
    return names


@pytest.mark.parametrize("implementation", _kernels())
def test_soft_cap_on_every_kernel_matches_numpy(rng, implementation):
    """Logits of order 10 under a cap of 3: the cap changes the result, and
    every setting computes it (blocked and keras hand capped calls to a
    kernel that forms the logits)."""
    q = rng.standard_normal((2, 5, 4, 8)).astype("float32") * 3
    k = rng.standard_normal((2, 7, 2, 8)).astype("float32") * 3
    v = rng.standard_normal((2, 7, 2, 8)).astype("float32")
    padding = np.ones((2, 7), bool)
    padding[1, 5:] = False
    mask = padding[:, None, None, :] & reference.causal(5, 7, offset=2)[None, None]
    with keras_attn.config.attention_implementation(implementation):
        got = dot_product_attention(q, k, v, key_padding_mask=padding, is_causal=True,
                                    start_index=2, logit_soft_cap=3.0)
        ran = last_kernel()
    assert ran in ("reference", "tf_cpu")
    want = np_attention(q, k, v, mask, cap=3.0)
    tolerance.assert_close(got, want, terms=8)
    uncapped = np_attention(q, k, v, mask)
    assert np.abs(uncapped - want).max() > 0.1, "the cap must matter at these sizes"


def test_soft_cap_refuses_explicit_blocks_and_bad_values():
    q = np.zeros((1, 4, 2, 4), "float32")
    with pytest.raises(ValueError, match="chunk_size.*logit_soft_cap"):
        dot_product_attention(q, q, q, chunk_size=2, logit_soft_cap=5.0)
    with pytest.raises(ValueError, match="logit_soft_cap=-1"):
        dot_product_attention(q, q, q, logit_soft_cap=-1)
    with pytest.raises(ValueError, match="logit_soft_cap=0"):
        MultiHeadAttention(2, 4, logit_soft_cap=0)
    with pytest.raises(ValueError, match="logit_soft_cap"):
        MultiHeadAttention(2, 4, logit_soft_cap=5.0, flash_attention=True)


# ---------------------------------------------------------------------------
# MultiHeadAttention: QK-norm and soft cap


def _set_random(layer, rng, scale=1.0):
    for w in layer.weights:
        w.assign(rng.standard_normal(tuple(w.shape)).astype("float32") * scale)


def test_mha_qk_norm_rotary_and_cap_match_numpy(rng):
    mha = MultiHeadAttention(
        4, 6, num_key_value_heads=2, use_qk_norm=True, qk_norm_epsilon=1e-5,
        logit_soft_cap=4.0, rotary_embedding=RotaryEmbedding(100.0),
    )
    x = rng.standard_normal((2, 5, 12)).astype("float32")
    mha(x, x)
    _set_random(mha, rng, 0.5)
    got = mha(x, x, use_causal_mask=True)

    def project(dense):
        out = np.einsum("btd,dhk->bthk", x, dense.kernel.numpy())
        return out + dense.bias.numpy()

    q = np_rms(project(mha.query_dense), mha.query_norm.scale.numpy(), 1e-5)
    k = np_rms(project(mha.key_dense), mha.key_norm.scale.numpy(), 1e-5)
    q, k = np_rotary(q, inv_freq(6, 100.0)), np_rotary(k, inv_freq(6, 100.0))
    v = project(mha.value_dense)
    out = np_attention(q, k, v, reference.causal(5)[None, None], cap=4.0)
    want = np.einsum("bthk,hkd->btd", out, mha.output_dense.kernel.numpy()) + mha.output_dense.bias.numpy()
    tolerance.assert_close(got, want, terms=64)


def test_mha_qk_norm_cached_equals_uncached(rng):
    mha = MultiHeadAttention(2, 4, use_qk_norm=True, rotary_embedding=RotaryEmbedding())
    x = rng.standard_normal((1, 6, 8)).astype("float32")
    full = mha(x, x, use_causal_mask=True)
    cache = (np.zeros((1, 6, 2, 4), "float32"),) * 2
    first, cache = mha(x[:, :4], x[:, :4], use_causal_mask=True, cache=cache, cache_index=0)
    rest, _ = mha(x[:, 4:], x[:, 4:], use_causal_mask=True, cache=cache, cache_index=4)
    tolerance.assert_close(np.concatenate([first, rest], axis=1), full, terms=64)


def test_mha_new_options_config_and_saving(tmp_path, rng):
    mha = MultiHeadAttention(2, 4, use_qk_norm=True, qk_norm_epsilon=1e-5, logit_soft_cap=7.0)
    config = mha.get_config()
    assert (config["use_qk_norm"], config["qk_norm_epsilon"], config["logit_soft_cap"]) == (True, 1e-5, 7.0)
    x = rng.standard_normal((1, 3, 8)).astype("float32")
    inp = keras.Input((3, 8))
    model = keras.Model(inp, mha(inp, inp))
    path = str(tmp_path / "m.keras")
    model.save(path)
    again = keras.saving.load_model(path)
    np.testing.assert_allclose(again(x), model(x), rtol=0, atol=0)
    with pytest.raises(TypeError, match="use_qk_norm='yes'"):
        MultiHeadAttention(2, 4, use_qk_norm="yes")


# ---------------------------------------------------------------------------
# Blocks: sandwich norms


def test_decoder_block_sandwich_norms_match_numpy(rng):
    block = TransformerDecoderBlock(
        num_heads=2, intermediate_dim=10, normalize_first=True, normalization="rms_norm",
        use_sandwich_norm=True, use_qk_norm=True, logit_soft_cap=3.0, layer_norm_epsilon=1e-5,
    )
    x = rng.standard_normal((2, 5, 8)).astype("float32")
    block(x)
    _set_random(block, rng, 0.7)
    got = block(x)
    eps = 1e-5

    want = np_block(block, x, eps, reference.causal(5)[None, None], cap=3.0)
    tolerance.assert_close(got, want, terms=2 * 64)


def _dense(layer, h):
    out = np.einsum("btd,d...->bt...", h, layer.kernel.numpy())
    return out if layer.bias is None else out + layer.bias.numpy()


def np_block(block, x, eps, mask, cap=None, freqs=None):
    """A pre-norm RMSNorm decoder block with sandwich norms, QK-norm (when
    the block has them) and a ReLU feed-forward; rotary with `freqs`."""
    a = block.self_attention

    def post(norm, h):
        return h if norm is None else np_rms(h, norm.scale.numpy(), eps)

    h = np_rms(x, block.self_attention_layer_norm.scale.numpy(), eps)
    q, k = _dense(a.query_dense, h), _dense(a.key_dense, h)
    if a.query_norm is not None:
        q, k = np_rms(q, a.query_norm.scale.numpy(), eps), np_rms(k, a.key_norm.scale.numpy(), eps)
    if freqs is not None:
        q, k = np_rotary(q, freqs), np_rotary(k, freqs)
    out = np_attention(q, k, _dense(a.value_dense, h), mask, cap=cap)
    out = np.einsum("bthk,hkd->btd", out, a.output_dense.kernel.numpy()) + a.output_dense.bias.numpy()
    x1 = x + post(block.self_attention_post_norm, out)
    h = np_rms(x1, block.feedforward_layer_norm.scale.numpy(), eps)
    h = _dense(block.feedforward_output_dense, np.maximum(_dense(block.feedforward_intermediate_dense, h), 0.0))
    return x1 + post(block.feedforward_post_norm, h)


def test_sandwich_norm_config_and_errors():
    block = TransformerDecoderBlock(num_heads=2, intermediate_dim=8, normalize_first=True,
                                    use_sandwich_norm=True, use_qk_norm=True, logit_soft_cap=2.0)
    again = TransformerDecoderBlock.from_config(block.get_config())
    assert (again.use_sandwich_norm, again.use_qk_norm, again.logit_soft_cap) == (True, True, 2.0)
    with pytest.raises(ValueError, match="use_sandwich_norm.*normalize_first=False"):
        TransformerDecoderBlock(num_heads=2, intermediate_dim=8, use_sandwich_norm=True)


# ---------------------------------------------------------------------------
# RotaryEmbedding: partial rotary and LongRoPE


def test_partial_rotary_matches_numpy(rng):
    x = rng.standard_normal((2, 6, 3, 16)).astype("float32")
    got = RotaryEmbedding(500.0, partial_rotary_factor=0.75)(x, start_index=3)
    want = np_rotary(x, inv_freq(12, 500.0), start=3, rotary_dim=12)
    tolerance.assert_close(got, want, scale=10 * np.abs(x).max())
    np.testing.assert_array_equal(np.asarray(got)[..., 12:], x[..., 12:])


@pytest.mark.parametrize("length, long", [(4, False), (9, True)])
def test_longrope_matches_numpy(rng, length, long):
    """Short factors while the call's last position is within the original
    length (8), long ones past it; cos and sin scaled by the attention factor."""
    short, long_factors = [1.0, 2.0, 3.0], [4.0, 5.0, 6.0]
    scaling = dict(rope_type="longrope", short_factor=short, long_factor=long_factors,
                   original_max_position_embeddings=8, attention_factor=1.2)
    x = rng.standard_normal((1, length, 2, 8)).astype("float32")
    got = RotaryEmbedding(1000.0, rope_scaling=scaling, partial_rotary_factor=0.75)(x)
    factors = np.array(long_factors if long else short)
    want = np_rotary(x, inv_freq(6, 1000.0) / factors, rotary_dim=6, factor=1.2)
    tolerance.assert_close(got, want, scale=10 * np.abs(x).max())


def test_rotary_new_options_config_and_errors():
    scaling = dict(rope_type="longrope", short_factor=[1.0, 2.0], long_factor=[3.0, 4.0],
                   original_max_position_embeddings=8, attention_factor=1.1)
    rope = RotaryEmbedding(rope_scaling=scaling, partial_rotary_factor=0.5)
    again = RotaryEmbedding.from_config(rope.get_config())
    assert again.rope_scaling == rope.rope_scaling and again.partial_rotary_factor == 0.5
    with pytest.raises(ValueError, match="partial_rotary_factor=1.5"):
        RotaryEmbedding(partial_rotary_factor=1.5)
    with pytest.raises(ValueError, match="short_factor"):
        RotaryEmbedding(rope_scaling=dict(rope_type="longrope", long_factor=[1.0],
                                          original_max_position_embeddings=8))
    with pytest.raises(ValueError, match="one number per rotated feature pair"):
        rope(np.zeros((1, 2, 1, 16), "float32"))  # 8 rotated features: 4 pairs, not 2
    with pytest.raises(ValueError, match="rotates 3 features"):
        RotaryEmbedding(partial_rotary_factor=0.5)(np.zeros((1, 2, 1, 6), "float32"))


# ---------------------------------------------------------------------------
# DecoderOnlyLM: a window, a rotary base and rotary itself per layer


def _per_layer_lm():
    return DecoderOnlyLM(
        23, 16, 12, num_layers=3, num_heads=4, num_key_value_heads=2, head_dim=6,
        intermediate_dim=16, position="rotary", normalization="rms_norm",
        layer_norm_epsilon=1e-5, activation="relu", tie_embeddings=True,
        sliding_window=[3, None, 3], rope_max_wavelength=1000.0, local_rope_max_wavelength=20.0,
        rotary_layers=[True, True, False], use_qk_norm=True, use_sandwich_norm=True,
        attention_logit_soft_cap=4.0, final_logit_soft_cap=2.0,
    )


@pytest.mark.tensorflow_only  # keras_attn.generation is TensorFlow's (docs/architecture.md)
def test_decoder_lm_per_layer_options_match_numpy(rng):
    """Layer 0: window 3, local base 20; layer 1: full, base 1000; layer 2:
    window 3, no rotary; soft caps on the attention and final logits."""
    lm = _per_layer_lm()
    ids = rng.integers(0, 23, size=(2, 7)).astype("int32")
    lm(ids)
    _set_random(lm, rng, 0.8)
    got = np.asarray(lm(ids))
    t = np.arange(7)
    causal = t[None, :] <= t[:, None]
    window = causal & (t[:, None] - t[None, :] < 3)
    table = lm.embedding.embeddings.numpy()
    x = table[ids].astype(np.float64)
    layers = [(window, inv_freq(6, 20.0)), (causal, inv_freq(6, 1000.0)), (window, None)]
    for block, (mask, freqs) in zip(lm.blocks, layers):
        x = np_block(block, x, 1e-5, mask[None, None], cap=4.0, freqs=freqs)
    x = np_rms(x, lm.final_norm.scale.numpy(), 1e-5)
    want = np_soft_cap(x @ table.T, 2.0)
    tolerance.assert_close(got, want, terms=3 * 64)
    assert np.abs(x @ table.T).max() > 3.0, "the final cap must matter"


@pytest.mark.tensorflow_only  # keras_attn.generation is TensorFlow's (docs/architecture.md)
def test_decoder_lm_per_layer_caches_and_cached_decoding(rng):
    """Windowed layers get ring caches, the full layer a cache of max_length;
    cached decoding past the window equals the full computation."""
    lm = _per_layer_lm()
    ids = rng.integers(0, 23, size=(1, 8)).astype("int32")
    full = np.asarray(lm(ids))
    cache = lm.init_cache(1, 8)
    assert [c["self_attention"][0].shape[1] for c in cache] == [3, 8, 3]
    logits, cache = lm.call_with_cache(ids[:, :3], cache, 0)
    steps = [np.asarray(logits)]
    for i in range(3, 8):
        logits, cache = lm.call_with_cache(ids[:, i:i + 1], cache, i)
        steps.append(np.asarray(logits))
    tolerance.assert_close(np.concatenate(steps, axis=1), full, terms=3 * 64)


def test_decoder_lm_per_layer_config_and_errors():
    lm = _per_layer_lm()
    again = DecoderOnlyLM.from_config(lm.get_config())
    for name in ("sliding_window", "rotary_layers", "local_rope_max_wavelength", "use_qk_norm",
                 "use_sandwich_norm", "attention_logit_soft_cap", "final_logit_soft_cap"):
        assert getattr(again, name) == getattr(lm, name), name
    kwargs = dict(vocabulary_size=10, sequence_length=8, hidden_dim=8, num_layers=2,
                  num_heads=2, intermediate_dim=8, position="rotary")
    with pytest.raises(ValueError, match="sliding_window.*one value per layer"):
        DecoderOnlyLM(**kwargs, sliding_window=[3])
    with pytest.raises(ValueError, match=r"sliding_window\[1\]"):
        DecoderOnlyLM(**kwargs, sliding_window=[3, 0])
    with pytest.raises(ValueError, match="rotary_layers=True"):
        DecoderOnlyLM(**kwargs, rotary_layers=True)
    with pytest.raises(ValueError, match="final_logit_soft_cap"):
        DecoderOnlyLM(**kwargs, final_logit_soft_cap=-2.0)
    with pytest.raises(ValueError, match="position='rotary'"):
        DecoderOnlyLM(**dict(kwargs, position="learned"), local_rope_max_wavelength=10.0)


def test_caches_of_different_lengths_are_not_stacked():
    """The runtimes' one-tensor cache layout needs one length for every layer."""
    from keras_attn.generation import cache as cache_lib

    caches = _per_layer_lm().init_cache(1, 8)
    with pytest.raises(ValueError, match=r"cache lengths per layer: \[3, 8, 3\]"):
        cache_lib.stack_cache(caches)


# ---------------------------------------------------------------------------
# Encoder block: LayerNorms without bias, no attention norm (ModernBERT)


def test_encoder_block_without_attention_norm_or_norm_bias_matches_numpy(rng):
    block = TransformerEncoderBlock(
        num_heads=2, intermediate_dim=10, normalize_first=True, layer_norm_use_bias=False,
        use_self_attention_norm=False,
    )
    x = rng.standard_normal((2, 5, 8)).astype("float32")
    block(x)
    assert block.self_attention_layer_norm is None and block.feedforward_layer_norm.beta is None
    _set_random(block, rng, 0.7)
    got = block(x)
    x1 = x + reference.mha(x, x, x, reference.mha_weights(block.self_attention), 2, 2)[0]
    norm = block.feedforward_layer_norm
    h = reference.layer_norm(x1, norm.gamma.numpy(), 0.0, norm.epsilon)
    h = _dense(block.feedforward_output_dense, np.maximum(_dense(block.feedforward_intermediate_dense, h), 0.0))
    tolerance.assert_close(got, x1 + h, terms=2 * 64)


def test_encoder_block_norm_options_config_and_errors():
    block = TransformerEncoderBlock(num_heads=2, intermediate_dim=8, normalize_first=True,
                                    layer_norm_use_bias=False, use_self_attention_norm=False)
    again = TransformerEncoderBlock.from_config(block.get_config())
    assert (again.layer_norm_use_bias, again.use_self_attention_norm) == (False, False)
    with pytest.raises(ValueError, match="use_self_attention_norm=False, normalize_first=False"):
        TransformerEncoderBlock(num_heads=2, intermediate_dim=8, use_self_attention_norm=False)
    with pytest.raises((ValueError, TypeError), match="layer_norm_use_bias"):
        TransformerEncoderBlock(num_heads=2, intermediate_dim=8, layer_norm_use_bias="no")
