"""Gemma 4 text decoders (`Gemma4ForCausalLM`, model_type "gemma4_text") onto
`DecoderOnlyLM`: the Gemma conversion (`gemma.GemmaConverter`: GeGLU,
`sqrt(hidden)` embedding scale) with what Gemma 4 adds.

- RMSNorms multiply by their weight (not `1 + w` as Gemma 1-3);
- sandwich norms, `layer_types` windows and a final soft cap as Gemma 3;
- QK-norm, and an RMSNorm without scale on each value head
  (`use_value_norm`); attention logits are not scaled (Gemma 4's scaling is
  1): keras_attn scales by `head_dim ** -0.5`, so the query norm's scale is
  multiplied by `sqrt(head_dim)`;
- two rotary embeddings: `rope_parameters["sliding_attention"]` (unscaled)
  on the sliding layers, `rope_parameters["full_attention"]` on the full
  ones, "default" or "proportional" (`partial_rotary_factor`: frequencies
  of the whole head on the first pairs only; `RotaryEmbedding`'s
  `rope_scaling`);
- `attention_k_eq_v`: the full layers' values are their (un-normalised) key
  projections: the key kernel is copied into the value kernel;
- `num_kv_shared_layers`: the last layers attend over the keys and values
  of the last earlier layer of their type (`key_value_sources`);
- the full-attention layers' own head size (`global_head_dim`) and, with
  `attention_k_eq_v`, key/value heads (`num_global_key_value_heads`):
  transformers' `per_layer_config`, as `head_dim` and `num_key_value_heads`
  lists of one value per layer (the query norm's scale then uses the
  layer's head size, and the proportional rotary its frequencies);
- `use_double_wide_mlp`: twice `intermediate_size` on the KV-shared layers
  (an `intermediate_dim` list);
- per-layer input embeddings (`hidden_size_per_layer_input`,
  `vocab_size_per_layer_input`: `per_layer_input_dim`,
  `per_layer_input_vocabulary_size`);
- each layer's output times `layer_scalar` (`use_output_scale`).

`use_bidirectional_attention="vision"` (the larger released models) is
converted: it makes image tokens attend both ways in the multimodal model,
and the text model causal as without it.

Refused by the config field and value: mixture-of-experts blocks
(`enable_moe_block`), `use_bidirectional_attention="all"`, other rotary
types.
The multimodal `Gemma4ForConditionalGeneration` (model_type "gemma4") is
refused by `registry.REFUSED`.

| Hugging Face tensor (prefix `model.`)          | keras_attn variable (`DecoderOnlyLM`)                 |
|------------------------------------------------|-------------------------------------------------------|
| `embed_tokens_per_layer.weight`                | `per_layer_embedding/embeddings`                      |
| `per_layer_model_projection.weight`            | `per_layer_model_projection/kernel`                   |
| `per_layer_projection_norm.weight`             | `per_layer_projection_norm/scale`                     |
| `layers.i.{input,post_attention,pre_feedforward,post_feedforward}_layernorm.weight` | as Gemma 3 (`gemma2.py`), scale `w` |
| `layers.i.self_attn.q_norm.weight`             | `decoder_i/self_attention/query_norm/scale` (w x sqrt(layer i's head_dim)) |
| `layers.i.self_attn.k_norm.weight`             | `decoder_i/self_attention/key_norm/scale`             |
| `layers.i.self_attn.k_proj.*` (`attention_k_eq_v`, full layers) | also `decoder_i/self_attention/value/*` |
| `layers.i.per_layer_input_gate.weight`         | `decoder_i/per_layer_input_gate/kernel`               |
| `layers.i.per_layer_projection.weight`         | `decoder_i/per_layer_input_projection/kernel`         |
| `layers.i.post_per_layer_input_norm.weight`    | `decoder_i/per_layer_input_norm/scale`                |
| `layers.i.layer_scalar`                        | `decoder_i/output_scale`                              |
| (everything else)                              | as Llama (`llama.py`); KV-shared layers have no k/v tensors |
"""

import math

import numpy as np

from keras_attn.convert import common
from keras_attn.convert import gemma
from keras_attn.convert import gemma2
from keras_attn.generation.models import DecoderOnlyLM

_ROPE_TYPES = ("default", "proportional")


class Gemma4Converter(gemma.GemmaConverter):
    soft_capping = True
    # "vision" (the larger released models): image tokens attend both ways
    # in the multimodal model; `Gemma4ForCausalLM` (text) stays causal.
    causal_text_bidirectional = ("vision",)

    def check_config(self):
        super().check_config()
        config = self.config
        if getattr(config, "enable_moe_block", False):
            common.refuse("enable_moe_block", True, "(mixture-of-experts feed-forward blocks) is "
                          "not represented")
        layers = config.num_hidden_layers
        if config.num_kv_shared_layers >= layers:
            common.refuse("num_kv_shared_layers", config.num_kv_shared_layers,
                          f"leaves no layer of the {layers} that projects keys and values")
        heads = config.num_attention_heads
        for i, kv_heads in enumerate(self.layer_sizes("num_key_value_heads")):
            if heads % kv_heads:
                common.refuse("num_global_key_value_heads", kv_heads,
                              f"(of layer {i}, {config.layer_types[i]}) does not divide "
                              f"num_attention_heads={heads}")

    def head_sizes(self):
        # transformers refuses `config.head_dim` / `num_key_value_heads` when
        # they vary per layer; layer 0's here, `model_options` gives each layer's.
        per_layer = self.config.per_layer_config[0]
        return per_layer.num_key_value_heads, per_layer.head_dim

    def layer_sizes(self, field):
        """`head_dim` or `num_key_value_heads` of each layer: transformers'
        `per_layer_config` (the full layers' `global_head_dim` and, with
        `attention_k_eq_v`, `num_global_key_value_heads`)."""
        config = self.config
        return [getattr(config.per_layer_config[i], field) for i in range(config.num_hidden_layers)]

    def intermediate_sizes(self):
        """The feed-forward width of each layer: twice `intermediate_size` on
        the KV-shared layers with `use_double_wide_mlp`."""
        config = self.config
        wide = set(self.shared_layers) if getattr(config, "use_double_wide_mlp", False) else set()
        return [config.intermediate_size * (2 if i in wide else 1)
                for i in range(config.num_hidden_layers)]

    @property
    def shared_layers(self):
        """Indices of the layers that reuse another layer's keys and values."""
        config = self.config
        return list(range(config.num_hidden_layers - config.num_kv_shared_layers,
                          config.num_hidden_layers))

    def key_value_sources(self):
        """`DecoderOnlyLM(key_value_sources=...)`: each KV-shared layer takes
        the last earlier non-shared layer of its type (transformers'
        `kv_sharing_modes`)."""
        shared = self.shared_layers
        if not shared:
            return None
        types = self.config.layer_types
        first = shared[0]
        sources = [None] * len(types)
        for i in shared:
            owners = [j for j in range(first) if types[j] == types[i]]
            if not owners:
                common.refuse("num_kv_shared_layers", self.config.num_kv_shared_layers,
                              f"leaves layer {i} ({types[i]}) no earlier layer of its type")
            sources[i] = owners[-1]
        return sources

    def rope(self):
        """The full-attention layers' rotary base and scaling."""
        params = dict(self.config.rope_parameters["full_attention"])
        kind = params.get("rope_type", "default")
        if kind not in _ROPE_TYPES:
            common.refuse("rope_parameters.full_attention", params,
                          f"has a rope_type keras_attn does not represent (supported: {list(_ROPE_TYPES)})")
        if kind == "default":  # transformers' Gemma 4 ignores partial_rotary_factor here
            return params.get("rope_theta", 10000.0), None
        scaling = {"rope_type": kind,
                   "partial_rotary_factor": params.get("partial_rotary_factor", 1.0),
                   "factor": params.get("factor", 1.0)}
        return params["rope_theta"], scaling

    def model_options(self):
        config = self.config
        options = super().model_options()  # its sizes are replaced per layer below
        local = dict(config.rope_parameters["sliding_attention"])
        if local.get("rope_type", "default") != "default":
            common.refuse("rope_parameters.sliding_attention", local,
                          "scales the local rotary base, which is not represented")
        ple = getattr(config, "hidden_size_per_layer_input", None) or None
        # One value for every layer where they agree, else a list per layer.
        sizes = {"head_dim": self.layer_sizes("head_dim"),
                 "num_key_value_heads": self.layer_sizes("num_key_value_heads"),
                 "intermediate_dim": self.intermediate_sizes()}
        options.update({name: values[0] if len(set(values)) == 1 else values
                        for name, values in sizes.items()})
        options.update(
            use_sandwich_norm=True,
            final_logit_soft_cap=getattr(config, "final_logit_softcapping", None),
            use_qk_norm=True,
            use_value_norm=True,
            use_output_scale=True,
            local_rope_max_wavelength=local.get("rope_theta", 10000.0),
            key_value_sources=self.key_value_sources(),
            per_layer_input_dim=ple,
            per_layer_input_vocabulary_size=config.vocab_size_per_layer_input if ple else None,
        )
        return options

    def norm_scale(self, weight):
        return weight

    def set_attention(self, attention, prefix, key_is_value):
        linear = self.weights.linear
        query, out = linear(prefix + "q_proj"), linear(prefix + "o_proj")
        # This layer's head size: the full layers' is `global_head_dim`.
        query_scale = self.weights.take(prefix + "q_norm.weight") * math.sqrt(attention.key_dim)
        common.set_rms_norm(attention.query_norm, query_scale, prefix + "q_norm.weight")
        if attention.shared_key_value:
            common.set_attention(attention, query, None, None, out)
            return
        key = linear(prefix + "k_proj")
        value = key if key_is_value else linear(prefix + "v_proj")
        common.set_attention(attention, query, key, value, out)
        self.set_norm(attention.key_norm, prefix + "k_norm")

    def set_block(self, block, prefix, key_is_value):
        self.set_attention(block.self_attention, prefix + "self_attn.", key_is_value)
        gemma2.set_norms_and_feedforward(self, block, prefix)
        if block.per_layer_input_dim is not None:
            common.set_dense(block.per_layer_input_gate,
                             *self.weights.linear(prefix + "per_layer_input_gate"))
            common.set_dense(block.per_layer_input_projection,
                             *self.weights.linear(prefix + "per_layer_projection"))
            self.set_norm(block.per_layer_input_norm, prefix + "post_per_layer_input_norm")
        common.assign(block.output_scale, self.weights.take(prefix + "layer_scalar"),
                      prefix + "layer_scalar")

    def convert(self):
        self.check_config()
        config, weights = self.config, self.weights
        lm = DecoderOnlyLM(**self.model_options())
        lm(np.zeros((1, 1), "int32"))
        table = weights.take("model.embed_tokens.weight")
        common.assign(lm.embedding.embeddings, table, "model.embed_tokens.weight")
        if lm.per_layer_embedding is not None:
            name = "model.embed_tokens_per_layer.weight"
            common.assign(lm.per_layer_embedding.embeddings, weights.take(name), name)
            common.set_dense(lm.per_layer_model_projection,
                             *weights.linear("model.per_layer_model_projection"))
            self.set_norm(lm.per_layer_projection_norm, "model.per_layer_projection_norm")
        k_eq_v = bool(getattr(config, "attention_k_eq_v", False))
        for i, block in enumerate(lm.blocks):
            full = config.layer_types[i] != "sliding_attention"
            self.set_block(block, f"model.layers.{i}.", key_is_value=k_eq_v and full)
        self.set_norm(lm.final_norm, "model.norm")
        common.set_lm_head(lm, weights, self.tied, table, "embed_tokens.weight")
        weights.check_all_used(self.checkpoint.architecture)
        return lm


def convert(checkpoint, *, dropout=None):
    """A `DecoderOnlyLM` with the weights and logits of a `Gemma4ForCausalLM`
    (`dropout` is not used: the result has none)."""
    return Gemma4Converter(checkpoint).convert()


FAMILY = common.Family(
    name="Gemma 4",
    model_types=("gemma4_text",),
    architectures=("*ForCausalLM",),
    convert=convert,
)
