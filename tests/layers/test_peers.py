"""Bringing trained layers over from KerasHub and PyTorch: same weights, same outputs.

keras-hub and torch are in the `test` extra, so these run in CI. Runs on
every Keras backend.
"""

import keras
import numpy as np
import pytest
from keras import ops

from keras_attn import layers as kal
from tests import tolerance
from tests.model_zoo import randomize

keras_hub = pytest.importorskip("keras_hub")
torch = pytest.importorskip("torch")

C = ops.convert_to_numpy
HIDDEN, HEADS, FFN = 8, 2, 12


# --- constructor order --------------------------------------------------------


@pytest.mark.parametrize("cls", [kal.TransformerEncoderBlock, kal.TransformerDecoderBlock])
def test_keras_hub_ordered_positional_call_is_a_clear_error(cls):
    # KerasHub: TransformerEncoder(intermediate_dim=32, num_heads=4).
    with pytest.raises(TypeError, match=r"only positional argument.*intermediate_dim.*\(32, 4\)"):
        cls(32, 4)
    block = cls(4, intermediate_dim=32)
    assert (block.num_heads, block.intermediate_dim) == (4, 32)


# --- KerasHub blocks ----------------------------------------------------------


@pytest.fixture(params=[False, True], ids=["post_norm", "pre_norm"])
def normalize_first(request):
    return request.param


def test_encoder_from_keras_hub_matches(rng, normalize_first):
    hub = keras_hub.layers.TransformerEncoder(
        FFN, HEADS, activation="gelu", normalize_first=normalize_first
    )
    hub.build((None, 5, HIDDEN))
    randomize(hub, rng, scale=0.4)
    ours = kal.TransformerEncoderBlock.from_keras_hub(hub)
    x = rng.standard_normal((2, 5, HIDDEN)).astype("float32")
    tolerance.assert_close(C(ours(x)), C(hub(x)), terms=tolerance.LAYER_TERMS)
    attention_mask = rng.random((2, 5, 5)) > 0.4
    attention_mask[:, :, 0] = True
    tolerance.assert_close(C(ours(x, attention_mask=attention_mask)), C(hub(x, attention_mask=attention_mask)), terms=tolerance.LAYER_TERMS)


def test_encoder_padding_mask_differs_only_at_padded_queries(rng, normalize_first):
    hub = keras_hub.layers.TransformerEncoder(FFN, HEADS, normalize_first=normalize_first)
    hub.build((None, 5, HIDDEN))
    randomize(hub, rng, scale=0.4)
    ours = kal.TransformerEncoderBlock.from_keras_hub(hub)
    x = rng.standard_normal((2, 5, HIDDEN)).astype("float32")
    padding = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], bool)
    got = C(ours(x, padding_mask=padding))
    want = C(hub(x, padding_mask=padding))
    tolerance.assert_close(got[padding], want[padding], terms=tolerance.LAYER_TERMS)
    # Padded queries: our attention output there is zero before the output
    # projection, so the block sees only the projection's bias. Rebuilt
    # from KerasHub's own sublayers:
    pad = x[0, 3:]
    b_o = C(hub._self_attention_layer._output_dense.bias)
    ln1, ln2 = hub._self_attention_layer_norm, hub._feedforward_layer_norm
    ffn1, ffn2 = hub._feedforward_intermediate_dense, hub._feedforward_output_dense
    if normalize_first:
        h = pad + b_o
        expected = h + C(ffn2(ffn1(ln2(h))))
    else:
        h = C(ln1(pad + b_o))
        expected = C(ln2(h + C(ffn2(ffn1(h)))))
    tolerance.assert_close(got[0, 3:], expected, terms=tolerance.LAYER_TERMS)
    assert not np.allclose(got[0, 3:], want[0, 3:], atol=1e-3)


@pytest.mark.parametrize("cross", [False, True], ids=["decoder_only", "cross_attention"])
def test_decoder_from_keras_hub_matches(rng, normalize_first, cross):
    hub = keras_hub.layers.TransformerDecoder(FFN, HEADS, normalize_first=normalize_first)
    hub.build((None, 4, HIDDEN), (None, 6, 6) if cross else None)
    randomize(hub, rng, scale=0.4)
    ours = kal.TransformerDecoderBlock.from_keras_hub(hub)
    dec = rng.standard_normal((2, 4, HIDDEN)).astype("float32")
    enc = rng.standard_normal((2, 6, 6)).astype("float32") if cross else None
    tolerance.assert_close(C(ours(dec, enc)), C(hub(dec, enc)), terms=tolerance.LAYER_TERMS)
    # Masks: decoder padding (valid query rows compared), encoder padding.
    dec_pad = np.array([[1, 1, 1, 0], [1, 1, 1, 1]], bool)
    kwargs = {"decoder_padding_mask": dec_pad}
    if cross:
        kwargs["encoder_padding_mask"] = np.array([[1, 1, 1, 1, 0, 0], [1] * 6], bool)
    got, want = C(ours(dec, enc, **kwargs)), C(hub(dec, enc, **kwargs))
    tolerance.assert_close(got[dec_pad], want[dec_pad], terms=tolerance.LAYER_TERMS)


@pytest.mark.parametrize("cross", [False, True], ids=["decoder_only", "cross_attention"])
def test_keras_hub_cache_keywords_match_keras_hub(rng, cross):
    """Code written against KerasHub's cached decoder runs unchanged: prefill
    then one token per step with `self_attention_cache(_update_index)` /
    `cross_attention_cache(_update_index)`, outputs and stacked caches equal
    KerasHub's own layer with the same weights, step by step."""
    hub = keras_hub.layers.TransformerDecoder(FFN, HEADS)
    hub.build((None, 5, HIDDEN), (None, 6, HIDDEN) if cross else None)
    randomize(hub, rng, scale=0.4)
    ours = kal.TransformerDecoderBlock.from_keras_hub(hub)
    dec = rng.standard_normal((2, 5, HIDDEN)).astype("float32")
    enc = rng.standard_normal((2, 6, HIDDEN)).astype("float32") if cross else None
    empty = np.zeros((2, 2, 7, HEADS, HIDDEN // HEADS), "float32")
    empty_cross = np.zeros((2, 2, 6, HEADS, HIDDEN // HEADS), "float32")

    def run(layer):
        kwargs = {"self_attention_cache": empty, "self_attention_cache_update_index": 0}
        if cross:
            kwargs.update(cross_attention_cache=empty_cross, cross_attention_cache_update_index=0)
        out, *caches = layer(dec[:, :3], enc, **kwargs)
        steps = [C(out)]
        for i in range(3, 5):
            kwargs = {"self_attention_cache": caches[0], "self_attention_cache_update_index": i}
            if cross:
                kwargs["cross_attention_cache"] = caches[1]
            out, *caches = layer(dec[:, i:i + 1], enc, **kwargs)
            steps.append(C(out))
        return steps, [C(c) for c in caches]

    (got, got_caches), (want, want_caches) = run(ours), run(hub)
    assert len(got_caches) == len(want_caches) == (2 if cross else 1)
    for g, w in zip(got + got_caches, want + want_caches):
        tolerance.assert_close(g, w, terms=HIDDEN)
    # And the cached steps equal one uncached causal call over all 5 tokens.
    tolerance.assert_close(np.concatenate(got, axis=1), C(hub(dec, enc)), terms=HIDDEN)


def test_keras_hub_cache_keywords_are_checked(rng):
    block = kal.TransformerDecoderBlock(num_heads=HEADS, intermediate_dim=FFN)
    dec = rng.standard_normal((2, 3, HIDDEN)).astype("float32")
    enc = rng.standard_normal((2, 4, HIDDEN)).astype("float32")
    block(dec, enc)
    cache = np.zeros((2, 2, 5, HEADS, HIDDEN // HEADS), "float32")
    with pytest.raises(ValueError, match="cross_attention_cache"):
        block(dec, enc, self_attention_cache=cache, self_attention_cache_update_index=0)
    with pytest.raises(ValueError, match=r"self_attention_cache_update_index=None"):
        block(dec, enc, self_attention_cache=cache, cross_attention_cache=cache[:, :, :4])
    with pytest.raises(ValueError, match=r"shape \(batch, 2, length.*\(2, 5, 2, 4\)"):
        block(dec, enc, self_attention_cache=cache[:, 0], self_attention_cache_update_index=0,
              cross_attention_cache=cache[:, :, :4])
    with pytest.raises(ValueError, match="not both"):
        block(dec, enc, self_attention_cache=cache, self_attention_cache_update_index=0,
              cross_attention_cache=cache[:, :, :4], cache={"self_attention": None}, cache_index=0)


def test_from_keras_hub_rejects_other_layers():
    with pytest.raises(TypeError, match="keras_hub.layers.TransformerEncoder"):
        kal.TransformerEncoderBlock.from_keras_hub(keras.layers.Dense(2))
    with pytest.raises(ValueError, match="built"):
        kal.TransformerDecoderBlock.from_keras_hub(keras_hub.layers.TransformerDecoder(8, 2))


# --- torch.nn.MultiheadAttention ----------------------------------------------


def _torch_mha(rng, embed, heads, bias=True, kdim=None, vdim=None, batch_first=True):
    torch.manual_seed(0)
    module = torch.nn.MultiheadAttention(
        embed, heads, bias=bias, kdim=kdim, vdim=vdim, batch_first=batch_first
    )
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.from_numpy(rng.standard_normal(tuple(p.shape)).astype("float32") * 0.3))
    return module.eval()


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("kv_dims", [(None, None), (6, 5)], ids=["same_dims", "kdim_vdim"])
def test_from_torch_matches(rng, batch_first, bias, kv_dims):
    kdim, vdim = kv_dims
    module = _torch_mha(rng, 8, 2, bias=bias, kdim=kdim, vdim=vdim, batch_first=batch_first)
    ours = kal.MultiHeadAttention.from_torch(module)
    q = rng.standard_normal((2, 3, 8)).astype("float32")
    k = rng.standard_normal((2, 5, kdim or 8)).astype("float32")
    v = rng.standard_normal((2, 5, vdim or 8)).astype("float32")
    # Masks: torch's True = masked, ours True = attend.
    key_padding = np.array([[0, 0, 0, 1, 1], [0] * 5], bool)

    def torch_call(**kwargs):
        args = [torch.from_numpy(a) for a in (q, k, v)]
        if not batch_first:
            args = [a.transpose(0, 1) for a in args]
        out, weights = module(*args, need_weights=True, average_attn_weights=False, **kwargs)
        out = out if batch_first else out.transpose(0, 1)
        return out.detach().numpy(), weights.detach().numpy()

    want, want_w = torch_call(key_padding_mask=torch.from_numpy(key_padding))
    # Torch order (query, key, value) is ours (query, value, key).
    got, got_w = ours(q, v, k, value_mask=~key_padding, return_attention_scores=True)
    tolerance.assert_close(C(got), want, terms=tolerance.LAYER_TERMS)
    tolerance.assert_close(C(got_w), want_w, terms=tolerance.LAYER_TERMS)


def test_from_torch_rejects_unsupported():
    with pytest.raises(TypeError, match="torch.nn.MultiheadAttention"):
        kal.MultiHeadAttention.from_torch(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="add_bias_kv"):
        kal.MultiHeadAttention.from_torch(torch.nn.MultiheadAttention(8, 2, add_bias_kv=True))
    with pytest.raises(ValueError, match="num_heads"):
        kal.MultiHeadAttention.from_torch(torch.nn.MultiheadAttention(8, 2), num_heads=4)
