"""T5 (v1.0 and v1.1) onto keras_attn: `T5ForConditionalGeneration` into a
`Seq2SeqLM`, `T5EncoderModel` into a functional encoder.

T5 is a pre-norm encoder-decoder with RMSNorm (no bias), no biases anywhere,
one token table shared by encoder, decoder and (v1.0) the head, and a
bucketed relative position bias owned by the first layer of each stack and
used by all of them. Its attention does not scale logits by 1/sqrt(d_kv);
keras_attn always does, so the query kernels are multiplied by sqrt(d_kv).
A tied head multiplies the decoder output by d_model**-0.5 first: folded
into the decoder's final norm scale.

| Hugging Face tensor                                         | keras_attn variable                                |
|-------------------------------------------------------------|----------------------------------------------------|
| `shared.weight` (= `{encoder,decoder}.embed_tokens.weight`)  | `encoder_embedding/embeddings` (shared)           |
| `encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight` | `encoder_relative_position_bias/embeddings` |
| `encoder.block.i.layer.0.layer_norm.weight`                 | `encoder_i/self_attention_layer_norm/scale`        |
| `encoder.block.i.layer.0.SelfAttention.{q,k,v,o}.weight`    | `encoder_i/self_attention/{query (x sqrt d_kv),key,value,attention_output}/kernel` |
| `encoder.block.i.layer.1.layer_norm.weight`                 | `encoder_i/feedforward_layer_norm/scale`           |
| `encoder.block.i.layer.1.DenseReluDense.wi.weight` (v1.0)   | `encoder_i/feedforward_intermediate_dense/kernel`  |
| `...DenseReluDense.wi_0` / `wi_1` (gated, v1.1)             | `feedforward_gate_dense` / `feedforward_intermediate_dense` |
| `...DenseReluDense.wo.weight`                               | `feedforward_output_dense/kernel`                  |
| `encoder.final_layer_norm.weight`                           | `encoder_norm/scale`                               |
| `decoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight` | `decoder_relative_position_bias/embeddings` |
| `decoder.block.i.layer.0.*` / `layer.1.EncDecAttention.*` + `layer.1.layer_norm` / `layer.2.*` | `decoder_i/self_attention*` / `cross_attention*` / `feedforward*` |
| `decoder.final_layer_norm.weight`                           | `final_norm/scale` (x d_model**-0.5 when the head is scaled) |
| `lm_head.weight`                                            | tied: checked equal to `shared`; else `lm_head/kernel` |
"""

import math

import keras
import numpy as np

from keras_attn.convert import common
from keras_attn.generation.models import Seq2SeqLM
from keras_attn.layers.relative_position_bias import RelativePositionBias
from keras_attn.layers.reversible_embedding import ReversibleEmbedding
from keras_attn.layers.transformer_encoder_block import TransformerEncoderBlock

def _feedforward(config):
    """`(activation, gated)` from `feed_forward_proj` ("relu", "gated-gelu", ...)."""
    gated = bool(getattr(config, "is_gated_act", False))
    act = getattr(config, "dense_act_fn", None) or config.feed_forward_proj.split("-")[-1]
    if act == "gelu" and gated:
        act = "gelu_new"  # T5 v1.1's "gated-gelu" is the tanh approximation
    return common.mapped_activation("feed_forward_proj", config.feed_forward_proj, act), gated


def _block_options(config):
    act, gated = _feedforward(config)
    return dict(
        num_heads=config.num_heads, key_dim=config.d_kv, intermediate_dim=config.d_ff,
        activation=act, use_gated_feedforward=gated, normalize_first=True,
        normalization="rms_norm", layer_norm_epsilon=config.layer_norm_epsilon,
        attention_use_bias=False, feedforward_use_bias=False, mask_padded_queries=False,
    )


def _set_attention(attention, weights, prefix, d_kv):
    kernel, bias, name = weights.linear(prefix + ".q")
    # T5 does not scale logits: undo keras_attn's 1/sqrt(d_kv) in the query.
    q = (kernel * math.sqrt(d_kv), bias, name)
    common.set_attention(
        attention, q, weights.linear(prefix + ".k"), weights.linear(prefix + ".v"),
        weights.linear(prefix + ".o"),
    )


def _set_feedforward(block, weights, prefix, gated):
    common.set_rms_norm(block.feedforward_layer_norm, weights.take(prefix + ".layer_norm.weight"), prefix)
    dense = prefix + ".DenseReluDense"
    if gated:
        common.set_dense(block.feedforward_gate_dense, *weights.linear(dense + ".wi_0"))
        common.set_dense(block.feedforward_intermediate_dense, *weights.linear(dense + ".wi_1"))
    else:
        common.set_dense(block.feedforward_intermediate_dense, *weights.linear(dense + ".wi"))
    common.set_dense(block.feedforward_output_dense, *weights.linear(dense + ".wo"))


# The attention sub-layers of a block, in order: (keras_attn layer, T5 module).
_ENCODER_ATTENTION = (("self_attention", "SelfAttention"),)
_DECODER_ATTENTION = _ENCODER_ATTENTION + (("cross_attention", "EncDecAttention"),)


def _set_stack(weights, config, stack, blocks, bias_layer, attention):
    """One stack (`"encoder"` / `"decoder"`): the relative bias owned by its
    first block, then each block's `layer.j` attention sub-layers (`attention`)
    and the feed-forward after them."""
    gated = _feedforward(config)[1]
    bias_name = f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight"
    common.assign(bias_layer.embeddings, weights.take(bias_name), bias_name)
    for i, block in enumerate(blocks):
        p = f"{stack}.block.{i}.layer."
        for j, (ours, theirs) in enumerate(attention):
            norm = getattr(block, ours + "_layer_norm")
            common.set_rms_norm(norm, weights.take(f"{p}{j}.layer_norm.weight"), f"{p}{j}")
            _set_attention(getattr(block, ours), weights, f"{p}{j}.{theirs}", config.d_kv)
        _set_feedforward(block, weights, f"{p}{len(attention)}", gated)


def _set_encoder(blocks, bias_layer, final_norm, weights, config):
    _set_stack(weights, config, "encoder", blocks, bias_layer, _ENCODER_ATTENTION)
    common.set_rms_norm(final_norm, weights.take("encoder.final_layer_norm.weight"), "encoder.final_layer_norm")


def _shared_table(weights, stacks):
    table = weights.take("shared.weight")
    for stack in stacks:
        name = f"{stack}.embed_tokens.weight"
        if name in weights and not np.array_equal(weights.take(name), table):
            common.refuse(f"{stack}.embed_tokens", "untied", "(a table other than `shared`) is not represented")
    return table


def convert(checkpoint, *, dropout=None):
    """A `Seq2SeqLM` (`T5ForConditionalGeneration`) or a functional encoder
    (`T5EncoderModel`) with the checkpoint's weights (`dropout` is not used:
    the result has none)."""
    config, architecture = checkpoint.config, checkpoint.architecture
    if getattr(config, "is_decoder", False):
        common.refuse("is_decoder", True, "is not supported")
    weights = common.Weights(checkpoint.tensors)
    if architecture == "T5EncoderModel":
        return _convert_encoder(config, weights, architecture)
    options = _block_options(config)
    tied = bool(getattr(config, "tie_word_embeddings", True))
    scaled = bool(getattr(config, "scale_decoder_outputs", tied))
    lm = Seq2SeqLM(
        config.vocab_size, 512, config.d_model, num_layers=config.num_layers,
        num_decoder_layers=config.num_decoder_layers or config.num_layers,
        num_heads=config.num_heads, intermediate_dim=config.d_ff, head_dim=config.d_kv,
        position="relative", share_embeddings=True, tie_embeddings=tied,
        relative_attention_num_buckets=config.relative_attention_num_buckets,
        relative_attention_max_distance=config.relative_attention_max_distance,
        activation=options["activation"], use_gated_feedforward=options["use_gated_feedforward"],
        normalization="rms_norm", layer_norm_epsilon=config.layer_norm_epsilon,
        attention_use_bias=False, feedforward_use_bias=False, lm_head_use_bias=False,
        mask_padded_queries=False, pad_token_id=config.pad_token_id or 0,
        name="t5_keras_attn",
    )
    lm((keras.KerasTensor((1, 2), dtype="int32"), keras.KerasTensor((1, 1), dtype="int32")))
    table = _shared_table(weights, ("encoder", "decoder"))
    common.assign(lm.encoder_embedding.embeddings, table, "shared.weight")
    common.set_lm_head(lm, weights, tied, table, "shared.weight")
    del table  # checked against the head: not held through the blocks
    _set_encoder(lm.encoder_blocks, lm.encoder_position_bias, lm.encoder_norm, weights, config)
    _set_stack(weights, config, "decoder", lm.blocks, lm.position_bias, _DECODER_ATTENTION)
    final = weights.take("decoder.final_layer_norm.weight")
    # T5 scales the decoder output by d_model**-0.5 before the head (tied
    # models): a scalar, folded into the final norm's scale.
    if scaled:
        final = final * config.d_model**-0.5
    common.set_rms_norm(lm.final_norm, final, "decoder.final_layer_norm.weight")
    weights.check_all_used(architecture)
    return lm


def _convert_encoder(config, weights, architecture):
    input_ids = keras.Input((None,), dtype="int32", name="input_ids")
    attention_mask = keras.Input((None,), dtype="int32", name="attention_mask")
    embedding = ReversibleEmbedding(config.vocab_size, config.d_model, name="embedding")
    bias_layer = RelativePositionBias(
        config.num_heads, config.relative_attention_num_buckets,
        config.relative_attention_max_distance, bidirectional=True,
        name="encoder_relative_position_bias",
    )
    x = embedding(input_ids)
    bias = bias_layer(x)
    padding_mask = keras.ops.not_equal(attention_mask, 0)
    blocks = []
    for i in range(config.num_layers):
        block = TransformerEncoderBlock(name=f"encoder_{i}", **_block_options(config))
        x = block(x, padding_mask=padding_mask, attention_bias=bias)
        blocks.append(block)
    norm = keras.layers.RMSNormalization(epsilon=config.layer_norm_epsilon, name="encoder_norm")
    output = keras.layers.Identity(name="last_hidden_state")(norm(x))
    model = keras.Model([input_ids, attention_mask], output, name="t5_encoder_keras_attn")
    table = _shared_table(weights, ("encoder",))
    common.assign(embedding.embeddings, table, "shared.weight")
    _set_encoder(blocks, bias_layer, norm, weights, config)
    weights.check_all_used(architecture)
    return model


FAMILY = common.Family(
    name="T5",
    model_types=("t5",),
    architectures=("T5ForConditionalGeneration", "T5EncoderModel"),
    convert=convert,
)
