"""Hugging Face `transformers` checkpoints onto keras_attn layers.

`from_huggingface(model_or_local_dir)` reads a PyTorch `transformers` model
(an instance, or a directory written by `save_pretrained`; nothing is ever
downloaded) and returns the same network built from keras_attn layers with
the weights copied, so it trains with Keras and exports to SavedModel,
TFLite (builtins only) and ONNX like any other keras_attn model.

Supported families and what they become:

- **BERT-family encoders** (`model_type` `"bert"`, `"roberta"`,
  `"xlm-roberta"`): a functional `keras.Model` with int32 inputs
  `input_ids`, `attention_mask` (1 = token, 0 = padding) and, when the
  config has more than one token type, `token_type_ids`; all `(B, T)`.
  A base model (`BertModel`, `RobertaModel`) outputs `last_hidden_state`
  `(B, T, D)` and, when it has a pooler, `pooler_output` `(B, D)`;
  a `*ForSequenceClassification` model outputs `logits` `(B, num_labels)`.
  Padding masks keys only (`mask_padded_queries=False`), as BERT does, so
  every position, padded or not, equals Hugging Face's. RoBERTa numbers
  positions from `pad_token_id + 1`: the converter drops the table's first
  `pad_token_id + 1` rows, which gives Hugging Face's positions for
  right-padded inputs (Hugging Face gives padded tokens position
  `pad_token_id`; their outputs then differ, unused either way).
- **GPT-2-family decoders** (`model_type` `"gpt2"`): a
  `keras_attn.generation.DecoderOnlyLM` (learned positions, pre-norm
  blocks, `activation_function`, `layer_norm_epsilon`, tied head without
  bias), so `keras_attn.generation.greedy_search` and the generation
  exporters work on it. `call(token_ids, padding_mask)` gives the logits
  of `GPT2LMHeadModel` (padding masks keys only; right-pad). GPT-2's
  `scale_attn_weights=False` and `scale_attn_by_inverse_layer_idx=True`
  are folded into the query projection (its kernel and bias are scaled),
  which leaves the attention scores exactly as Hugging Face computes them.

- **Llama, Mistral, Qwen2, Gemma** (`*ForCausalLM`): a `DecoderOnlyLM`
  with RMSNorm, gated feed-forward, rotary positions (with the config's
  `rope_scaling`), grouped-query heads, the family's biases and window
  (`keras_attn/convert/_llama.py` has the mapping).
- **T5** (`T5ForConditionalGeneration`, `T5EncoderModel`): a `Seq2SeqLM`
  with relative position buckets, or a functional encoder
  (`keras_attn/convert/_t5.py` has the mapping).

What the converter cannot represent, it refuses with a ValueError naming
the config field (e.g. `position_embedding_type="relative_key"`,
`add_cross_attention=True`, an unknown `hidden_act`). Every tensor of the
checkpoint must be consumed by the mapping below, else a ValueError lists
the leftovers (an unsupported head, say).

Name mapping (PyTorch `nn.Linear` weights are `(out, in)` and are
transposed; GPT-2's `Conv1D` weights are `(in, out)` and are not; `H`
heads of size `d`, `D = H * d`):

BERT / RoBERTa (prefix `bert.` / `roberta.` in task models):

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

GPT-2 (prefix `transformer.` in `GPT2LMHeadModel`):

| Hugging Face tensor              | keras_attn variable (`DecoderOnlyLM`)                                     |
|----------------------------------|---------------------------------------------------------------------------|
| `wte.weight`                     | `embedding/token_embedding/embeddings` (also the tied output head)        |
| `wpe.weight`                     | `embedding/position_embedding/embeddings`                                 |
| `h.i.ln_1.*`                     | `decoder_i/self_attention_layer_norm/{gamma,beta}`                        |
| `h.i.attn.c_attn.{weight,bias}`  | split in 3 along the output axis: `decoder_i/self_attention/{query,key,value}/{kernel,bias}` |
| `h.i.attn.c_proj.*`              | `decoder_i/self_attention/attention_output/{kernel (H,d,D), bias}`        |
| `h.i.ln_2.*`                     | `decoder_i/feedforward_layer_norm/{gamma,beta}`                           |
| `h.i.mlp.c_fc.*`                 | `decoder_i/feedforward_intermediate_dense/{kernel,bias}`                  |
| `h.i.mlp.c_proj.*`               | `decoder_i/feedforward_output_dense/{kernel,bias}`                        |
| `ln_f.*`                         | `final_norm/{gamma,beta}`                                                 |
| `lm_head.weight`                 | tied: nothing (it is `wte`); untied: `lm_head/kernel` (bias zero)         |

Requires `torch` and `transformers` (the `test` extra); they are imported
only when `from_huggingface` is called.
"""

import math
import os

import keras
import numpy as np

from keras_attn.convert import _llama
from keras_attn.convert import _t5
from keras_attn.convert import _weights
from keras_attn.generation.models import DecoderOnlyLM
from keras_attn.layers import activations
from keras_attn.layers.token_and_position_embedding import TokenAndPositionEmbedding
from keras_attn.layers.transformer_encoder_block import TransformerEncoderBlock

ENCODER_TYPES = ("bert", "roberta", "xlm-roberta")
DECODER_TYPES = ("gpt2",)


def from_huggingface(model_or_local_dir, *, dropout=None):
    """Converts a Hugging Face BERT-, RoBERTa-, GPT-2-, Llama-, Mistral-, Qwen2-, Gemma- or T5-style model.

    Args:
        model_or_local_dir: a `transformers.PreTrainedModel` (PyTorch) or the
            path of a local directory written by `save_pretrained` (only
            local files are read; the class is taken from the config's
            `architectures`).
        dropout: dropout of the converted encoder (embeddings, attention,
            residual branches, classifier head), for fine-tuning; None uses
            the config's `hidden_dropout_prob`. Decoders have none.

    Returns:
        A functional `keras.Model` for encoders (BERT family,
        `T5EncoderModel`), a `DecoderOnlyLM` for decoders, a `Seq2SeqLM` for
        `T5ForConditionalGeneration` (see the module docstring).

    Raises:
        ValueError: a model type, head or config field that keras_attn
            cannot represent, named with its value.
        TypeError: `model_or_local_dir` is neither a model nor a path.

    Example:

    >>> import transformers  # doctest: +SKIP
    >>> hf = transformers.BertModel(transformers.BertConfig(
    ...     vocab_size=100, hidden_size=32, num_hidden_layers=2,
    ...     num_attention_heads=4, intermediate_size=64))  # doctest: +SKIP
    >>> model = from_huggingface(hf)  # doctest: +SKIP
    >>> sorted(model.output_names)  # doctest: +SKIP
    ['last_hidden_state', 'pooler_output']
    """
    hf_model = _load(model_or_local_dir)
    config = hf_model.config
    model_type = getattr(config, "model_type", None)
    state = {k: v.detach().cpu().float().numpy() for k, v in hf_model.state_dict().items()}
    architecture = type(hf_model).__name__
    if model_type in ENCODER_TYPES:
        return _convert_encoder(config, state, architecture, hf_model.base_model_prefix, dropout)
    if model_type in DECODER_TYPES:
        return _convert_gpt2(config, state, architecture, hf_model.base_model_prefix)
    if model_type in _llama.LLAMA_TYPES:
        return _llama.convert_llama_family(config, state, architecture)
    if model_type in _t5.T5_TYPES:
        return _t5.convert_t5(config, state, architecture)
    raise ValueError(
        "Received an unsupported model: `model_type` must be one of "
        f"{list(ENCODER_TYPES + DECODER_TYPES + _llama.LLAMA_TYPES + _t5.T5_TYPES)}. Received: model_type={model_type!r} "
        f"({architecture})"
    )


def _load(model_or_local_dir):
    if isinstance(model_or_local_dir, (str, os.PathLike)):
        path = os.fspath(model_or_local_dir)
        if not os.path.isdir(path):
            raise ValueError(
                "`model_or_local_dir` must be a transformers model or an existing "
                "local directory written by `save_pretrained` (nothing is "
                f"downloaded). Received: model_or_local_dir={path!r}"
            )
        import transformers

        config = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
        names = getattr(config, "architectures", None) or []
        cls = getattr(transformers, names[0], None) if names else None
        if cls is None:
            cls = transformers.AutoModel
        return cls.from_pretrained(path, local_files_only=True)
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is in the test extra
        torch = None
    if torch is not None and isinstance(model_or_local_dir, torch.nn.Module) and hasattr(
        model_or_local_dir, "config"
    ):
        return model_or_local_dir  # only its config and state_dict are read
    raise TypeError(
        "Received an invalid value for argument `model_or_local_dir`, expected a "
        "PyTorch transformers.PreTrainedModel or a local directory path. "
        f"Received: model_or_local_dir={type(model_or_local_dir).__name__}"
    )


def _refuse(field, value, why):
    raise ValueError(
        f"Cannot convert this model: config field `{field}`={value!r} {why}."
    )


def _check_activation(field, value):
    if not isinstance(value, str) or value not in activations.ALIASES:
        _refuse(field, value, f"is not an activation keras_attn maps (supported: {sorted(activations.ALIASES)})")
    return value


# ---------------------------------------------------------------------------
# BERT family


def _check_encoder_config(config):
    position_type = getattr(config, "position_embedding_type", "absolute")
    if position_type not in (None, "absolute"):
        _refuse("position_embedding_type", position_type, "is not supported (only 'absolute')")
    if getattr(config, "is_decoder", False):
        _refuse("is_decoder", True, "(a causal BERT) is not supported; convert encoders")
    if getattr(config, "add_cross_attention", False):
        _refuse("add_cross_attention", True, "is not supported")
    _check_activation("hidden_act", config.hidden_act)
    if config.hidden_size % config.num_attention_heads:
        _refuse("num_attention_heads", config.num_attention_heads, "does not divide hidden_size")


def _convert_encoder(config, state, architecture, prefix, dropout):
    _check_encoder_config(config)
    classify = architecture.endswith("ForSequenceClassification")
    if not (classify or architecture in ("BertModel", "RobertaModel", "XLMRobertaModel")):
        raise ValueError(
            f"Cannot convert {architecture}: supported are the base model and "
            "*ForSequenceClassification. Received: architecture="
            f"{architecture!r}"
        )
    problem = getattr(config, "problem_type", None)
    if classify and problem not in (None, "single_label_classification", "multi_label_classification", "regression"):
        _refuse("problem_type", problem, "is not supported")
    weights = _weights.Weights(state, prefix)
    roberta = config.model_type != "bert"
    hidden = config.hidden_size
    heads = config.num_attention_heads
    rate = config.hidden_dropout_prob if dropout is None else dropout
    offset = config.pad_token_id + 1 if roberta else 0
    positions = config.max_position_embeddings - offset
    if positions <= 0:
        _refuse("max_position_embeddings", config.max_position_embeddings, f"leaves no position after the RoBERTa offset {offset}")
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
            num_heads=heads, intermediate_dim=config.intermediate_size,
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

    def linear(name):
        """An `nn.Linear`: `(kernel (in, out), bias, name)`."""
        return weights.take(name + ".weight").T, weights.take(name + ".bias"), name

    _weights.assign(embedding.token_embedding.embeddings, weights.take("embeddings.word_embeddings.weight"), "word_embeddings")
    _weights.assign(
        embedding.position_embedding.position_embeddings,
        weights.take("embeddings.position_embeddings.weight")[offset:],
        "position_embeddings",
    )
    _weights.assign(embedding.token_type_embedding.embeddings, weights.take("embeddings.token_type_embeddings.weight"), "token_type_embeddings")
    _weights.set_norm(embedding.layer_norm, weights, "embeddings.LayerNorm")
    for i, block in enumerate(blocks):
        p = f"encoder.layer.{i}."
        _weights.set_attention(
            block.self_attention,
            linear(p + "attention.self.query"),
            linear(p + "attention.self.key"),
            linear(p + "attention.self.value"),
            linear(p + "attention.output.dense"),
        )
        _weights.set_norm(block.self_attention_layer_norm, weights, p + "attention.output.LayerNorm")
        _weights.set_dense(block.feedforward_intermediate_dense, *linear(p + "intermediate.dense"))
        _weights.set_dense(block.feedforward_output_dense, *linear(p + "output.dense"))
        _weights.set_norm(block.feedforward_layer_norm, weights, p + "output.LayerNorm")
    if pooler is not None:
        name = "classifier.dense" if roberta and classify else "pooler.dense"
        _weights.set_dense(pooler, *linear(name))
    if classify:
        name = "classifier.out_proj" if roberta else "classifier"
        _weights.set_dense(classifier, *linear(name))
    weights.check_all_used(architecture)
    return model


# ---------------------------------------------------------------------------
# GPT-2 family


def _convert_gpt2(config, state, architecture, prefix):
    if architecture not in ("GPT2Model", "GPT2LMHeadModel"):
        raise ValueError(
            f"Cannot convert {architecture}: supported are GPT2Model and "
            f"GPT2LMHeadModel. Received: architecture={architecture!r}"
        )
    if getattr(config, "add_cross_attention", False):
        _refuse("add_cross_attention", True, "is not supported (decoder-only models only)")
    _check_activation("activation_function", config.activation_function)
    hidden, heads = config.n_embd, config.n_head
    if hidden % heads:
        _refuse("n_head", heads, "does not divide n_embd")
    head_dim = hidden // heads
    weights = _weights.Weights(state, prefix)
    tied = architecture == "GPT2Model" or bool(getattr(config, "tie_word_embeddings", True))
    pad = getattr(config, "pad_token_id", None)
    lm = DecoderOnlyLM(
        config.vocab_size, config.n_positions, hidden, num_layers=config.n_layer,
        num_heads=heads, intermediate_dim=config.n_inner or 4 * hidden,
        position="learned", activation=config.activation_function,
        layer_norm_epsilon=config.layer_norm_epsilon, tie_embeddings=tied,
        mask_padded_queries=False, pad_token_id=0 if pad is None else pad,
        name="gpt2_keras_attn",
    )
    lm(np.zeros((1, 1), "int32"))
    _weights.assign(lm.embedding.token_embedding.embeddings, weights.take("wte.weight"), "wte.weight")
    _weights.assign(lm.embedding.position_embedding.position_embeddings, weights.take("wpe.weight"), "wpe.weight")
    for i, block in enumerate(lm.blocks):
        p = f"h.{i}."
        # HF multiplies q.k by `scaling`; keras_attn always by 1/sqrt(d):
        # the ratio goes into the query projection.
        scaling = head_dim**-0.5 if config.scale_attn_weights else 1.0
        if config.scale_attn_by_inverse_layer_idx:
            scaling /= float(i + 1)
        factor = scaling * math.sqrt(head_dim)
        kernel = weights.take(p + "attn.c_attn.weight")
        bias = weights.take(p + "attn.c_attn.bias")
        name = p + "attn.c_attn"
        q, k, v = (
            (kernel[:, j * hidden : (j + 1) * hidden], bias[j * hidden : (j + 1) * hidden], name)
            for j in range(3)
        )
        q = (q[0] * factor, q[1] * factor, name)
        out = (weights.take(p + "attn.c_proj.weight"), weights.take(p + "attn.c_proj.bias"), p + "attn.c_proj")
        _weights.set_attention(block.self_attention, q, k, v, out)
        _weights.set_norm(block.self_attention_layer_norm, weights, p + "ln_1")
        _weights.set_norm(block.feedforward_layer_norm, weights, p + "ln_2")
        _weights.set_dense(block.feedforward_intermediate_dense, weights.take(p + "mlp.c_fc.weight"), weights.take(p + "mlp.c_fc.bias"), p + "mlp.c_fc")
        _weights.set_dense(block.feedforward_output_dense, weights.take(p + "mlp.c_proj.weight"), weights.take(p + "mlp.c_proj.bias"), p + "mlp.c_proj")
    _weights.set_norm(lm.final_norm, weights, "ln_f")
    if "lm_head.weight" in weights:
        head = weights.take("lm_head.weight")
        if tied:
            if not np.array_equal(head, lm.embedding.token_embedding.embeddings.numpy()):
                _refuse("tie_word_embeddings", True, "but lm_head.weight differs from wte.weight")
        else:
            _weights.assign(lm.lm_head.kernel, head.T, "lm_head.weight")
            lm.lm_head.bias.assign(np.zeros(lm.lm_head.bias.shape, "float32"))
    weights.check_all_used(architecture)
    return lm
