"""GPT-2-family decoders onto `keras_attn.generation.DecoderOnlyLM`.

Learned positions, pre-norm blocks, the config's `activation_function` and
`layer_norm_epsilon`, a head tied to the token table without bias (an
untied `lm_head` becomes a `Dense` with a zero bias). `call(token_ids,
padding_mask)` gives the logits of `GPT2LMHeadModel` (padding masks keys
only; right-pad). GPT-2's `scale_attn_weights=False` and
`scale_attn_by_inverse_layer_idx=True` are folded into the query projection
(its kernel and bias are scaled), which leaves the attention scores exactly
as Hugging Face computes them.

Tensor names (prefix `transformer.` in `GPT2LMHeadModel`; `Conv1D` weights
are `(in, out)` and are not transposed):

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
"""

import math

import keras

from keras_attn.convert import common
from keras_attn.generation.models import DecoderOnlyLM


def _conv1d(weights, name):
    """A GPT-2 `Conv1D`: `(kernel (in, out), bias, name)`, not transposed."""
    return weights.take(name + ".weight"), weights.take(name + ".bias"), name


def convert(checkpoint, *, dropout=None):
    """A `DecoderOnlyLM` with the weights and logits of `GPT2Model` /
    `GPT2LMHeadModel` (`dropout` is not used: the result has none)."""
    config, architecture = checkpoint.config, checkpoint.architecture
    if getattr(config, "add_cross_attention", False):
        common.refuse("add_cross_attention", True, "is not supported (decoder-only models only)")
    common.mapped_activation("activation_function", config.activation_function)
    hidden, heads = config.n_embd, config.n_head
    if hidden % heads:
        common.refuse("n_head", heads, "does not divide n_embd")
    head_dim = hidden // heads
    weights = common.Weights(checkpoint.tensors, "transformer")
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
    lm(keras.KerasTensor((1, 1), dtype="int32"))
    table = weights.take("wte.weight")
    common.assign(lm.embedding.token_embedding.embeddings, table, "wte.weight")
    common.set_lm_head(lm, weights, tied, table, "wte.weight", untied_bias=True)
    del table  # checked against the head: not held through the blocks
    common.assign(lm.embedding.position_embedding.position_embeddings, weights.take("wpe.weight"), "wpe.weight")
    for i, block in enumerate(lm.blocks):
        p = f"h.{i}."
        # HF multiplies q.k by `scaling`; keras_attn always by 1/sqrt(d):
        # the ratio goes into the query projection.
        scaling = head_dim**-0.5 if config.scale_attn_weights else 1.0
        if config.scale_attn_by_inverse_layer_idx:
            scaling /= float(i + 1)
        factor = scaling * math.sqrt(head_dim)
        kernel, bias, name = _conv1d(weights, p + "attn.c_attn")
        q, k, v = (
            (kernel[:, j * hidden : (j + 1) * hidden], bias[j * hidden : (j + 1) * hidden], name)
            for j in range(3)
        )
        q = (q[0] * factor, q[1] * factor, name)
        common.set_attention(block.self_attention, q, k, v, _conv1d(weights, p + "attn.c_proj"))
        common.set_norm(block.self_attention_layer_norm, weights, p + "ln_1")
        common.set_norm(block.feedforward_layer_norm, weights, p + "ln_2")
        common.set_dense(block.feedforward_intermediate_dense, *_conv1d(weights, p + "mlp.c_fc"))
        common.set_dense(block.feedforward_output_dense, *_conv1d(weights, p + "mlp.c_proj"))
    common.set_norm(lm.final_norm, weights, "ln_f")
    weights.check_all_used(architecture)
    return lm


FAMILY = common.Family(
    name="GPT-2",
    model_types=("gpt2",),
    architectures=("GPT2Model", "GPT2LMHeadModel"),
    convert=convert,
)
