"""BERT-family encoders (BERT, RoBERTa, XLM-RoBERTa) onto a functional
`keras.Model` of `TransformerEncoderBlock`s.

Inputs are int32 `input_ids`, `attention_mask` (1 = token, 0 = padding) and,
when the config has more than one token type, `token_type_ids`; all `(B, T)`.
A base model (`BertModel`, `RobertaModel`) outputs `last_hidden_state`
`(B, T, D)` and, when it has a pooler, `pooler_output` `(B, D)`; a
`*ForSequenceClassification` model outputs `logits` `(B, num_labels)`.
Padding masks keys only (`mask_padded_queries=False`), as BERT does, so every
position, padded or not, equals Hugging Face's. RoBERTa numbers positions
from `pad_token_id + 1`: the converter drops the table's first
`pad_token_id + 1` rows, which gives Hugging Face's positions for
right-padded inputs (Hugging Face gives padded tokens position
`pad_token_id`; their outputs then differ, unused either way).

Tensor names (prefix `bert.` / `roberta.` in task models; `nn.Linear`
weights `(out, in)` are transposed; `H` heads of size `d`, `D = H * d`):

| Hugging Face tensor                                | keras_attn variable                                              |
|----------------------------------------------------|------------------------------------------------------------------|
| `embeddings.word_embeddings.weight`                | `embedding/token_embedding/embeddings`                           |
| `embeddings.position_embeddings.weight`            | `embedding/position_embedding/embeddings` (RoBERTa: rows `pad+1:`) |
| `embeddings.token_type_embeddings.weight`          | `embedding/token_type_embedding/embeddings`                      |
| `embeddings.LayerNorm.{weight,bias}`               | `embedding/layer_norm/{gamma,beta}`                              |
| `encoder.layer.i.attention.self.query.{weight,bias}` | `encoder_i/self_attention/query/{kernel (D,H,d), bias (H,d)}`  |
| `encoder.layer.i.attention.self.key.*`             | `encoder_i/self_attention/key/*`                                 |
| `encoder.layer.i.attention.self.value.*`           | `encoder_i/self_attention/value/*`                               |
| `encoder.layer.i.attention.output.dense.*`         | `encoder_i/self_attention/attention_output/{kernel (H,d,D), bias}` |
| `encoder.layer.i.attention.output.LayerNorm.*`     | `encoder_i/self_attention_layer_norm/{gamma,beta}`               |
| `encoder.layer.i.intermediate.dense.*`             | `encoder_i/feedforward_intermediate_dense/{kernel,bias}`         |
| `encoder.layer.i.output.dense.*`                   | `encoder_i/feedforward_output_dense/{kernel,bias}`               |
| `encoder.layer.i.output.LayerNorm.*`               | `encoder_i/feedforward_layer_norm/{gamma,beta}`                  |
| `pooler.dense.*` (RoBERTa: `classifier.dense.*`)   | `pooler/{kernel,bias}` (tanh)                                    |
| `classifier.*` (RoBERTa: `classifier.out_proj.*`)  | `classifier/{kernel,bias}`                                       |
"""

import keras

from keras_attn.convert import common
from keras_attn.layers.token_and_position_embedding import TokenAndPositionEmbedding
from keras_attn.layers.transformer_encoder_block import TransformerEncoderBlock

_PROBLEM_TYPES = (None, "single_label_classification", "multi_label_classification", "regression")


def _check_config(config, classify):
    position_type = getattr(config, "position_embedding_type", "absolute")
    if position_type not in (None, "absolute"):
        common.refuse("position_embedding_type", position_type, "is not supported (only 'absolute')")
    if getattr(config, "is_decoder", False):
        common.refuse("is_decoder", True, "(a causal BERT) is not supported; convert encoders")
    if getattr(config, "add_cross_attention", False):
        common.refuse("add_cross_attention", True, "is not supported")
    common.mapped_activation("hidden_act", config.hidden_act)
    if config.hidden_size % config.num_attention_heads:
        common.refuse("num_attention_heads", config.num_attention_heads, "does not divide hidden_size")
    problem = getattr(config, "problem_type", None)
    if classify and problem not in _PROBLEM_TYPES:
        common.refuse("problem_type", problem, "is not supported")


def convert(checkpoint, *, dropout=None):
    """A functional encoder with the weights and outputs of a BERT-family model.

    `dropout`: of the embeddings, attention, residual branches and
    classifier head; None uses the config's `hidden_dropout_prob`.
    """
    config, architecture = checkpoint.config, checkpoint.architecture
    classify = architecture.endswith("ForSequenceClassification")
    _check_config(config, classify)
    roberta = config.model_type != "bert"
    # The task models' `base_model_prefix` (RoBERTa and XLM-RoBERTa: "roberta").
    weights = common.Weights(checkpoint.tensors, "roberta" if roberta else "bert")
    hidden = config.hidden_size
    rate = config.hidden_dropout_prob if dropout is None else dropout
    offset = config.pad_token_id + 1 if roberta else 0
    positions = config.max_position_embeddings - offset
    if positions <= 0:
        common.refuse("max_position_embeddings", config.max_position_embeddings,
                      f"leaves no position after the RoBERTa offset {offset}")
    types = config.type_vocab_size

    input_ids = keras.Input((None,), dtype="int32", name="input_ids")
    attention_mask = keras.Input((None,), dtype="int32", name="attention_mask")
    inputs = [input_ids, attention_mask]
    embedding = TokenAndPositionEmbedding(
        config.vocab_size, positions, hidden, position="learned",
        type_vocabulary_size=types, use_layer_norm=True,
        layer_norm_epsilon=config.layer_norm_eps, name="embedding",
    )
    if types > 1:
        token_type_ids = keras.Input((None,), dtype="int32", name="token_type_ids")
        inputs.append(token_type_ids)
        x = embedding(input_ids, token_type_ids=token_type_ids)
    else:
        x = embedding(input_ids)
    x = keras.layers.Dropout(rate, name="embedding_dropout")(x)
    padding_mask = keras.ops.not_equal(attention_mask, 0)
    blocks = []
    for i in range(config.num_hidden_layers):
        block = TransformerEncoderBlock(
            num_heads=config.num_attention_heads, intermediate_dim=config.intermediate_size,
            activation=config.hidden_act, layer_norm_epsilon=config.layer_norm_eps,
            dropout=rate, mask_padded_queries=False, name=f"encoder_{i}",
        )
        x = block(x, padding_mask=padding_mask)
        blocks.append(block)
    outputs = []
    pooler = None
    if "pooler.dense.weight" in weights or (roberta and classify):
        # BERT's pooler, or RoBERTa's classification head's first dense: both
        # tanh(dense(first token)).
        pooler = keras.layers.Dense(hidden, activation="tanh", name="pooler")
        first = x[:, 0, :]
        if roberta and classify:  # dropout, dense, tanh, dropout, out_proj
            first = keras.layers.Dropout(rate, name="head_dropout_0")(first)
        pooled = pooler(first)
    if classify:
        head_dropout = getattr(config, "classifier_dropout", None)
        head_dropout = rate if head_dropout is None or dropout is not None else head_dropout
        classifier = keras.layers.Dense(config.num_labels, name="classifier")
        logits = classifier(keras.layers.Dropout(head_dropout, name="head_dropout")(pooled))
        outputs.append(keras.layers.Identity(name="logits")(logits))
    else:
        outputs.append(keras.layers.Identity(name="last_hidden_state")(x))
        if pooler is not None:
            outputs.append(keras.layers.Identity(name="pooler_output")(pooled))
    model = keras.Model(inputs, outputs, name=f"{config.model_type}_keras_attn")

    common.assign(embedding.token_embedding.embeddings, weights.take("embeddings.word_embeddings.weight"), "word_embeddings")
    common.assign(
        embedding.position_embedding.position_embeddings,
        weights.take("embeddings.position_embeddings.weight")[offset:],
        "position_embeddings",
    )
    common.assign(embedding.token_type_embedding.embeddings, weights.take("embeddings.token_type_embeddings.weight"), "token_type_embeddings")
    common.set_norm(embedding.layer_norm, weights, "embeddings.LayerNorm")
    for i, block in enumerate(blocks):
        p = f"encoder.layer.{i}."
        common.set_attention(
            block.self_attention,
            weights.linear(p + "attention.self.query"),
            weights.linear(p + "attention.self.key"),
            weights.linear(p + "attention.self.value"),
            weights.linear(p + "attention.output.dense"),
        )
        common.set_norm(block.self_attention_layer_norm, weights, p + "attention.output.LayerNorm")
        common.set_dense(block.feedforward_intermediate_dense, *weights.linear(p + "intermediate.dense"))
        common.set_dense(block.feedforward_output_dense, *weights.linear(p + "output.dense"))
        common.set_norm(block.feedforward_layer_norm, weights, p + "output.LayerNorm")
    if pooler is not None:
        common.set_dense(pooler, *weights.linear("classifier.dense" if roberta and classify else "pooler.dense"))
    if classify:
        common.set_dense(classifier, *weights.linear("classifier.out_proj" if roberta else "classifier"))
    weights.check_all_used(architecture)
    return model


FAMILY = common.Family(
    name="BERT",
    model_types=("bert", "roberta", "xlm-roberta"),
    architectures=("BertModel", "RobertaModel", "XLMRobertaModel", "*ForSequenceClassification"),
    convert=convert,
)
