"""Llama-like decoders (Llama, Mistral, Qwen2) onto `DecoderOnlyLM`; the base
that other decoder families (`gemma.py`, `gemma2.py`, `qwen3.py`,
`smollm3.py`, `phi3.py`) subclass.

All are the same network with different switches: pre-norm blocks with
RMSNorm, a gated feed-forward (SwiGLU), rotary positions (with the config's
`rope_scaling`) on grouped-query heads, no biases except where the config
asks (Llama's `attention_bias`/`mlp_bias`, Qwen2's biased q/k/v), Mistral's
sliding window. The switches map onto `DecoderOnlyLM` options; a config
field the result would not honour is refused by name.

`LlamaConverter` is the conversion in overridable pieces, as the ONNX
Runtime GenAI model builder writes its families: `check_config`,
`activation`, `rope` (base and scaling), `sliding_window` (one window, or
one per layer from `layer_types`), `model_options` (the `DecoderOnlyLM`
arguments), `norm_scale` (a checkpoint norm weight into an RMSNorm scale),
`set_attention` (one attention's tensors) and `set_block` (one block's). A family that differs in a piece
subclasses it and overrides that piece only. `LlamaWriter` (for
`save_huggingface`) is the inverse, in pieces too, beside each converter.

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

import keras
import numpy as np

from keras_attn.convert import common
from keras_attn.generation.models import DecoderOnlyLM
from keras_attn.layers.rotary_embedding import RotaryEmbedding
from keras_attn.layers.transformer_encoder_block import TransformerEncoderBlock

ROPE_TYPES = ("default", "linear", "dynamic", "llama3")

# A block's linear layers: the `transformers` module (under
# `model.layers.i.self_attn.` and `model.layers.i.mlp.`) and our sublayer
# (of the attention, of the block). Read both ways: checkpoint to model
# (`LlamaConverter.set_block`) and adapters either way (`projections`).
ATTENTION_PROJECTIONS = (("q_proj", "query_dense"), ("k_proj", "key_dense"),
                         ("v_proj", "value_dense"), ("o_proj", "output_dense"))
FEEDFORWARD_PROJECTIONS = (("gate_proj", "feedforward_gate_dense"),
                           ("up_proj", "feedforward_intermediate_dense"),
                           ("down_proj", "feedforward_output_dense"))


def projections(lm):
    """`{transformers module name: layer}` of `lm`'s linear layers under the
    Llama names (`model.layers.0.self_attn.q_proj` -> the first block's
    query `EinsumDense`): the families whose projections convert one to one
    and unscaled share them (`common.Family.projections`)."""
    names = {}
    for i, block in enumerate(lm.blocks):
        for module, attribute in ATTENTION_PROJECTIONS:
            layer = getattr(block.self_attention, attribute, None)
            if layer is not None:
                names[f"model.layers.{i}.self_attn.{module}"] = layer
        for module, attribute in FEEDFORWARD_PROJECTIONS:
            layer = getattr(block, attribute, None)
            if layer is not None:
                names[f"model.layers.{i}.mlp.{module}"] = layer
    return names


def rope(config, params=None, rope_types=ROPE_TYPES):
    """`(rope_theta, rope_scaling or None)` from `rope_parameters` (transformers
    >= 5) or the older `rope_theta` / `rope_scaling` fields; `params`: one
    layer type's `rope_parameters` (Gemma 3) instead of the config's."""
    if params is None:
        params = dict(getattr(config, "rope_parameters", None) or {})
        legacy = getattr(config, "rope_scaling", None)
        if not params and legacy:
            params = dict(legacy)
    params = dict(params)
    params.pop("partial_rotary_factor", None)  # RotaryEmbedding's own argument
    theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in rope_types:
        common.refuse("rope_scaling", params, f"has a rope_type keras_attn does not represent (supported: {list(rope_types)})")
    if kind == "default":
        return theta, None
    scaling = {k: v for k, v in params.items() if k not in ("rope_theta", "type")}
    scaling["rope_type"] = kind
    if kind in ("dynamic", "llama3"):
        scaling.setdefault("original_max_position_embeddings", config.max_position_embeddings)
    if kind == "longrope":  # its attention factor is RotaryEmbedding's
        return theta, scaling
    for key in ("attention_factor", "mscale", "mscale_all_dim", "beta_fast", "beta_slow"):
        if scaling.get(key) not in (None, 1.0):
            common.refuse(f"rope_scaling.{key}", scaling[key], "is not represented")
        scaling.pop(key, None)
    return theta, scaling


class LlamaConverter:
    """One Llama-like `*ForCausalLM` checkpoint into a `DecoderOnlyLM`."""

    # What a subclass represents that Llama has not: refused here otherwise.
    soft_capping = False
    partial_rotary = False
    # `use_bidirectional_attention` values under which the text model is
    # still causal (bidirectional over image tokens only).
    causal_text_bidirectional = ()

    def __init__(self, checkpoint):
        self.checkpoint = checkpoint
        self.config = checkpoint.config
        self.model_type = checkpoint.model_type
        self.weights = common.Weights(checkpoint.tensors)

    # -- the pieces a family overrides -------------------------------------

    def check_config(self):
        """Refuses, by name, the config fields the result would not honour."""
        config = self.config
        if not self.partial_rotary and getattr(config, "partial_rotary_factor", 1.0) not in (None, 1.0):
            common.refuse("partial_rotary_factor", config.partial_rotary_factor,
                          "is not represented (rotary on every feature only)")
        if getattr(config, "pretraining_tp", 1) not in (None, 1):
            common.refuse("pretraining_tp", config.pretraining_tp, "is not supported")
        bidirectional = getattr(config, "use_bidirectional_attention", None)
        if bidirectional and bidirectional not in self.causal_text_bidirectional:
            common.refuse("use_bidirectional_attention", bidirectional,
                          "is not supported (causal decoders only)")
        if not self.soft_capping and (
            getattr(config, "attn_logit_softcapping", None)
            or getattr(config, "final_logit_softcapping", None)
        ):
            common.refuse("attn_logit_softcapping", config.attn_logit_softcapping, "is not supported")
        if self.model_type == "qwen2":
            layer_types = getattr(config, "layer_types", None) or []
            if getattr(config, "use_sliding_window", False) or "sliding_attention" in layer_types:
                common.refuse("use_sliding_window", getattr(config, "use_sliding_window", None),
                              "(sliding windows on some layers only, from `max_window_layers`) is not represented")

    def activation(self):
        return common.mapped_activation("hidden_act", getattr(self.config, "hidden_act", None))

    def model_options(self):
        """The `DecoderOnlyLM` arguments."""
        config = self.config
        hidden, heads = config.hidden_size, config.num_attention_heads
        kv_heads, head_dim = self.head_sizes()
        if heads % kv_heads:
            common.refuse("num_key_value_heads", kv_heads, f"does not divide num_attention_heads={heads}")
        theta, scaling = self.rope()
        qwen2 = self.model_type == "qwen2"  # biased q/k/v, whatever `attention_bias` says
        attention_bias = True if qwen2 else bool(getattr(config, "attention_bias", False))
        pad = getattr(config, "pad_token_id", None)
        return dict(
            vocabulary_size=config.vocab_size, sequence_length=config.max_position_embeddings,
            hidden_dim=hidden, num_layers=config.num_hidden_layers, num_heads=heads,
            num_key_value_heads=kv_heads, intermediate_dim=config.intermediate_size,
            head_dim=head_dim, position="rotary",
            rope_max_wavelength=theta, rope_scaling=scaling,
            sliding_window=self.sliding_window(),
            activation=self.activation(), layer_norm_epsilon=config.rms_norm_eps,
            normalization="rms_norm", use_gated_feedforward=True,
            attention_use_bias=attention_bias,
            attention_output_use_bias=False if qwen2 else attention_bias,
            feedforward_use_bias=bool(getattr(config, "mlp_bias", False)),
            lm_head_use_bias=False, tie_embeddings=self.tied,
            mask_padded_queries=False, pad_token_id=0 if pad is None else pad,
            name=f"{self.model_type}_keras_attn",
        )

    def head_sizes(self):
        """`(num_key_value_heads, head_dim)`, the same on every layer."""
        config = self.config
        heads = config.num_attention_heads
        return (getattr(config, "num_key_value_heads", None) or heads,
                getattr(config, "head_dim", None) or config.hidden_size // heads)

    def rope(self):
        """`(rope_max_wavelength, rope_scaling)` of the model (`rope`)."""
        return rope(self.config)

    def sliding_window(self):
        """`DecoderOnlyLM(sliding_window=...)`: Mistral's window on every
        layer; with `layer_types` (Qwen3, Gemma 2/3, SmolLM3), the window on
        the "sliding_attention" layers only."""
        config = self.config
        window = getattr(config, "sliding_window", None)
        layer_types = getattr(config, "layer_types", None)
        if self.model_type == "mistral" or window is None:
            return window if self.model_type == "mistral" else None
        if not layer_types or not getattr(config, "use_sliding_window", True):
            return None
        unknown = sorted(set(layer_types) - {"sliding_attention", "full_attention"})
        if unknown:
            common.refuse("layer_types", layer_types, f"has layer types keras_attn does not represent: {unknown}")
        windows = [window if t == "sliding_attention" else None for t in layer_types]
        return windows if any(w is not None for w in windows) else None

    def norm_scale(self, weight):
        """The RMSNorm scale of a checkpoint norm weight."""
        return weight

    def set_attention(self, attention, prefix):
        """The attention projections (`prefix` = `model.layers.i.self_attn.`)."""
        linear = self.weights.linear
        common.set_attention(attention, *(linear(prefix + module) for module, _ in ATTENTION_PROJECTIONS))

    def set_block(self, block, prefix):
        """Copies one decoder block's tensors (`prefix` = `model.layers.i.`)."""
        self.set_attention(block.self_attention, prefix + "self_attn.")
        self.set_norm(block.self_attention_layer_norm, prefix + "input_layernorm")
        self.set_norm(block.feedforward_layer_norm, prefix + "post_attention_layernorm")
        for module, attribute in FEEDFORWARD_PROJECTIONS:
            common.set_dense(getattr(block, attribute), *self.weights.linear(prefix + "mlp." + module))

    # -- the conversion ------------------------------------------------------

    @property
    def tied(self):
        return bool(getattr(self.config, "tie_word_embeddings", False))

    def set_norm(self, layer, name):
        scale = self.weights.take(name + ".weight")
        common.set_rms_norm(layer, self.norm_scale(scale), name + ".weight")

    def convert(self):
        """The `DecoderOnlyLM` with the checkpoint's weights."""
        self.check_config()
        weights = self.weights
        lm = DecoderOnlyLM(**self.model_options())
        lm(keras.KerasTensor((1, 1), dtype="int32"))
        table = weights.take("model.embed_tokens.weight")
        common.assign(lm.embedding.embeddings, table, "model.embed_tokens.weight")
        common.set_lm_head(lm, weights, self.tied, table, "embed_tokens.weight")
        del table  # checked against the head: not held through the blocks
        for i, block in enumerate(lm.blocks):
            self.set_block(block, f"model.layers.{i}.")
        self.set_norm(lm.final_norm, "model.norm")
        weights.check_all_used(self.checkpoint.architecture)
        return lm


class EncoderConverter:
    """Mixed into a `LlamaConverter` (first base): the checkpoint's text
    model (`*Model`, no head) or masked LM (`*ForMaskedLM`, an output dense)
    as a functional encoder of `TransformerEncoderBlock`s with the blocks
    `DecoderOnlyLM` would have, int32 inputs `input_ids` and
    `attention_mask` (1 = token, 0 = padding), output `last_hidden_state`
    or `logits`. Bidirectional when the config's
    `use_bidirectional_attention` is set (or `bidirectional` says so), else
    causal; a window is then the symmetric band `|i - j| < sliding_window`.
    Padding masks keys only; positions are `0 .. T-1`."""

    # The flag makes the text model bidirectional: taken, not refused.
    causal_text_bidirectional = (True,)

    def __init__(self, checkpoint):
        super().__init__(checkpoint)
        # A task model's base is under `model.`; a text model's tensors have no prefix.
        self.weights = common.Weights(checkpoint.tensors, "model")

    @property
    def bidirectional(self):
        return bool(getattr(self.config, "use_bidirectional_attention", False))

    def convert(self):
        self.check_config()
        config, options, weights = self.config, self.model_options(), self.weights
        full = RotaryEmbedding(options["rope_max_wavelength"], rope_scaling=options["rope_scaling"])
        local = full
        if options.get("local_rope_max_wavelength") is not None:
            local = RotaryEmbedding(options["local_rope_max_wavelength"])
        windows = options["sliding_window"]
        if not isinstance(windows, list):
            windows = [windows] * config.num_hidden_layers
        input_ids = keras.Input((None,), dtype="int32", name="input_ids")
        attention_mask = keras.Input((None,), dtype="int32", name="attention_mask")
        embedding = keras.layers.Embedding(config.vocab_size, config.hidden_size, name="embedding")
        x = embedding(input_ids)
        if options.get("embedding_scale") is not None:
            # A Python float, which takes `x`'s dtype (Gemma rounds it so) and
            # stays a constant of the graph (a cast tensor would be captured).
            x = x * options["embedding_scale"]
        padding_mask = keras.ops.not_equal(attention_mask, 0)
        blocks = []
        for i, window in enumerate(windows):
            block = TransformerEncoderBlock(
                num_heads=options["num_heads"], num_key_value_heads=options["num_key_value_heads"],
                key_dim=options["head_dim"], intermediate_dim=options["intermediate_dim"],
                activation=options["activation"], normalize_first=True,
                layer_norm_epsilon=options["layer_norm_epsilon"], normalization="rms_norm",
                use_gated_feedforward=True, attention_use_bias=options["attention_use_bias"],
                attention_output_use_bias=options["attention_output_use_bias"],
                feedforward_use_bias=options["feedforward_use_bias"],
                use_qk_norm=options.get("use_qk_norm", False),
                use_sandwich_norm=options.get("use_sandwich_norm", False),
                logit_soft_cap=options.get("attention_logit_soft_cap"),
                rotary_embedding=full if window is None else local, sliding_window=window,
                mask_padded_queries=False, name=f"encoder_{i}",
            )
            x = block(x, padding_mask=padding_mask, use_causal_mask=not self.bidirectional)
            blocks.append(block)
        final_norm = keras.layers.RMSNormalization(epsilon=options["layer_norm_epsilon"], name="final_norm")
        x = final_norm(x)
        head = None
        if self.checkpoint.architecture.endswith("ForMaskedLM"):
            head = keras.layers.Dense(config.vocab_size, use_bias="lm_head.bias" in weights, name="lm_head")
            x = keras.layers.Identity(name="logits")(head(x))
        else:
            x = keras.layers.Identity(name="last_hidden_state")(x)
        model = keras.Model([input_ids, attention_mask], x, name=f"{self.model_type}_keras_attn")
        table = weights.take("embed_tokens.weight")
        common.assign(embedding.embeddings, table, "embed_tokens.weight")
        for i, block in enumerate(blocks):
            self.set_block(block, f"layers.{i}.")
        self.set_norm(final_norm, "norm")
        if head is not None:
            common.set_output_head(head, weights, "lm_head", table, self.tied, "embed_tokens")
        weights.check_all_used(self.checkpoint.architecture)
        return model


# --- Back to transformers ------------------------------------------------------
# `DecoderOnlyLM` options a Llama/Mistral/Qwen2 config has no field for, with
# the value the model must have; a family's writer overrides some (`required`)
# or takes them as config fields (`free`).
_PLAIN_OPTIONS = dict(
    position="rotary", normalization="rms_norm", use_gated_feedforward=True,
    lm_head_use_bias=False, embedding_scale=None, use_qk_norm=False, use_sandwich_norm=False,
    attention_logit_soft_cap=None, final_logit_soft_cap=None, local_rope_max_wavelength=None,
    rotary_layers=None, partial_rotary_factor=1.0, key_value_sources=None,
    per_layer_input_dim=None, use_value_norm=False, use_output_scale=False,
)


class LlamaWriter:
    """A `DecoderOnlyLM` as a Llama-like `transformers` model: the inverse of
    `LlamaConverter`, in overridable pieces as it is. `config` gives the
    config fields (refusing, by option, what the model type cannot express:
    `check`, `check_biases`, `window_fields`); `tensors` the tensors through
    the conversion's projection table read back (`projection_tensors`), the
    norms through `norm_weight` (the inverse of `norm_scale`). Kernels are
    read as the layers serve them, so LoRA adapters are written merged."""

    architectures = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
    # Options this family needs at another value than `_PLAIN_OPTIONS`'s, and
    # options its config expresses whatever their value.
    required = {}
    free = ()

    @property
    def mlp_bias(self):
        """Whether the config has `mlp_bias` (feed-forward biases)."""
        return self.model_type == "llama"

    def __init__(self, lm, model_type):
        self.lm, self.model_type, self.options = lm, model_type, lm.get_config()

    def refuse(self, option, why):
        raise ValueError(f"Cannot write this model as {self.model_type!r}: `{option}`="
                         f"{self.options.get(option)!r} {why}.")

    # -- the pieces a family overrides -------------------------------------

    def check(self):
        """Refuses, by name, the options the config cannot express."""
        options = self.options
        for option, plain in {**_PLAIN_OPTIONS, **self.required}.items():
            if option not in self.free and options.get(option, plain) != plain:
                self.refuse(option, f"is not expressed by its config (needs {plain!r})")
        for option in ("intermediate_dim", "num_key_value_heads", "head_dim"):
            if isinstance(options[option], list):
                self.refuse(option, "varies per layer")
        self.check_biases()

    def check_biases(self):
        options = self.options
        attention_bias = options["attention_use_bias"]
        output_bias = options["attention_output_use_bias"]
        output_bias = attention_bias if output_bias is None else output_bias
        if self.model_type == "qwen2":
            if not attention_bias or output_bias or options["feedforward_use_bias"]:
                self.refuse("attention_use_bias", "must be True (q/k/v only: no output or feed-forward bias)")
        elif self.model_type == "mistral":
            if attention_bias or output_bias or options["feedforward_use_bias"]:
                self.refuse("attention_use_bias", "must be False with no other bias")
        elif output_bias != attention_bias:
            self.refuse("attention_output_use_bias", "must equal `attention_use_bias` (`attention_bias`)")
        elif options["feedforward_use_bias"] and not self.mlp_bias:
            self.refuse("feedforward_use_bias", "is not expressed by its config (needs False)")

    def window_fields(self):
        """The config fields of `sliding_window`: Mistral's one window on
        every layer; none elsewhere."""
        window = self.options["sliding_window"]
        if self.model_type == "mistral":
            if isinstance(window, list):
                self.refuse("sliding_window", "varies per layer (Mistral has one window)")
            return dict(sliding_window=window)
        if window is not None:
            self.refuse("sliding_window", "is Mistral's only")
        return {}

    def layer_windows(self, **flags):
        """`layer_types` ("sliding_attention" where a layer has the window),
        `sliding_window` (one for every sliding layer) and `flags`: the
        converter's `sliding_window` read back (Qwen3, Gemma 2/3, SmolLM3)."""
        windows = self.options["sliding_window"]
        if not isinstance(windows, list):
            windows = [windows] * self.options["num_layers"]
        sizes = {w for w in windows if w is not None}
        if len(sizes) > 1:
            self.refuse("sliding_window", "has several window sizes (the config has one)")
        return dict(layer_types=["full_attention" if w is None else "sliding_attention" for w in windows],
                    sliding_window=sizes.pop() if sizes else None, **flags)

    def rope_fields(self):
        options = self.options
        return dict(rope_theta=options["rope_max_wavelength"], rope_scaling=options["rope_scaling"])

    def family_fields(self):
        """The fields only this family's config has."""
        options = self.options
        if self.mlp_bias:
            return dict(attention_bias=options["attention_use_bias"], mlp_bias=options["feedforward_use_bias"])
        if self.model_type in ("qwen2", "mistral"):
            return {}
        return dict(attention_bias=options["attention_use_bias"])

    def norm_weight(self, scale):
        """The checkpoint norm weight of an RMSNorm scale."""
        return scale

    def projection_tensors(self):
        """`(name, array)` of the block projections, by `projections`."""
        for name, layer in projections(self.lm).items():
            yield from linear_tensors(name, layer)

    # -- the writing --------------------------------------------------------

    def config(self):
        """The `transformers` config fields."""
        self.check()
        options = self.options
        return dict(
            model_type=self.model_type, architectures=[self.architectures[self.model_type]],
            vocab_size=options["vocabulary_size"], hidden_size=options["hidden_dim"],
            intermediate_size=options["intermediate_dim"], num_hidden_layers=options["num_layers"],
            num_attention_heads=options["num_heads"],
            num_key_value_heads=options["num_key_value_heads"] or options["num_heads"],
            head_dim=self.head_dim, hidden_act=options["activation"],
            max_position_embeddings=options["sequence_length"], rms_norm_eps=options["layer_norm_epsilon"],
            tie_word_embeddings=options["tie_embeddings"], pad_token_id=options["pad_token_id"],
            **self.rope_fields(), **self.window_fields(), **self.family_fields(),
        )

    @property
    def head_dim(self):
        return self.options["head_dim"] or self.options["hidden_dim"] // self.options["num_heads"]

    def norms(self, block):
        """`{transformers norm name: RMSNorm}` of one block."""
        return {"input_layernorm": block.self_attention_layer_norm,
                "post_attention_layernorm": block.feedforward_layer_norm}

    def tensors(self):
        """`(name, float32 array)` of every `transformers` tensor, one at a time."""
        lm = self.lm
        yield "model.embed_tokens.weight", to_numpy(lm.embedding.embeddings)
        yield from self.projection_tensors()
        for i, block in enumerate(lm.blocks):
            for name, norm in self.norms(block).items():
                yield f"model.layers.{i}.{name}.weight", self.norm_weight(to_numpy(norm.scale))
        yield "model.norm.weight", self.norm_weight(to_numpy(lm.final_norm.scale))
        if not lm.tie_embeddings:
            yield "lm_head.weight", np.ascontiguousarray(to_numpy(lm.lm_head.kernel).T)


def linear_tensors(name, layer):
    """`(name.weight, (out, in))` and `(name.bias, (out,))` of one of our projections."""
    kernel = to_numpy(layer.kernel)
    # Ours are `(in, out)` with heads flattened in C order: `(D, H, d)` for
    # q/k/v, `(H, d, D)` for the output projection.
    kernel = kernel.reshape(-1, kernel.shape[-1]) if name.endswith("o_proj") else kernel.reshape(kernel.shape[0], -1)
    yield name + ".weight", np.ascontiguousarray(kernel.T)  # safetensors writes the buffer as it lies
    if layer.bias is not None:
        yield name + ".bias", to_numpy(layer.bias).reshape(-1)


def to_numpy(x):
    return np.asarray(keras.ops.convert_to_numpy(x), np.float32)


def convert(checkpoint, *, dropout=None):
    """A `DecoderOnlyLM` with the weights and logits of a Llama, Mistral or
    Qwen2 `*ForCausalLM` (`dropout` is not used: the result has none)."""
    return LlamaConverter(checkpoint).convert()


FAMILY = common.Family(
    name="Llama",
    model_types=("llama", "mistral", "qwen2"),
    architectures=("*ForCausalLM",),
    convert=convert,
    projections=projections,
)
