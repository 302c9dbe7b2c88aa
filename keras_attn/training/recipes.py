"""Ready-made models from keras_attn layers, used by the examples and the quickstart."""

import keras

from keras_attn.layers import (
    TokenAndPositionEmbedding,
    TransformerDecoderBlock,
    TransformerEncoderBlock,
)


def seq2seq_transformer(
    input_vocabulary_size,
    target_vocabulary_size,
    input_length,
    target_length,
    embedding_dim=64,
    num_heads=4,
    intermediate_dim=128,
    num_encoder_layers=2,
    num_decoder_layers=2,
    dropout=0.0,
    name="seq2seq_transformer",
    dynamic_length=False,
):
    """A Transformer encoder-decoder: token ids in, next-token logits out.

    Returns `(model, attention_model)`. Both take the inputs
    `[encoder_inputs (B, input_length), decoder_inputs (B, target_length)]`
    (also as a dict with these names; id 0 = padding); `model` returns float32 logits `(B, target_length, V)`,
    `attention_model` (same weights) returns `(logits, cross_attention)` with
    the last decoder block's cross-attention `(B, heads, target_length, input_length)`.
    With `dynamic_length=True` both inputs have shape `(B, None)`: any length
    up to `input_length` / `target_length` (the position tables' sizes), so an
    exported model serves shorter sequences without padding them to the max.
    """
    enc_len, dec_len = (None, None) if dynamic_length else (input_length, target_length)
    enc_in = keras.Input((enc_len,), dtype="int32", name="encoder_inputs")
    dec_in = keras.Input((dec_len,), dtype="int32", name="decoder_inputs")
    x = TokenAndPositionEmbedding(
        input_vocabulary_size, input_length, embedding_dim, mask_zero=True,
        name="encoder_embedding",
    )(enc_in)
    for i in range(num_encoder_layers):
        x = TransformerEncoderBlock(
            num_heads, intermediate_dim=intermediate_dim, dropout=dropout, name=f"encoder_{i}"
        )(x)
    y = TokenAndPositionEmbedding(
        target_vocabulary_size, target_length, embedding_dim, mask_zero=True,
        name="decoder_embedding",
    )(dec_in)
    scores = None
    for i in range(num_decoder_layers):
        y, scores = TransformerDecoderBlock(
            num_heads, intermediate_dim=intermediate_dim, dropout=dropout, name=f"decoder_{i}"
        )(y, x, return_attention_scores=True)
    logits = keras.layers.Dense(target_vocabulary_size, dtype="float32", name="logits")(y)
    # A list, not a dict: exporters and serving signatures keep this order,
    # and Keras still accepts dict inputs keyed by these names.
    inputs = [enc_in, dec_in]
    model = keras.Model(inputs, logits, name=name)
    attention_model = keras.Model(
        inputs, [logits, scores["cross_attention"]], name=f"{name}_with_attention"
    )
    return model, attention_model


def transformer_classifier(
    vocabulary_size,
    sequence_length,
    num_classes=2,
    embedding_dim=32,
    num_heads=2,
    intermediate_dim=64,
    num_layers=1,
    dropout=0.1,
    position="learned",
    name="transformer_classifier",
    dynamic_length=False,
):
    """`TokenAndPositionEmbedding` + encoder blocks + masked mean pooling -> logits.

    Learned positions by default: they start at the scale of the token
    embeddings, where unit-amplitude sinusoids would drown the small initial
    token vectors and slow the start of training. With `dynamic_length=True`
    the input is `(B, None)`: any length up to `sequence_length`.
    """
    ids = keras.Input(
        (None if dynamic_length else sequence_length,), dtype="int32", name="token_ids"
    )
    x = TokenAndPositionEmbedding(
        vocabulary_size, sequence_length, embedding_dim, position=position, mask_zero=True,
        name="embedding",
    )(ids)
    for i in range(num_layers):
        x = TransformerEncoderBlock(
            num_heads, intermediate_dim=intermediate_dim, dropout=dropout, name=f"encoder_{i}"
        )(x)
    x = keras.layers.GlobalAveragePooling1D(name="pool")(x)
    x = keras.layers.Dropout(dropout)(x)
    logits = keras.layers.Dense(num_classes, dtype="float32", name="logits")(x)
    return keras.Model(ids, logits, name=name)
