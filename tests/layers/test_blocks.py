"""Transformer blocks against a NumPy reference."""

import keras
import numpy as np
import pytest

from keras_attn import layers as kal
from tests import reference as ref
from tests import tolerance
from tests.model_zoo import randomize


def _ln(layer):
    return layer.gamma.numpy(), layer.beta.numpy(), layer.epsilon


def _ffn(block, x, act):
    w1 = block.feedforward_intermediate_dense
    w2 = block.feedforward_output_dense
    h = act(ref.linear(x, w1.kernel.numpy(), w1.bias.numpy()))
    return ref.linear(h, w2.kernel.numpy(), w2.bias.numpy())


def _sublayer(block, x, norm, fn):
    if block.normalize_first:
        return x + fn(ref.layer_norm(x, *_ln(norm)))
    return ref.layer_norm(x + fn(x), *_ln(norm))


def encoder_reference(block, x, mask, act, causal=False):
    heads = block.num_heads
    full = mask[:, None, None, :]
    if causal:
        full = full & ref.causal(x.shape[1])[None, None]
    attn = block.self_attention

    def self_attend(h):
        return ref.mha(h, h, h, ref.mha_weights(attn), heads, attn.num_key_value_heads, mask=full)[0]

    x = _sublayer(block, x, block.self_attention_layer_norm, self_attend)
    return _sublayer(block, x, block.feedforward_layer_norm, lambda h: _ffn(block, h, act))


@pytest.mark.parametrize("normalize_first", [False, True])
@pytest.mark.parametrize("activation, act", [("relu", ref.relu), ("gelu", ref.gelu)])
def test_encoder_block_matches_reference(rng, normalize_first, activation, act):
    block = kal.TransformerEncoderBlock(
        num_heads=2, intermediate_dim=12, activation=activation, normalize_first=normalize_first,
        num_key_value_heads=1,
    )
    x = rng.standard_normal((2, 5, 8)).astype("float32")
    mask = np.array([[1, 1, 1, 0, 0], [1] * 5], bool)
    block(x)
    randomize(block, rng)
    out = np.asarray(block(x, padding_mask=mask))
    want = encoder_reference(block, x, mask, act)
    valid = mask
    tolerance.assert_close(out[valid], want[valid], terms=tolerance.LAYER_TERMS)


@pytest.mark.parametrize("normalize_first", [False, True])
def test_decoder_block_matches_reference(rng, normalize_first):
    block = kal.TransformerDecoderBlock(num_heads=2, intermediate_dim=12, normalize_first=normalize_first)
    dec = rng.standard_normal((2, 4, 8)).astype("float32")
    enc = rng.standard_normal((2, 6, 8)).astype("float32")
    enc_mask = np.array([[1, 1, 1, 1, 0, 0], [1] * 6], bool)
    block(dec, enc)
    randomize(block, rng)
    out, scores = block(dec, enc, encoder_padding_mask=enc_mask, return_attention_scores=True)
    sa, ca = block.self_attention, block.cross_attention

    def self_attend(h):
        return ref.mha(h, h, h, ref.mha_weights(sa), 2, 2, mask=ref.causal(4)[None, None])[0]

    def cross_attend(h):
        return ref.mha(h, enc, enc, ref.mha_weights(ca), 2, 2, mask=enc_mask[:, None, None, :])[0]

    x = _sublayer(block, dec, block.self_attention_layer_norm, self_attend)
    x = _sublayer(block, x, block.cross_attention_layer_norm, cross_attend)
    want = _sublayer(block, x, block.feedforward_layer_norm, lambda h: _ffn(block, h, ref.relu))
    tolerance.assert_close(out, want, terms=tolerance.LAYER_TERMS)
    assert tuple(scores["self_attention"].shape) == (2, 2, 4, 4)
    assert tuple(scores["cross_attention"].shape) == (2, 2, 4, 6)
    np.testing.assert_array_equal(np.asarray(scores["cross_attention"])[0, :, :, 4:], 0.0)


def test_decoder_only_block_is_causal(rng):
    block = kal.TransformerDecoderBlock(num_heads=2, intermediate_dim=12)
    x = rng.standard_normal((1, 6, 8)).astype("float32")
    base = np.asarray(block(x))
    x2 = x.copy()
    x2[0, 3:] += 1.0
    tolerance.assert_close(np.asarray(block(x2))[0, :3], base[0, :3], terms=tolerance.LAYER_TERMS)
    with pytest.raises(ValueError, match="built without an `encoder_sequence`"):
        block(x, x)


def test_blocks_consume_and_propagate_keras_masks(rng):
    ids = keras.Input((None,), dtype="int32")
    emb = kal.TokenAndPositionEmbedding(30, 16, 8, mask_zero=True)
    enc_block = kal.TransformerEncoderBlock(2, intermediate_dim=16)
    h = enc_block(emb(ids))
    pooled = keras.layers.GlobalAveragePooling1D()(h)
    model = keras.Model(ids, [h, pooled])
    tokens = np.array([[4, 5, 6, 0, 0], [7, 8, 9, 10, 11]])
    out, pooled_out = (np.asarray(t) for t in model(tokens))
    want = np.stack([out[b][tokens[b] != 0].mean(0) for b in range(2)])
    tolerance.assert_close(pooled_out, want, terms=tolerance.LAYER_TERMS)
    # Same result as an explicit padding mask, and padded tokens change nothing.
    x = np.asarray(emb(tokens))
    explicit = np.asarray(enc_block(x, padding_mask=tokens != 0))
    tolerance.assert_close(explicit[tokens != 0], out[tokens != 0], terms=tolerance.LAYER_TERMS)
    tokens2 = tokens.copy()
    tokens2[0, 3:] = 0
    tolerance.assert_close(np.asarray(model(tokens2)[0])[0, :3], out[0, :3], terms=tolerance.LAYER_TERMS)


def test_block_output_specs_with_different_lengths():
    dec = keras.Input((4, 8))
    enc = keras.Input((9, 8))
    block = kal.TransformerDecoderBlock(2, intermediate_dim=16)
    out, scores = block(dec, enc, return_attention_scores=True)
    assert tuple(out.shape) == (None, 4, 8)
    assert tuple(scores["cross_attention"].shape) == (None, 2, 4, 9)
    assert block.compute_output_shape((None, 4, 8), (None, 9, 8)) == (None, 4, 8)
    enc_out, enc_scores = kal.TransformerEncoderBlock(2, intermediate_dim=16)(enc, return_attention_scores=True)
    assert tuple(enc_scores.shape) == (None, 2, 9, 9)


def _rms_norm(x, scale, eps):
    x = np.asarray(x, np.float64)
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * scale


def _silu(x):
    return x / (1.0 + np.exp(-x))


@pytest.mark.parametrize("block_cls", [kal.TransformerDecoderBlock, kal.TransformerEncoderBlock])
def test_llama_style_block_matches_reference(rng, block_cls):
    """RMSNorm, SwiGLU, rotary on grouped-query heads of a size that is not
    hidden/heads, biased q/k/v with an unbiased output (Qwen2), unbiased
    feed-forward: the switches of today's decoders, against NumPy."""
    heads, kv_heads, head_dim, hidden = 3, 1, 6, 10
    causal = block_cls is kal.TransformerDecoderBlock
    block = block_cls(
        num_heads=heads, num_key_value_heads=kv_heads, key_dim=head_dim, intermediate_dim=14,
        normalize_first=True, normalization="rms_norm", use_gated_feedforward=True,
        activation="silu", attention_use_bias=True, attention_output_use_bias=False,
        feedforward_use_bias=False, layer_norm_epsilon=1e-5,
        rotary_embedding=kal.RotaryEmbedding(max_wavelength=100),
    )
    x = rng.standard_normal((2, 7, hidden)).astype("float32")
    block(x)
    randomize(block, rng)
    attn = block.self_attention
    assert attn.output_dense.bias is None and attn.query_dense.bias is not None
    assert block.feedforward_gate_dense.bias is None
    out = np.asarray(block(x))
    w = ref.mha_weights(attn)

    def self_attend(h):
        q = np.einsum("btd,dhk->bthk", h, w["wq"]) + w["bq"]
        k = np.einsum("btd,dhk->bthk", h, w["wk"]) + w["bk"]
        v = np.einsum("btd,dhk->bthk", h, w["wv"]) + w["bv"]
        q, k = ref.rotary(q, 100.0), ref.rotary(k, 100.0)
        mask = ref.causal(7)[None, None] if causal else None
        o, _ = ref.attention(q, k, v, mask=mask)
        return np.einsum("bthk,hkd->btd", o, w["wo"])

    def ffn(h):
        gate = ref.linear(h, block.feedforward_gate_dense.kernel.numpy())
        up = ref.linear(h, block.feedforward_intermediate_dense.kernel.numpy())
        return ref.linear(_silu(gate) * up, block.feedforward_output_dense.kernel.numpy())

    eps = 1e-5
    h = x + self_attend(_rms_norm(x, block.self_attention_layer_norm.scale.numpy(), eps))
    want = h + ffn(_rms_norm(h, block.feedforward_layer_norm.scale.numpy(), eps))
    tolerance.assert_close(out, want, terms=tolerance.LAYER_TERMS)
    config = block.get_config()
    again = block_cls.from_config(config)
    again(x)
    again.set_weights(block.get_weights())
    np.testing.assert_array_equal(np.asarray(again(x)), out)
    assert [w.path.split("/")[-2] for w in block.weights].count("feedforward_gate_dense") == 1


def test_block_option_errors():
    with pytest.raises(ValueError, match="normalization"):
        kal.TransformerEncoderBlock(num_heads=2, intermediate_dim=8, normalization="batch_norm")
    with pytest.raises(TypeError, match="use_gated_feedforward"):
        kal.TransformerEncoderBlock(num_heads=2, intermediate_dim=8, use_gated_feedforward="yes")


def test_attention_maps_record_every_block_on_this_backend(rng):
    """keras_attn.visualize reads keras.ops tensors on every backend: the maps
    of a two-block functional encoder equal each block's own scores."""
    from keras_attn.visualize import attention_maps

    x_in = keras.Input((None, 8))
    h = kal.TransformerEncoderBlock(num_heads=2, intermediate_dim=12, name="b0")(x_in)
    h = kal.TransformerEncoderBlock(num_heads=2, intermediate_dim=12, name="b1",
                                    normalize_first=True)(h, use_causal_mask=True)
    model = keras.Model(x_in, h)
    x = rng.standard_normal((2, 5, 8)).astype("float32")
    maps = attention_maps(model, x)
    assert [m.name for m in maps] == ["b0/self_attention", "b1/self_attention"]
    h0, s0 = model.get_layer("b0")(x, return_attention_scores=True)
    _, s1 = model.get_layer("b1")(h0, use_causal_mask=True, return_attention_scores=True)
    np.testing.assert_array_equal(maps[0].scores, keras.ops.convert_to_numpy(s0))
    np.testing.assert_array_equal(maps[1].scores, keras.ops.convert_to_numpy(s1))
    assert np.all(maps[1].scores[:, :, np.triu(np.ones((5, 5), bool), 1)] == 0.0)
    assert maps[1].mask is not None and not maps[1].mask[0, 0, 0, 1]
