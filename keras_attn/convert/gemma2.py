"""Gemma 2 and Gemma 3 (text) decoders onto `DecoderOnlyLM`: the Gemma
conversion (`gemma.GemmaConverter`: GeGLU, `sqrt(hidden)` embedding scale,
RMSNorm scale `1 + w`) with what Gemma 2 and 3 add.

- sandwich norms (`use_sandwich_norm`): a norm before and after both the
  attention and the feed-forward branch;
- `layer_types`: "sliding_attention" layers see the last `sliding_window`
  tokens (ring-buffer caches), "full_attention" layers every token;
- logits scaled by `query_pre_attn_scalar ** -0.5` instead of
  `head_dim ** -0.5`: keras_attn scales by `head_dim ** -0.5`, so the query
  is multiplied by `sqrt(head_dim / query_pre_attn_scalar)` (in the query
  kernel for Gemma 2, in the query norm's scale for Gemma 3, whose query
  is normalised after the projection);
- attention-logit and final-logit soft-capping (`attn_logit_softcapping`,
  `final_logit_softcapping`: `cap * tanh(x / cap)`); Gemma 3 applies only
  the final one (its attention ignores `attn_logit_softcapping`);
- Gemma 3: an RMSNorm over each query and key head (`use_qk_norm`), and two
  rotary bases: `rope_parameters["sliding_attention"]` (`rope_local_base_freq`,
  unscaled) on the sliding layers, `rope_parameters["full_attention"]`
  (`rope_theta` with its `rope_scaling`) on the full ones.

Gemma 3's text model without a head (`Gemma3TextModel`, the backbone of
EmbeddingGemma) becomes a functional encoder (`Gemma3EncoderConverter`):
int32 `input_ids` and `attention_mask` (1 = token, 0 = padding) in,
`last_hidden_state` `(B, T, D)` out, the same blocks as a
`TransformerEncoderBlock` stack. With `use_bidirectional_attention=True`
(EmbeddingGemma) nothing is causal: full layers see every token, sliding
layers a symmetric band. transformers' config turns the checkpoint's
`sliding_window` `w` into `w // 2 + 1` and its band is `|i - j| < w // 2 + 1`,
which is keras_attn's `sliding_window=w // 2 + 1`. Without it, the encoder
is causal (the decoder's last hidden state). Padding masks keys only.

Gemma 3's multimodal `Gemma3ForConditionalGeneration` (model_type "gemma3")
and Gemma 3n are refused by `registry.REFUSED`.

| Hugging Face tensor (prefix `model.`)          | keras_attn variable (`DecoderOnlyLM`)                 |
|------------------------------------------------|-------------------------------------------------------|
| `layers.i.input_layernorm.weight`              | `decoder_i/self_attention_layer_norm/scale` (1 + w)   |
| `layers.i.post_attention_layernorm.weight`     | `decoder_i/self_attention_post_norm/scale` (1 + w)    |
| `layers.i.pre_feedforward_layernorm.weight`    | `decoder_i/feedforward_layer_norm/scale` (1 + w)      |
| `layers.i.post_feedforward_layernorm.weight`   | `decoder_i/feedforward_post_norm/scale` (1 + w)       |
| `layers.i.self_attn.q_proj.weight`             | `decoder_i/self_attention/query/kernel` (Gemma 2: x sqrt(head_dim / query_pre_attn_scalar)) |
| `layers.i.self_attn.q_norm.weight` (Gemma 3)   | `decoder_i/self_attention/query_norm/scale` ((1 + w) x sqrt(head_dim / query_pre_attn_scalar)) |
| `layers.i.self_attn.k_norm.weight` (Gemma 3)   | `decoder_i/self_attention/key_norm/scale` (1 + w)     |
| (everything else)                              | as Llama (`llama.py`)                                 |
"""

import math

from keras_attn.convert import common
from keras_attn.convert import gemma
from keras_attn.convert import llama


class Gemma2Converter(gemma.GemmaConverter):
    soft_capping = True

    @property
    def gemma3(self):
        return self.model_type == "gemma3_text"

    @property
    def query_factor(self):
        """`sqrt(head_dim / query_pre_attn_scalar)`: turns keras_attn's
        `head_dim ** -0.5` logit scale into Gemma's."""
        config = self.config
        return math.sqrt(config.head_dim / config.query_pre_attn_scalar)

    def model_options(self):
        config = self.config
        options = super().model_options()
        options.update(
            use_sandwich_norm=True,
            # Gemma 3 keeps the field but its attention does not cap (transformers' Gemma3Attention).
            attention_logit_soft_cap=None if self.gemma3 else getattr(config, "attn_logit_softcapping", None),
            final_logit_soft_cap=getattr(config, "final_logit_softcapping", None),
        )
        if self.gemma3:
            params = config.rope_parameters
            local_theta, local_scaling = llama.rope(config, params["sliding_attention"])
            if local_scaling is not None:
                common.refuse("rope_parameters.sliding_attention", params["sliding_attention"],
                              "scales the local rotary base, which is not represented")
            options.update(use_qk_norm=True, local_rope_max_wavelength=local_theta)
        return options

    def rope(self):
        """Gemma 3: the full-attention layers' base and scaling (the sliding
        layers' base is `local_rope_max_wavelength`)."""
        if self.gemma3:
            return llama.rope(self.config, self.config.rope_parameters["full_attention"])
        return super().rope()

    def set_attention(self, attention, prefix):
        linear = self.weights.linear
        kernel, bias, name = linear(prefix + "q_proj")
        if not self.gemma3:
            kernel = kernel * self.query_factor
        common.set_attention(
            attention, (kernel, bias, name), linear(prefix + "k_proj"),
            linear(prefix + "v_proj"), linear(prefix + "o_proj"),
        )
        if self.gemma3:
            scale = self.norm_scale(self.weights.take(prefix + "q_norm.weight"))
            common.set_rms_norm(attention.query_norm, scale * self.query_factor, prefix + "q_norm.weight")
            self.set_norm(attention.key_norm, prefix + "k_norm")

    def set_block(self, block, prefix):
        self.set_attention(block.self_attention, prefix + "self_attn.")
        set_norms_and_feedforward(self, block, prefix)


class Gemma2Writer(gemma.GemmaWriter):
    """A `DecoderOnlyLM` with sandwich norms as a `Gemma2ForCausalLM` or
    (`gemma3_text`, with query/key norms and a local rotary base) a
    `Gemma3ForCausalLM`. The logit scale keras_attn applies, `head_dim ** -0.5`,
    is Gemma's with `query_pre_attn_scalar = head_dim`: the converter's
    factor folded into the query kernel (norm) stays there, and reads back as 1."""

    architectures = {"gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM"}

    @property
    def gemma3(self):
        return self.model_type == "gemma3_text"

    @property
    def required(self):
        return dict(super().required, use_sandwich_norm=True, use_qk_norm=self.gemma3)

    @property
    def free(self):
        # Gemma 3's attention does not cap its logits.
        if self.gemma3:
            return ("final_logit_soft_cap", "local_rope_max_wavelength")
        return ("final_logit_soft_cap", "attention_logit_soft_cap")

    def window_fields(self):
        fields = self.layer_windows()
        if fields["sliding_window"] is None:
            # Every layer full: transformers still builds a sliding mask, of any size.
            fields["sliding_window"] = self.options["sequence_length"]
        return fields

    def rope_fields(self):
        if not self.gemma3:
            return super().rope_fields()
        options = self.options
        theta, scaling, local = (options["rope_max_wavelength"], options["rope_scaling"],
                                 options["local_rope_max_wavelength"])
        if local is None:
            if scaling is not None:
                self.refuse("local_rope_max_wavelength", "must be set when `rope_scaling` is "
                            "(Gemma 3's sliding layers rotate unscaled)")
            local = theta
        return dict(rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": theta, **(scaling or {})},
            "sliding_attention": {"rope_type": "default", "rope_theta": local},
        })

    def family_fields(self):
        options = self.options
        return dict(super().family_fields(), query_pre_attn_scalar=self.head_dim,
                    attn_logit_softcapping=options["attention_logit_soft_cap"],
                    final_logit_softcapping=options["final_logit_soft_cap"])

    def norms(self, block):
        norms = {"input_layernorm": block.self_attention_layer_norm,
                 "post_attention_layernorm": block.self_attention_post_norm,
                 "pre_feedforward_layernorm": block.feedforward_layer_norm,
                 "post_feedforward_layernorm": block.feedforward_post_norm}
        if self.gemma3:
            norms.update({"self_attn.q_norm": block.self_attention.query_norm,
                          "self_attn.k_norm": block.self_attention.key_norm})
        return norms


class Gemma3EncoderConverter(llama.EncoderConverter, Gemma2Converter):
    """A `Gemma3TextModel` (no head) into a functional encoder of
    `TransformerEncoderBlock`s: bidirectional with
    `use_bidirectional_attention=True`, else causal."""


def set_norms_and_feedforward(converter, block, prefix):
    """The sandwich norms (before and after attention and feed-forward) and
    the gated feed-forward of a Gemma 2/3/4 block, by `converter.set_norm`."""
    for norm, name in (
        (block.self_attention_layer_norm, "input_layernorm"),
        (block.self_attention_post_norm, "post_attention_layernorm"),
        (block.feedforward_layer_norm, "pre_feedforward_layernorm"),
        (block.feedforward_post_norm, "post_feedforward_layernorm"),
    ):
        converter.set_norm(norm, prefix + name)
    for dense, name in (
        (block.feedforward_gate_dense, "mlp.gate_proj"),
        (block.feedforward_intermediate_dense, "mlp.up_proj"),
        (block.feedforward_output_dense, "mlp.down_proj"),
    ):
        common.set_dense(dense, *converter.weights.linear(prefix + name))


def convert(checkpoint, *, dropout=None):
    """A `DecoderOnlyLM` with the weights and logits of a `Gemma2ForCausalLM`
    or `Gemma3ForCausalLM`, or the functional encoder of a `Gemma3TextModel`
    (`dropout` is not used: the result has none)."""
    if checkpoint.architecture == "Gemma3TextModel":
        return Gemma3EncoderConverter(checkpoint).convert()
    return Gemma2Converter(checkpoint).convert()


FAMILY = common.Family(
    name="Gemma 2/3",
    model_types=("gemma2", "gemma3_text"),
    architectures=("*ForCausalLM", "Gemma3TextModel"),
    convert=convert,
)
