"""Phi-3 and Phi-4-mini decoders onto `DecoderOnlyLM`: the Llama conversion
(`llama.LlamaConverter`) with Phi-3's layout and rotary embedding.

- one fused `qkv_proj` (rows: the query heads, then the key heads, then the
  value heads) and one fused `gate_up_proj` (the gate rows, then the up
  rows), split into keras_attn's separate projections;
- `partial_rotary_factor`: the rotary embedding turns only the first
  `int(head_dim * partial_rotary_factor)` features of each head (Phi-4-mini:
  0.75), `RotaryEmbedding(partial_rotary_factor=...)`;
- `rope_scaling` "longrope" (short and long factor lists, switched at
  `original_max_position_embeddings`, and the attention factor that scales
  cos and sin; Hugging Face's default, `sqrt(1 + log(s) / log(n))` with
  `s = max_position_embeddings / n`, is filled in when the config has none);
- `sliding_window`, when set, on every layer.

| Hugging Face tensor (prefix `model.`)  | keras_attn variable (`DecoderOnlyLM`)                                  |
|----------------------------------------|------------------------------------------------------------------------|
| `layers.i.self_attn.qkv_proj.weight`   | `decoder_i/self_attention/{query,key,value}/kernel` (rows split H, H_kv, H_kv heads) |
| `layers.i.mlp.gate_up_proj.weight`     | `decoder_i/feedforward_{gate,intermediate}_dense/kernel` (rows split in halves) |
| (everything else)                      | as Llama (`llama.py`)                                                  |
"""

import math

import numpy as np

from keras_attn.convert import common
from keras_attn.convert import llama

_ROPE_TYPES = llama.ROPE_TYPES + ("longrope",)


class Phi3Converter(llama.LlamaConverter):
    partial_rotary = True

    def sliding_window(self):
        return getattr(self.config, "sliding_window", None)

    def rotary_factor(self):
        config = self.config
        params = getattr(config, "rope_parameters", None) or {}
        return float(params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)) or 1.0)

    def rope(self):
        config = self.config
        theta, scaling = llama.rope(config, rope_types=_ROPE_TYPES)
        if scaling is not None and scaling["rope_type"] == "longrope":
            original = scaling.get("original_max_position_embeddings") or getattr(
                config, "original_max_position_embeddings", None
            )
            if not original:
                common.refuse("original_max_position_embeddings", original, "is needed by 'longrope'")
            factor = scaling.get("factor") or config.max_position_embeddings / original
            attention = scaling.get("attention_factor")
            if attention is None:
                attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
            scaling = dict(
                rope_type="longrope", short_factor=list(scaling["short_factor"]),
                long_factor=list(scaling["long_factor"]),
                original_max_position_embeddings=original, attention_factor=attention,
            )
        return theta, scaling

    def model_options(self):
        options = super().model_options()
        options["partial_rotary_factor"] = self.rotary_factor()
        return options

    def set_attention(self, attention, prefix):
        config = self.config
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        kernel, bias, name = self.weights.linear(prefix + "qkv_proj")
        if bias is not None:
            common.refuse("qkv_proj.bias", "present", "is not represented (Phi-3 has none)")
        q, k = heads * head_dim, (heads + kv_heads) * head_dim
        common.set_attention(
            attention, (kernel[:, :q], None, name + "[query]"), (kernel[:, q:k], None, name + "[key]"),
            (kernel[:, k:], None, name + "[value]"), self.weights.linear(prefix + "o_proj"),
        )

    def set_block(self, block, prefix):
        self.set_attention(block.self_attention, prefix + "self_attn.")
        self.set_norm(block.self_attention_layer_norm, prefix + "input_layernorm")
        self.set_norm(block.feedforward_layer_norm, prefix + "post_attention_layernorm")
        kernel, bias, name = self.weights.linear(prefix + "mlp.gate_up_proj")
        if bias is not None:
            common.refuse("gate_up_proj.bias", "present", "is not represented (Phi-3 has none)")
        half = kernel.shape[1] // 2
        common.set_dense(block.feedforward_gate_dense, kernel[:, :half], None, name + "[gate]")
        common.set_dense(block.feedforward_intermediate_dense, kernel[:, half:], None, name + "[up]")
        common.set_dense(block.feedforward_output_dense, *self.weights.linear(prefix + "mlp.down_proj"))


class Phi3Writer(llama.LlamaWriter):
    """A `DecoderOnlyLM` (partial rotary, "longrope" allowed) as a
    `Phi3ForCausalLM`: q/k/v fused into `qkv_proj`, gate and up into
    `gate_up_proj`."""

    architectures = {"phi3": "Phi3ForCausalLM"}
    free = ("partial_rotary_factor",)

    def check_biases(self):
        options = self.options
        for option in ("attention_use_bias", "attention_output_use_bias", "feedforward_use_bias"):
            if options[option]:
                self.refuse(option, "is not expressed by its config (Phi-3 has no biases)")

    def window_fields(self):
        window = self.options["sliding_window"]
        if isinstance(window, list):
            self.refuse("sliding_window", "varies per layer (Phi-3 has one window)")
        return dict(sliding_window=window)

    def rope_fields(self):
        options = self.options
        params = dict(options["rope_scaling"] or {"rope_type": "default"},
                      rope_theta=options["rope_max_wavelength"],
                      partial_rotary_factor=options["partial_rotary_factor"])
        fields = dict(rope_parameters=params, partial_rotary_factor=options["partial_rotary_factor"])
        if "original_max_position_embeddings" in params:
            # The model keeps it as a float; the config field is an int.
            params["original_max_position_embeddings"] = int(params["original_max_position_embeddings"])
            fields["original_max_position_embeddings"] = params["original_max_position_embeddings"]
        return fields

    def family_fields(self):
        return {}

    def projection_tensors(self):
        for i, block in enumerate(self.lm.blocks):
            attention, prefix = block.self_attention, f"model.layers.{i}."
            qkv = [llama.to_numpy(layer.kernel) for layer in
                   (attention.query_dense, attention.key_dense, attention.value_dense)]
            # `(D, H, d)` kernels flattened to `(D, H * d)`, rows of the fused `(out, in)`.
            fused = np.concatenate([kernel.reshape(kernel.shape[0], -1) for kernel in qkv], axis=1)
            yield prefix + "self_attn.qkv_proj.weight", np.ascontiguousarray(fused.T)
            yield from llama.linear_tensors(prefix + "self_attn.o_proj", attention.output_dense)
            gate_up = np.concatenate([llama.to_numpy(block.feedforward_gate_dense.kernel),
                                      llama.to_numpy(block.feedforward_intermediate_dense.kernel)], axis=1)
            yield prefix + "mlp.gate_up_proj.weight", np.ascontiguousarray(gate_up.T)
            yield from llama.linear_tensors(prefix + "mlp.down_proj", block.feedforward_output_dense)


def convert(checkpoint, *, dropout=None):
    """A `DecoderOnlyLM` with the weights and logits of a `Phi3ForCausalLM`
    (Phi-3, Phi-3.5-mini, Phi-4-mini; `dropout` is not used: the result has
    none)."""
    return Phi3Converter(checkpoint).convert()


FAMILY = common.Family(
    name="Phi-3",
    model_types=("phi3",),
    architectures=("*ForCausalLM",),
    convert=convert,
)
