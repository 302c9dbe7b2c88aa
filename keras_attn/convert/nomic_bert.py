"""NomicBERT encoders (`NomicBertModel`, nomic-embed-text's backbone) onto a
functional `keras.Model` of post-norm `TransformerEncoderBlock`s: BERT's
embeddings without a position table (tokens plus token types, LayerNorm),
then blocks `LN(x + attention(x))`, `LN(x + SwiGLU(x))` with rotary heads
(the config's `rope_parameters`) and no linear biases.

Inputs as BERT's (`bert.py`): int32 `input_ids`, `attention_mask` and, with
more than one token type, `token_type_ids`; output `last_hidden_state`
(a model with its optional pooler is refused: its `pooler.dense` tensors
are left over). Padding masks keys only; positions are `0 .. T-1`.

| Hugging Face tensor                          | keras_attn variable                                   |
|----------------------------------------------|-------------------------------------------------------|
| `embeddings.word_embeddings.weight`          | `token_embedding/embeddings`                          |
| `embeddings.token_type_embeddings.weight`    | `token_type_embedding/embeddings`                     |
| `embeddings.LayerNorm.*`                     | `embedding_norm/*`                                    |
| `layers.i.self_attn.{q,k,v,o}_proj.weight`   | `encoder_i/self_attention/{query,key,value,attention_output}/kernel` |
| `layers.i.post_attention_layernorm.*`        | `encoder_i/self_attention_layer_norm/*`               |
| `layers.i.mlp.{gate,up,down}_proj.weight`    | `encoder_i/feedforward_{gate,intermediate,output}_dense/kernel` |
| `layers.i.post_mlp_layernorm.*`              | `encoder_i/feedforward_layer_norm/*`                  |
"""

import keras

from keras_attn.convert import common
from keras_attn.convert import llama
from keras_attn.layers.rotary_embedding import RotaryEmbedding
from keras_attn.layers.transformer_encoder_block import TransformerEncoderBlock


def convert(checkpoint, *, dropout=None):
    """A functional encoder with the weights and outputs of a `NomicBertModel`.

    `dropout`: of the embeddings, attention and residual branches; None uses
    the config's `hidden_dropout_prob`.
    """
    config = checkpoint.config
    activation = common.mapped_activation("hidden_act", config.hidden_act)
    weights = common.Weights(checkpoint.tensors, "model")
    hidden, eps = config.hidden_size, config.layer_norm_eps
    rate = config.hidden_dropout_prob if dropout is None else dropout
    theta, scaling = llama.rope(config)
    rotary = RotaryEmbedding(theta, rope_scaling=scaling)
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads

    input_ids = keras.Input((None,), dtype="int32", name="input_ids")
    attention_mask = keras.Input((None,), dtype="int32", name="attention_mask")
    inputs = [input_ids, attention_mask]
    token_embedding = keras.layers.Embedding(config.vocab_size, hidden, name="token_embedding")
    type_embedding = keras.layers.Embedding(config.type_vocab_size, hidden, name="token_type_embedding")
    if config.type_vocab_size > 1:
        token_type_ids = keras.Input((None,), dtype="int32", name="token_type_ids")
        inputs.append(token_type_ids)
    else:
        token_type_ids = keras.ops.zeros_like(input_ids)
    embedding_norm = keras.layers.LayerNormalization(epsilon=eps, name="embedding_norm")
    x = embedding_norm(token_embedding(input_ids) + type_embedding(token_type_ids))
    x = keras.layers.Dropout(rate, name="embedding_dropout")(x)
    padding_mask = keras.ops.not_equal(attention_mask, 0)
    blocks = []
    for i in range(config.num_hidden_layers):
        block = TransformerEncoderBlock(
            num_heads=config.num_attention_heads, key_dim=head_dim,
            intermediate_dim=config.intermediate_size, activation=activation,
            layer_norm_epsilon=eps, use_gated_feedforward=True, attention_use_bias=False,
            feedforward_use_bias=False, rotary_embedding=rotary, dropout=rate,
            mask_padded_queries=False, name=f"encoder_{i}",
        )
        x = block(x, padding_mask=padding_mask)
        blocks.append(block)
    x = keras.layers.Identity(name="last_hidden_state")(x)
    model = keras.Model(inputs, x, name="nomic_bert_keras_attn")

    common.assign(token_embedding.embeddings, weights.take("embeddings.word_embeddings.weight"),
                  "embeddings.word_embeddings.weight")
    common.assign(type_embedding.embeddings, weights.take("embeddings.token_type_embeddings.weight"),
                  "embeddings.token_type_embeddings.weight")
    common.set_norm(embedding_norm, weights, "embeddings.LayerNorm")
    for i, block in enumerate(blocks):
        p = f"layers.{i}."
        common.set_attention(block.self_attention, *(
            weights.linear(p + "self_attn." + module) for module, _ in llama.ATTENTION_PROJECTIONS))
        common.set_norm(block.self_attention_layer_norm, weights, p + "post_attention_layernorm")
        for module, attribute in llama.FEEDFORWARD_PROJECTIONS:
            common.set_dense(getattr(block, attribute), *weights.linear(p + "mlp." + module))
        common.set_norm(block.feedforward_layer_norm, weights, p + "post_mlp_layernorm")
    weights.check_all_used(checkpoint.architecture)
    return model


FAMILY = common.Family(
    name="NomicBERT",
    model_types=("nomic_bert",),
    architectures=("NomicBertModel",),
    convert=convert,
)
