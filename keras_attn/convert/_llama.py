"""Llama-style decoders (Llama, Mistral, Qwen2, Gemma) onto `DecoderOnlyLM`.

All four are the same network with different switches: pre-norm blocks with
RMSNorm, a gated feed-forward (SwiGLU; Gemma: GeGLU with tanh-GELU), rotary
positions on grouped-query heads, no biases except where the config asks
(Llama's `attention_bias`/`mlp_bias`, Qwen2's biased q/k/v). The switches
map onto `DecoderOnlyLM` options; a config field the result would not honour
is refused by name.

| Hugging Face tensor (prefix `model.`)       | keras_attn variable (`DecoderOnlyLM`)                    |
|---------------------------------------------|----------------------------------------------------------|
| `embed_tokens.weight`                       | `embedding/embeddings` (also the tied head)              |
| `layers.i.input_layernorm.weight`           | `decoder_i/self_attention_layer_norm/scale` (Gemma: 1 + w) |
| `layers.i.self_attn.{q,k,v}_proj.*`         | `decoder_i/self_attention/{query,key,value}/*`           |
| `layers.i.self_attn.o_proj.*`               | `decoder_i/self_attention/attention_output/*`            |
| `layers.i.post_attention_layernorm.weight`  | `decoder_i/feedforward_layer_norm/scale` (Gemma: 1 + w)  |
| `layers.i.mlp.gate_proj.*`                  | `decoder_i/feedforward_gate_dense/*`                     |
| `layers.i.mlp.up_proj.*`                    | `decoder_i/feedforward_intermediate_dense/*`             |
| `layers.i.mlp.down_proj.*`                  | `decoder_i/feedforward_output_dense/*`                   |
| `norm.weight`                               | `final_norm/scale` (Gemma: 1 + w)                        |
| `lm_head.weight` (no prefix)                | `lm_head/kernel` (untied), else checked equal to the table |
"""

import numpy as np

from keras_attn.convert import _weights
from keras_attn.generation.models import DecoderOnlyLM
from keras_attn.layers import activations

LLAMA_TYPES = ("llama", "mistral", "qwen2", "gemma")
_ROPE_TYPES = ("default", "linear", "dynamic", "llama3")


def _refuse(field, value, why):
    raise ValueError(f"Cannot convert this model: config field `{field}`={value!r} {why}.")


def _rope(config):
    """`(rope_theta, rope_scaling or None)` from `rope_parameters` (transformers
    >= 5) or the older `rope_theta` / `rope_scaling` fields."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    legacy = getattr(config, "rope_scaling", None)
    if not params and legacy:
        params = dict(legacy)
    theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in _ROPE_TYPES:
        _refuse("rope_scaling", params, f"has a rope_type keras_attn does not represent (supported: {list(_ROPE_TYPES)})")
    if kind == "default":
        return theta, None
    scaling = {k: v for k, v in params.items() if k not in ("rope_theta", "type")}
    scaling["rope_type"] = kind
    if kind == "dynamic":
        scaling.setdefault("original_max_position_embeddings", config.max_position_embeddings)
    if kind == "llama3":
        scaling.setdefault("original_max_position_embeddings", config.max_position_embeddings)
    for key in ("attention_factor", "mscale", "mscale_all_dim", "beta_fast", "beta_slow"):
        if scaling.get(key) not in (None, 1.0):
            _refuse(f"rope_scaling.{key}", scaling[key], "is not represented")
        scaling.pop(key, None)
    return theta, scaling


def _check_config(config, architecture):
    model_type = config.model_type
    if not architecture.endswith("ForCausalLM"):
        raise ValueError(
            f"Cannot convert {architecture}: for model_type={model_type!r} supported is "
            f"the *ForCausalLM model. Received: architecture={architecture!r}"
        )
    if getattr(config, "partial_rotary_factor", 1.0) not in (None, 1.0):
        _refuse("partial_rotary_factor", config.partial_rotary_factor, "is not represented (rotary on every feature only)")
    if getattr(config, "pretraining_tp", 1) not in (None, 1):
        _refuse("pretraining_tp", config.pretraining_tp, "is not supported")
    if getattr(config, "use_bidirectional_attention", None):
        _refuse("use_bidirectional_attention", True, "is not supported (causal decoders only)")
    if getattr(config, "attn_logit_softcapping", None) or getattr(config, "final_logit_softcapping", None):
        _refuse("attn_logit_softcapping", config.attn_logit_softcapping, "is not supported")
    if model_type == "qwen2":
        layer_types = getattr(config, "layer_types", None) or []
        if getattr(config, "use_sliding_window", False) or "sliding_attention" in layer_types:
            _refuse("use_sliding_window", getattr(config, "use_sliding_window", None),
                    "(sliding windows on some layers only, from `max_window_layers`) is not represented")
    act = getattr(config, "hidden_act", None)
    if model_type == "gemma":
        act = getattr(config, "hidden_activation", None) or act
    if not isinstance(act, str) or act not in activations.ALIASES:
        _refuse("hidden_act", act, f"is not an activation keras_attn maps (supported: {sorted(activations.ALIASES)})")
    return act


def convert_llama_family(config, state, architecture):
    """A `DecoderOnlyLM` with the weights and logits of a Llama-family `*ForCausalLM`."""
    model_type = config.model_type
    activation = _check_config(config, architecture)
    hidden, heads = config.hidden_size, config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if heads % kv_heads:
        _refuse("num_key_value_heads", kv_heads, f"does not divide num_attention_heads={heads}")
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    theta, scaling = _rope(config)
    gemma = model_type == "gemma"
    qwen2 = model_type == "qwen2"
    attention_bias = True if qwen2 else bool(getattr(config, "attention_bias", False))
    window = getattr(config, "sliding_window", None) if model_type == "mistral" else None
    weights = _weights.Weights(state, "")
    tied = bool(getattr(config, "tie_word_embeddings", False))
    pad = getattr(config, "pad_token_id", None)
    lm = DecoderOnlyLM(
        config.vocab_size, config.max_position_embeddings, hidden,
        num_layers=config.num_hidden_layers, num_heads=heads, num_key_value_heads=kv_heads,
        intermediate_dim=config.intermediate_size, head_dim=head_dim, position="rotary",
        rope_max_wavelength=theta, rope_scaling=scaling, sliding_window=window,
        activation=activation, layer_norm_epsilon=config.rms_norm_eps,
        normalization="rms_norm", use_gated_feedforward=True,
        attention_use_bias=attention_bias,
        attention_output_use_bias=False if qwen2 else attention_bias,
        feedforward_use_bias=bool(getattr(config, "mlp_bias", False)),
        lm_head_use_bias=False, tie_embeddings=tied,
        embedding_scale=float(np.float32(hidden**0.5)) if gemma else None,
        mask_padded_queries=False, pad_token_id=0 if pad is None else pad,
        name=f"{model_type}_keras_attn",
    )
    lm(np.zeros((1, 1), "int32"))

    def norm(layer, name):
        scale = weights.take(name + ".weight")
        # Gemma's RMSNorm multiplies by (1 + weight).
        _weights.set_rms_norm(layer, scale + 1.0 if gemma else scale, name + ".weight")

    def linear(name):
        bias = weights.take(name + ".bias") if name + ".bias" in weights else None
        return weights.take(name + ".weight").T, bias, name

    _weights.assign(lm.embedding.embeddings, weights.take("model.embed_tokens.weight"), "model.embed_tokens.weight")
    for i, block in enumerate(lm.blocks):
        p = f"model.layers.{i}."
        _weights.set_attention(
            block.self_attention,
            linear(p + "self_attn.q_proj"), linear(p + "self_attn.k_proj"),
            linear(p + "self_attn.v_proj"), linear(p + "self_attn.o_proj"),
        )
        norm(block.self_attention_layer_norm, p + "input_layernorm")
        norm(block.feedforward_layer_norm, p + "post_attention_layernorm")
        for dense, name in (
            (block.feedforward_gate_dense, "mlp.gate_proj"),
            (block.feedforward_intermediate_dense, "mlp.up_proj"),
            (block.feedforward_output_dense, "mlp.down_proj"),
        ):
            _weights.set_dense(dense, *linear(p + name))
    norm(lm.final_norm, "model.norm")
    if "lm_head.weight" in weights:
        head = weights.take("lm_head.weight")
        if tied:
            if not np.array_equal(head, lm.embedding.embeddings.numpy()):
                _refuse("tie_word_embeddings", True, "but lm_head.weight differs from embed_tokens.weight")
        else:
            _weights.assign(lm.lm_head.kernel, head.T, "lm_head.weight")
    elif not tied:
        _refuse("tie_word_embeddings", False, "but the checkpoint has no lm_head.weight")
    weights.check_all_used(architecture)
    return lm
