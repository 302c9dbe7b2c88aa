"""Layer features for pretrained models: token types and embedding LayerNorm,
the reversible (tied) embedding, key-only padding in the blocks, and the
DecoderOnlyLM options (activation, epsilon, tied head)."""

import keras
import numpy as np
import pytest

from keras_attn.generation import greedy_search
from keras_attn.generation.models import DecoderOnlyLM, Seq2SeqLM
from keras_attn.layers import (
    ReversibleEmbedding,
    TokenAndPositionEmbedding,
    TransformerDecoderBlock,
    TransformerEncoderBlock,
)
from tests import tolerance


def np_layer_norm(x, gamma, beta, eps):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * gamma + beta


def bert_embedding():
    return TokenAndPositionEmbedding(
        30, 12, 8, position="learned", type_vocabulary_size=3,
        use_layer_norm=True, layer_norm_epsilon=1e-12, mask_zero=True,
        embeddings_initializer=keras.initializers.RandomNormal(stddev=1.0),
    )


def test_token_types_and_layer_norm_match_numpy():
    layer = bert_embedding()
    ids = np.array([[5, 3, 9, 0], [1, 2, 3, 4]])
    types = np.array([[0, 1, 2, 0], [1, 1, 0, 0]])
    got = np.asarray(layer(ids, token_type_ids=types))
    layer.layer_norm.gamma.assign(np.linspace(0.5, 2, 8))
    layer.layer_norm.beta.assign(np.linspace(-1, 1, 8))
    got = np.asarray(layer(ids, token_type_ids=types))
    tok = np.asarray(layer.token_embedding.embeddings)
    pos = np.asarray(layer.position_embedding.position_embeddings)
    typ = np.asarray(layer.token_type_embedding.embeddings)
    summed = tok[ids] + pos[None, :4] + typ[types]
    want = np_layer_norm(summed, np.linspace(0.5, 2, 8), np.linspace(-1, 1, 8), 1e-12)
    tolerance.assert_close(got, want, terms=tolerance.LAYER_TERMS)
    # Default token types are 0; the mask still comes from id 0.
    np.testing.assert_allclose(
        np.asarray(layer(ids)), np.asarray(layer(ids, token_type_ids=np.zeros_like(ids))), atol=0
    )
    np.testing.assert_array_equal(np.asarray(layer.compute_mask(ids)), ids != 0)


def test_token_type_arguments_are_checked():
    with pytest.raises(ValueError, match="type_vocabulary_size"):
        TokenAndPositionEmbedding(10, 4, 8, type_vocabulary_size=0)
    with pytest.raises(TypeError, match="use_layer_norm"):
        TokenAndPositionEmbedding(10, 4, 8, use_layer_norm="yes")
    plain = TokenAndPositionEmbedding(10, 4, 8)
    with pytest.raises(ValueError, match="token_type_ids.*type_vocabulary_size"):
        plain(np.array([[1, 2]]), token_type_ids=np.array([[0, 0]]))
    with pytest.raises(ValueError, match="shape of `inputs`"):
        bert_embedding()(np.array([[1, 2]]), token_type_ids=np.array([[0, 0, 0]]))


def test_tied_head_through_token_and_position_embedding(tmp_path):
    layer = bert_embedding()
    ids = keras.Input((None,), dtype="int32")
    h = layer(ids)
    logits = layer(h, reverse=True)
    assert tuple(logits.shape) == (None, None, 30)
    model = keras.Model(ids, logits)
    feed = np.array([[4, 5, 6, 0]])
    hidden = np.asarray(layer(feed))
    table = np.asarray(layer.token_embedding.embeddings)
    tolerance.assert_close(np.asarray(model(feed)), hidden @ table.T, terms=tolerance.LAYER_TERMS)
    model.save(tmp_path / "tied.keras")
    loaded = keras.saving.load_model(tmp_path / "tied.keras")
    np.testing.assert_array_equal(np.asarray(loaded(feed)), np.asarray(model(feed)))


def test_token_type_embedding_serializes_in_a_functional_model(tmp_path):
    ids = keras.Input((None,), dtype="int32", name="ids")
    types = keras.Input((None,), dtype="int32", name="types")
    x = bert_embedding()(ids, token_type_ids=types)
    y = TransformerEncoderBlock(num_heads=2, intermediate_dim=16, mask_padded_queries=False)(x)
    model = keras.Model([ids, types], y)
    feed = [np.array([[4, 5, 6, 0]]), np.array([[0, 1, 1, 0]])]
    model.save(tmp_path / "m.keras")
    loaded = keras.saving.load_model(tmp_path / "m.keras")
    np.testing.assert_array_equal(np.asarray(loaded(feed)), np.asarray(model(feed)))
    layer = model.layers[2]
    assert TokenAndPositionEmbedding.from_config(layer.get_config()).get_config() == layer.get_config()


def test_reversible_embedding_reverse_is_the_transposed_table(tmp_path):
    emb = ReversibleEmbedding(20, 6)
    h = emb(np.array([[1, 2, 3]]))
    np.testing.assert_array_equal(np.asarray(h), np.asarray(emb.embeddings)[[[1, 2, 3]]])
    hidden = np.random.default_rng(0).standard_normal((2, 5, 6)).astype("float32")
    got = np.asarray(emb(hidden, reverse=True))
    tolerance.assert_close(got, hidden @ np.asarray(emb.embeddings).T, terms=tolerance.LAYER_TERMS)
    assert emb.compute_output_shape((2, 5, 6), reverse=True) == (2, 5, 20)
    assert len(emb.weights) == 1  # tied: no extra kernel, no bias
    with pytest.raises(ValueError, match="6 features"):
        emb(np.zeros((1, 2, 4), "float32"), reverse=True)
    # Hidden states keep their mask; ids give one with mask_zero.
    masked = ReversibleEmbedding(20, 6, mask_zero=True)
    ids_mask = np.array([[True, False]])
    np.testing.assert_array_equal(np.asarray(masked.compute_mask(np.array([[3, 0]]))), ids_mask)
    assert masked.compute_mask(hidden, mask=ids_mask) is ids_mask
    # In a functional model, and through .keras.
    ids = keras.Input((None,), dtype="int32")
    shared = ReversibleEmbedding(20, 6, name="shared")
    model = keras.Model(ids, shared(shared(ids), reverse=True))
    model.save(tmp_path / "r.keras")
    loaded = keras.saving.load_model(tmp_path / "r.keras")
    feed = np.array([[1, 7, 3]])
    np.testing.assert_array_equal(np.asarray(loaded(feed)), np.asarray(model(feed)))


@pytest.mark.parametrize("normalize_first", [False, True])
def test_key_only_padding_matches_numpy_at_every_position(normalize_first):
    """Padded rows computed (not zeroed), checked against the NumPy block of
    tests/layers/test_blocks.py, whose padding masks keys only."""
    from tests import reference as ref
    from tests.layers.test_blocks import encoder_reference

    rng = np.random.default_rng(5)
    block = TransformerEncoderBlock(
        num_heads=2, intermediate_dim=12, activation="gelu", normalize_first=normalize_first,
        mask_padded_queries=False,
    )
    x = rng.standard_normal((2, 5, 8)).astype("float32")
    mask = np.array([[1, 1, 1, 0, 0], [1] * 5], bool)
    block(x)
    block.set_weights([rng.standard_normal(w.shape).astype("float32") * 0.3 for w in block.weights])
    got = np.asarray(block(x, padding_mask=mask))
    tolerance.assert_close(got, encoder_reference(block, x, mask, ref.gelu), terms=tolerance.LAYER_TERMS)


@pytest.fixture(scope="module")
def keras_hub():
    return pytest.importorskip("keras_hub")


def test_key_only_padding_matches_keras_hub_encoder_everywhere(keras_hub):
    """KerasHub masks keys only: padded rows are computed, not zeroed."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 6, 8)).astype("float32")
    mask = np.array([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]], bool)
    ours = TransformerEncoderBlock(
        num_heads=2, intermediate_dim=16, activation="gelu", mask_padded_queries=False
    )
    ours(x)
    hub = keras_hub.layers.TransformerEncoder(intermediate_dim=16, num_heads=2, activation="gelu")
    hub(x)
    assert [w.shape for w in hub.weights] == [w.shape for w in ours.weights]
    weights = [rng.standard_normal(w.shape).astype("float32") * 0.5 for w in ours.weights]
    ours.set_weights(weights)
    hub.set_weights(weights)
    want = np.asarray(hub(x, padding_mask=mask))
    tolerance.assert_close(np.asarray(ours(x, padding_mask=mask)), want, terms=tolerance.LAYER_TERMS)
    # The default zeroes the attention of padded rows: valid rows unchanged, padded ones differ.
    default = TransformerEncoderBlock.from_config(
        {**ours.get_config(), "mask_padded_queries": True}
    )
    default(x)
    default.set_weights(weights)
    got = np.asarray(default(x, padding_mask=mask))
    tolerance.assert_close(got[mask], want[mask], terms=tolerance.LAYER_TERMS)
    assert np.max(np.abs(got[~mask] - want[~mask])) > 1e-3


def test_key_only_padding_in_the_decoder_block():
    """Equivalent to an explicit `(B, 1, T)` key mask (the GPT-2 parity tests
    of tests/convert/test_convert.py check it against Hugging Face)."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 5, 8)).astype("float32")
    mask = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], bool)
    ours = TransformerDecoderBlock(
        num_heads=2, intermediate_dim=16, normalize_first=True, mask_padded_queries=False
    )
    want = np.asarray(ours(x, decoder_attention_mask=mask[:, None, :]))
    got = np.asarray(ours(x, decoder_padding_mask=mask))
    tolerance.assert_close(got, want, terms=tolerance.LAYER_TERMS)
    zeroing = TransformerDecoderBlock.from_config({**ours.get_config(), "mask_padded_queries": True})
    zeroing(x)
    zeroing.set_weights(ours.get_weights())
    other = np.asarray(zeroing(x, decoder_padding_mask=mask))
    tolerance.assert_close(other[mask], want[mask], terms=tolerance.LAYER_TERMS)
    assert np.max(np.abs(other[~mask] - want[~mask])) > 1e-3
    config = ours.get_config()
    assert config["mask_padded_queries"] is False
    assert TransformerDecoderBlock.from_config(config).get_config() == config
    with pytest.raises(TypeError, match="mask_padded_queries"):
        TransformerEncoderBlock(num_heads=2, intermediate_dim=8, mask_padded_queries=0)


def test_decoder_only_lm_options(tmp_path):
    lm = DecoderOnlyLM(
        40, 16, 16, num_layers=2, num_heads=2, intermediate_dim=32, position="learned",
        activation="gelu_new", layer_norm_epsilon=1e-6, tie_embeddings=True,
        mask_padded_queries=False,
    )
    ids = np.array([[3, 4, 5, 6]])
    logits = np.asarray(lm(ids))
    assert lm.lm_head is None
    assert not [w for w in lm.weights if "lm_head" in w.path]
    assert lm.final_norm.epsilon == 1e-6
    assert all(b.activation == "gelu_new" and b.layer_norm_epsilon == 1e-6 for b in lm.blocks)
    # Tied head: the logits are the final hidden states times the token table, no bias.
    hidden = []
    x = lm.embedding(ids)
    for block in lm.blocks:
        x = block(x)
    hidden = np.asarray(lm.final_norm(x))
    table = np.asarray(lm.embedding.token_embedding.embeddings)
    tolerance.assert_close(logits, hidden @ table.T, terms=tolerance.LAYER_TERMS)
    # Cached decoding agrees with the full forward pass.
    cache = lm.init_cache(1, 8)
    step, _ = lm.call_with_cache(ids, cache, 0)
    tolerance.assert_close(np.asarray(step), logits, terms=tolerance.LAYER_TERMS)
    tokens = np.asarray(greedy_search(lm, ids, max_length=8))
    assert tokens.shape == (1, 8)
    # Serialization.
    config = lm.get_config()
    clone = DecoderOnlyLM.from_config(config)
    assert clone.get_config() == config
    lm.save(tmp_path / "lm.keras")
    loaded = keras.saving.load_model(tmp_path / "lm.keras")
    np.testing.assert_array_equal(np.asarray(loaded(ids)), logits)
    with pytest.raises(ValueError, match="activation"):
        DecoderOnlyLM(40, 16, 16, num_layers=1, num_heads=2, intermediate_dim=8, activation="nope")


def test_seq2seq_lm_tied_head():
    lm = Seq2SeqLM(
        30, 12, 16, num_layers=1, num_heads=2, intermediate_dim=16, position="rotary",
        activation="silu", tie_embeddings=True,
    )
    enc = np.array([[3, 4, 5, 0]])
    dec = np.array([[1, 6, 7]])
    logits = np.asarray(lm((enc, dec)))
    assert lm.lm_head is None and not [w for w in lm.weights if "lm_head" in w.path]
    encoded, mask = lm.encode(enc)
    x = lm.decoder_embedding(dec)
    for block in lm.blocks:
        x = block(x, encoded, encoder_padding_mask=mask)
    hidden = np.asarray(lm.final_norm(x))
    tolerance.assert_close(logits, hidden @ np.asarray(lm.decoder_embedding.embeddings).T, terms=tolerance.LAYER_TERMS)
    assert Seq2SeqLM.from_config(lm.get_config()).get_config() == lm.get_config()


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_low_precision_and_empty_batches(policy):
    keras.mixed_precision.set_global_policy(policy)
    layer = bert_embedding()
    ids = np.array([[5, 3, 9, 0]])
    h = layer(ids, token_type_ids=np.array([[0, 1, 1, 0]]))
    logits = layer(h, reverse=True)
    assert keras.backend.standardize_dtype(logits.dtype) == policy.split("_")[1]
    assert np.all(np.isfinite(np.asarray(keras.ops.cast(logits, "float32"))))
    keras.mixed_precision.set_global_policy("float32")
    empty = np.zeros((0, 4), "int32")
    out = bert_embedding()(empty, token_type_ids=empty)
    assert tuple(out.shape) == (0, 4, 8)
    assert tuple(ReversibleEmbedding(10, 8)(np.asarray(out), reverse=True).shape) == (0, 4, 10)
