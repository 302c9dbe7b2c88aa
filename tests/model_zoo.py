"""Small functional models, one per public layer, shared by tests (and exporters' tests)."""

import keras
import numpy as np

from keras_attn import layers as kal

VOCAB = 40
DIM = 16


def _ids(name="tokens"):
    return keras.Input((None,), dtype="int32", name=name)


def _features(name="features", dim=DIM):
    return keras.Input((None, dim), name=name)


def dot_product_attention():
    x = _features()
    return keras.Model(x, kal.DotProductAttention()(x, x, use_causal_mask=True), name="dot_product_attention")


def additive_attention():
    q = _features("query")
    v = _features("value", 12)
    return keras.Model([q, v], kal.AdditiveAttention(8)(q, v), name="additive_attention")


def multi_head_attention():
    x = _features()
    y = kal.MultiHeadAttention(4, 4, num_key_value_heads=2)(x, x, use_causal_mask=True)
    return keras.Model(x, y, name="multi_head_attention")


def cross_attention():
    q = _features("query")
    v = _features("memory", 12)
    return keras.Model([q, v], kal.MultiHeadAttention(2, 8)(q, v), name="cross_attention")


def sinusoidal_position_encoding():
    x = _features()
    return keras.Model(x, x + kal.SinusoidalPositionEncoding()(x), name="sinusoidal_position_encoding")


def learned_position_embedding():
    x = _features()
    return keras.Model(x, x + kal.LearnedPositionEmbedding(32)(x), name="learned_position_embedding")


def rotary_embedding():
    x = _features()
    rope = kal.RotaryEmbedding()
    y = kal.MultiHeadAttention(2, 8, rotary_embedding=rope)(x, x, use_causal_mask=True)
    return keras.Model(x, [y, kal.RotaryEmbedding()(x)], name="rotary_embedding")


def alibi_bias():
    x = _features()
    bias = kal.AlibiBias(4)(x)
    y = kal.MultiHeadAttention(4, 4)(x, x, attention_bias=bias, use_causal_mask=True)
    return keras.Model(x, y, name="alibi_bias")


def relative_position_bias():
    x = _features()
    bias = kal.RelativePositionBias(4, embeddings_initializer="random_normal")(x)
    y = kal.MultiHeadAttention(4, 4)(x, x, attention_bias=bias)
    return keras.Model(x, y, name="relative_position_bias")


def token_and_position_embedding(position="learned"):
    ids = _ids()
    h = kal.TokenAndPositionEmbedding(VOCAB, 32, DIM, position=position, mask_zero=True)(ids)
    return keras.Model(ids, h, name=f"token_and_position_embedding_{position}")


def encoder_classifier(normalize_first=False, num_classes=3, dim=DIM, intermediate_dim=32):
    """TokenAndPositionEmbedding(mask_zero) -> encoder block -> masked mean pool -> softmax."""
    ids = _ids()
    h = kal.TokenAndPositionEmbedding(VOCAB, 32, dim, mask_zero=True)(ids)
    h = kal.TransformerEncoderBlock(2, intermediate_dim=intermediate_dim, normalize_first=normalize_first)(h)
    pooled = keras.layers.GlobalAveragePooling1D()(h)
    probs = keras.layers.Dense(num_classes, activation="softmax", name="probs")(pooled)
    return keras.Model(ids, probs, name="encoder_classifier")


def encoder_decoder():
    enc_ids = _ids("encoder_tokens")
    dec_ids = _ids("decoder_tokens")
    enc = kal.TokenAndPositionEmbedding(VOCAB, 32, DIM, mask_zero=True)(enc_ids)
    enc = kal.TransformerEncoderBlock(2, intermediate_dim=32)(enc)
    dec = kal.TokenAndPositionEmbedding(VOCAB, 32, DIM, mask_zero=True)(dec_ids)
    dec = kal.TransformerDecoderBlock(2, intermediate_dim=32, normalize_first=True)(dec, enc)
    logits = keras.layers.Dense(VOCAB, name="logits")(dec)
    return keras.Model([enc_ids, dec_ids], logits, name="encoder_decoder")


def decoder_only():
    ids = _ids()
    h = kal.TokenAndPositionEmbedding(VOCAB, 32, DIM, position="sinusoidal")(ids)
    h = kal.TransformerDecoderBlock(2, intermediate_dim=32, num_key_value_heads=1)(h)
    return keras.Model(ids, keras.layers.Dense(VOCAB, name="logits")(h), name="decoder_only")


def pretrained_style():
    """BERT-style embeddings (token types, LayerNorm), key-only padding, exact
    GELU, and the token table reused as the output head (tied)."""
    ids = _ids()
    embedding = kal.TokenAndPositionEmbedding(
        VOCAB, 32, DIM, position="learned", type_vocabulary_size=2, use_layer_norm=True,
        layer_norm_epsilon=1e-12, mask_zero=True,
    )
    h = embedding(ids)
    h = kal.TransformerEncoderBlock(
        num_heads=2, intermediate_dim=32, activation="gelu", mask_padded_queries=False
    )(h)
    logits = embedding(h, reverse=True)
    return keras.Model(ids, logits, name="pretrained_style")


ALL = {
    f.__name__: f
    for f in (
        dot_product_attention, additive_attention, multi_head_attention, cross_attention,
        sinusoidal_position_encoding, learned_position_embedding, rotary_embedding, alibi_bias,
        relative_position_bias, token_and_position_embedding, encoder_classifier,
        encoder_decoder, decoder_only, pretrained_style,
    )
}


def sample_inputs(model, batch=2, length=7, seed=0):
    """Random inputs for `model`; integer inputs get trailing padding (id 0) in row 0."""
    rng = np.random.default_rng(seed)
    out = []
    for inp in model.inputs:
        if "int" in str(inp.dtype):
            x = rng.integers(1, VOCAB, size=(batch, length)).astype("int32")
            if batch > 0 and length > 2:
                x[0, -2:] = 0
        else:
            x = rng.standard_normal((batch, length, inp.shape[-1])).astype("float32")
        out.append(x)
    return out if len(out) > 1 else out[0]


def ort_runner(session):
    """An onnxruntime session as a callable over NumPy dicts, named as the
    signatures (an output named like an input carries `_out`, dropped here)."""

    def run(**kwargs):
        names = [o.name for o in session.get_outputs()]
        return {n.removesuffix("_out"): v for n, v in zip(names, session.run(None, kwargs))}

    return run


def left_padded_prompts(vocabulary_size, seed=6, lengths=(3, 6, 5), width=6):
    """Prompts of `lengths` tokens (ids from 3) left-padded with 0 to `width`,
    and their attention mask: Hugging Face's batched-generation layout."""
    rng = np.random.default_rng(seed)
    ids = np.zeros((len(lengths), width), "int32")
    mask = np.zeros_like(ids)
    for row, n in enumerate(lengths):
        ids[row, width - n:] = rng.integers(3, vocabulary_size, size=n)
        mask[row, width - n:] = 1
    return ids, mask


# BERT-shaped encoders (token types, LayerNorms, key padding, a tanh pooler on
# the first token), the models the direct ONNX and TFLite writers cover.
BERT_VOCAB, BERT_LENGTH, BERT_DIM, BERT_HEADS, BERT_FFN = 50, 16, 32, 4, 64


def randomize(model, seed, scale=0.3):
    """Every weight of `model` (a model or a layer) drawn from N(0, scale^2);
    `seed` is an int or a NumPy Generator (which then moves on). Non-zero
    biases and non-unit LayerNorm weights, so that a bias or a gamma that an
    export, a conversion or a reference dropped or misplaced shows."""
    rng = np.random.default_rng(seed)
    for w in model.weights:
        w.assign(rng.normal(0.0, scale, tuple(w.shape)).astype("float32"))


def bert_like(normalize_first, activation, layers, seed, mask_padded_queries=False, causal=False):
    """`input_ids`, `attention_mask`, `token_type_ids` -> `last_hidden_state`, `pooler_output`."""
    ids = keras.Input((None,), dtype="int32", name="input_ids")
    mask = keras.Input((None,), dtype="int32", name="attention_mask")
    types = keras.Input((None,), dtype="int32", name="token_type_ids")
    x = kal.TokenAndPositionEmbedding(
        BERT_VOCAB, BERT_LENGTH, BERT_DIM, position="learned", type_vocabulary_size=2,
        use_layer_norm=True, name="embedding",
    )(ids, token_type_ids=types)
    x = keras.layers.Dropout(0.1)(x)
    padding = keras.ops.not_equal(mask, 0)
    for i in range(layers):
        x = kal.TransformerEncoderBlock(
            num_heads=BERT_HEADS, intermediate_dim=BERT_FFN, activation=activation, dropout=0.1,
            normalize_first=normalize_first, mask_padded_queries=mask_padded_queries,
            name=f"encoder_{i}",
        )(x, padding_mask=padding, use_causal_mask=causal)
    pooled = keras.layers.Dense(BERT_DIM, activation="tanh", name="pooler")(x[:, 0, :])
    outputs = [keras.layers.Identity(name="last_hidden_state")(x),
               keras.layers.Identity(name="pooler_output")(pooled)]
    model = keras.Model([ids, mask, types], outputs)
    randomize(model, seed)
    return model


def bert_feed(batch=3, length=11, seed=0):
    """Inputs of `bert_like`: rows of `length`, `length - 4` and 3 tokens, right-padded."""
    rng = np.random.default_rng(seed)
    lengths = [length, length - 4, 3][:batch]
    mask = (np.arange(length)[None, :] < np.array(lengths)[:, None]).astype("int32")
    return {
        "input_ids": rng.integers(0, BERT_VOCAB, (batch, length)).astype("int32"),
        "attention_mask": mask,
        "token_type_ids": rng.integers(0, 2, (batch, length)).astype("int32"),
    }
