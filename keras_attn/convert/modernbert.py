"""ModernBERT encoders (`ModernBertModel`, `ModernBertForMaskedLM`,
`ModernBertForSequenceClassification`) onto a functional `keras.Model` of
pre-norm `TransformerEncoderBlock`s.

Inputs are int32 `input_ids` and `attention_mask` (1 = token, 0 = padding),
`(B, T)`; outputs `last_hidden_state` `(B, T, D)`, or `logits`: `(B, T, V)`
for the masked LM, `(B, num_labels)` for the classifier. What ModernBERT
has, and what it becomes:

- token embeddings, then a LayerNorm (`embeddings.norm`); no position table;
- alternating attention (`layer_types`, from `global_attn_every_n_layers`):
  "full_attention" layers see every token with rotary base
  `rope_parameters["full_attention"]` (`global_rope_theta`),
  "sliding_attention" layers the keys at most `local_attention // 2`
  positions away on either side (transformers' bidirectional window,
  `|i - j| <= local_attention // 2`: `sliding_window=local_attention // 2 + 1`
  here, whose band is `|i - j| < sliding_window`) with base
  `rope_parameters["sliding_attention"]` (`local_rope_theta`);
- pre-norm blocks whose first layer has no attention norm (its input is
  the normalized embedding: `use_self_attention_norm=False`), LayerNorms
  with or without biases (`norm_bias`: `layer_norm_use_bias`), linear
  biases per `attention_bias` / `mlp_bias`;
- a GeGLU feed-forward whose `Wi` holds the activated half first:
  `Wo(act(Wi_1 x) * Wi_2 x)`, so `Wi`'s first half is the gate dense;
- a final LayerNorm; the masked LM's head `dense`, `classifier_activation`,
  `norm`, then the decoder (tied to the token table by default, with
  `decoder_bias`); the classifier's pooling (`classifier_pooling`: the first
  position, or the mean over `attention_mask`), the same head, then the
  `classifier`.

Padding masks keys only (`mask_padded_queries=False`), as transformers does;
positions are `0 .. T-1` whatever the padding, as transformers gives them.
"cls" pooling reads position 0, as transformers does: in a left-padded row
that is a pad, whose value is unspecified (when its window holds no token,
transformers averages every value, keras_attn gives none).

| Hugging Face tensor (prefix `model.` in task models) | keras_attn variable                                        |
|------------------------------------------------------|------------------------------------------------------------|
| `embeddings.tok_embeddings.weight`                   | `token_embedding/embeddings`                                |
| `embeddings.norm.{weight,bias}`                      | `embedding_norm/{gamma,beta}`                               |
| `layers.i.attn_norm.*` (i > 0)                       | `encoder_i/self_attention_layer_norm/*`                     |
| `layers.i.attn.Wqkv.*` (rows: q, k, v)               | `encoder_i/self_attention/{query,key,value}/*`              |
| `layers.i.attn.Wo.*`                                 | `encoder_i/self_attention/attention_output/*`               |
| `layers.i.mlp_norm.*`                                | `encoder_i/feedforward_layer_norm/*`                        |
| `layers.i.mlp.Wi.*` (rows: gate, then input)         | `encoder_i/feedforward_{gate,intermediate}_dense/*`         |
| `layers.i.mlp.Wo.*`                                  | `encoder_i/feedforward_output_dense/*`                      |
| `final_norm.*`                                       | `final_norm/*`                                              |
| `head.dense.*`, `head.norm.*` (no prefix)            | `head_dense/*`, `head_norm/*`                               |
| `decoder.weight` (no prefix)                         | `decoder/kernel` (a copy; checked equal to the table when tied) |
| `decoder.bias`, `classifier.*` (no prefix)           | `decoder/bias`, `classifier/*`                              |
"""

import keras
import numpy as np

from keras_attn.convert import common
from keras_attn.convert import llama
from keras_attn.convert import sentence_transformers
from keras_attn.layers import activations
from keras_attn.layers.rotary_embedding import RotaryEmbedding
from keras_attn.layers.transformer_encoder_block import TransformerEncoderBlock

MASKED_LM = "ModernBertForMaskedLM"
CLASSIFIER = "ModernBertForSequenceClassification"
_PROBLEM_TYPES = (None, "single_label_classification", "multi_label_classification", "regression")
_LAYER_TYPES = ("sliding_attention", "full_attention")


def _check_config(config, architecture):
    config_types = list(config.layer_types)
    unknown = sorted(set(config_types) - set(_LAYER_TYPES))
    if unknown or len(config_types) != config.num_hidden_layers:
        common.refuse("layer_types", config_types,
                      f"must list one of {list(_LAYER_TYPES)} per layer ({config.num_hidden_layers})")
    if config.hidden_size % config.num_attention_heads:
        common.refuse("num_attention_heads", config.num_attention_heads, "does not divide hidden_size")
    common.mapped_activation("hidden_activation", config.hidden_activation)
    if architecture != "ModernBertModel":
        common.mapped_activation("classifier_activation", config.classifier_activation)
    if architecture == CLASSIFIER:
        if config.classifier_pooling not in ("cls", "mean"):
            common.refuse("classifier_pooling", config.classifier_pooling, "is not 'cls' or 'mean'")
        if getattr(config, "problem_type", None) not in _PROBLEM_TYPES:
            common.refuse("problem_type", config.problem_type, "is not supported")


def _rotary(config, layer_type):
    theta, _ = llama.rope(config, config.rope_parameters[layer_type], rope_types=("default",))
    return RotaryEmbedding(theta)


def _split_rows(weights, name, parts):
    """`nn.Linear` `name` as `parts` linears `(kernel (in, out), bias, name)`,
    its output rows split in order (the fused `Wqkv` and `Wi`)."""
    kernel, bias, _ = weights.linear(name)
    kernels = np.split(kernel, parts, axis=1)
    biases = [None] * parts if bias is None else np.split(bias, parts)
    return [(k, b, name) for k, b in zip(kernels, biases)]


def convert(checkpoint, *, dropout=None):
    """A functional encoder with the weights and outputs of a ModernBERT model.

    `dropout`: of the attention probabilities and both residual branches of
    every block; None uses the config's `attention_dropout` (ModernBERT's
    `mlp_dropout` sits inside its feed-forward, which keras_attn's block
    does not have; both are 0 in the released models).
    """
    config, architecture = checkpoint.config, checkpoint.architecture
    _check_config(config, architecture)
    weights = common.Weights(checkpoint.tensors, "model")
    hidden, eps, bias = config.hidden_size, config.norm_eps, bool(config.norm_bias)
    rate = float(config.attention_dropout) if dropout is None else dropout
    # transformers' window is `|i - j| <= local_attention // 2`; ours `|i - j| < w`.
    window = config.local_attention // 2 + 1
    rotaries = {kind: _rotary(config, kind) for kind in set(config.layer_types)}

    def norm(name):
        return keras.layers.LayerNormalization(epsilon=eps, center=bias, name=name)

    input_ids = keras.Input((None,), dtype="int32", name="input_ids")
    attention_mask = keras.Input((None,), dtype="int32", name="attention_mask")
    token_embedding = keras.layers.Embedding(config.vocab_size, hidden, name="token_embedding")
    embedding_norm = norm("embedding_norm")
    x = embedding_norm(token_embedding(input_ids))
    x = keras.layers.Dropout(float(config.embedding_dropout) if dropout is None else dropout,
                             name="embedding_dropout")(x)
    padding_mask = keras.ops.not_equal(attention_mask, 0)
    blocks = []
    for i, kind in enumerate(config.layer_types):
        block = TransformerEncoderBlock(
            num_heads=config.num_attention_heads, intermediate_dim=config.intermediate_size,
            activation=config.hidden_activation, normalize_first=True, layer_norm_epsilon=eps,
            layer_norm_use_bias=bias, use_self_attention_norm=i > 0,
            use_gated_feedforward=True, attention_use_bias=bool(config.attention_bias),
            feedforward_use_bias=bool(config.mlp_bias), rotary_embedding=rotaries[kind],
            sliding_window=window if kind == "sliding_attention" else None,
            dropout=rate, mask_padded_queries=False, name=f"encoder_{i}",
        )
        x = block(x, padding_mask=padding_mask)
        blocks.append(block)
    final_norm = norm("final_norm")
    x = final_norm(x)
    head = None
    if architecture == "ModernBertModel":
        outputs = keras.layers.Identity(name="last_hidden_state")(x)
    else:
        # keras_attn's exportable activations (Keras' gelu is no TFLite or ONNX builtin).
        head_dense = keras.layers.Dense(hidden, activation=activations.get(common.mapped_activation(
            "classifier_activation", config.classifier_activation)), use_bias=bool(config.classifier_bias),
            name="head_dense")
        head_norm = norm("head_norm")
        head = (head_dense, head_norm)
        if architecture == MASKED_LM:
            decoder = keras.layers.Dense(config.vocab_size, use_bias=bool(config.decoder_bias), name="decoder")
            logits = decoder(head_norm(head_dense(x)))
        else:
            pooled = x[:, 0, :] if config.classifier_pooling == "cls" else (
                sentence_transformers.pool(x, attention_mask, ["mean"]))
            pooled = head_norm(head_dense(pooled))
            head_dropout = float(config.classifier_dropout) if dropout is None else dropout
            pooled = keras.layers.Dropout(head_dropout, name="head_dropout")(pooled)
            classifier = keras.layers.Dense(config.num_labels, name="classifier")
            logits = classifier(pooled)
        outputs = keras.layers.Identity(name="logits")(logits)
    model = keras.Model([input_ids, attention_mask], outputs, name="modernbert_keras_attn")

    table = weights.take("embeddings.tok_embeddings.weight")
    common.assign(token_embedding.embeddings, table, "embeddings.tok_embeddings.weight")
    _set_norm(embedding_norm, weights, "embeddings.norm")
    for i, block in enumerate(blocks):
        p = f"layers.{i}."
        if block.self_attention_layer_norm is not None:
            _set_norm(block.self_attention_layer_norm, weights, p + "attn_norm")
        common.set_attention(block.self_attention, *_split_rows(weights, p + "attn.Wqkv", 3),
                             weights.linear(p + "attn.Wo"))
        _set_norm(block.feedforward_layer_norm, weights, p + "mlp_norm")
        gate, up = _split_rows(weights, p + "mlp.Wi", 2)
        common.set_dense(block.feedforward_gate_dense, *gate)
        common.set_dense(block.feedforward_intermediate_dense, *up)
        common.set_dense(block.feedforward_output_dense, *weights.linear(p + "mlp.Wo"))
    _set_norm(final_norm, weights, "final_norm")
    if head is not None:
        common.set_dense(head[0], *weights.linear("head.dense"))
        _set_norm(head[1], weights, "head.norm")
    if architecture == MASKED_LM:
        common.set_output_head(decoder, weights, "decoder", table, bool(config.tie_word_embeddings),
                               "tok_embeddings")
    elif architecture == CLASSIFIER:
        common.set_dense(classifier, *weights.linear("classifier"))
    weights.check_all_used(architecture)
    return model


def _set_norm(layer, weights, prefix):
    """A LayerNormalization with or without its bias (`norm_bias`)."""
    common.assign(layer.gamma, weights.take(prefix + ".weight"), prefix + ".weight")
    if layer.beta is not None:
        common.assign(layer.beta, weights.take(prefix + ".bias"), prefix + ".bias")


FAMILY = common.Family(
    name="ModernBERT",
    model_types=("modernbert",),
    architectures=("ModernBertModel", MASKED_LM, CLASSIFIER),
    convert=convert,
)
