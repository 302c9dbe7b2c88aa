"""Small reference language models with a cached decoding path.

`DecoderOnlyLM` and `Seq2SeqLM` are built from keras_attn layers and expose
the protocol the search functions and exporters use:

- `init_cache(batch_size, max_length)` -> cache list (see `cache.py`),
- `call_with_cache(token_ids, cache, cache_index, ...)` -> `(logits, cache)`,
- `Seq2SeqLM.encode(encoder_ids)` -> `(encoder_outputs, encoder_padding_mask)`.

The plain `call` recomputes everything (the reference for cached decoding).
Any model offering the same three methods works with `keras_attn.generation`.
A model whose positions are bounded (a learned table) also exposes
`max_positions` (an int, else None); the search functions and exporters
check `max_length` against it up front, because under XLA an out-of-range
position is clamped silently instead of raising.
"""

import keras
import numpy as np
from keras import ops

from keras_attn import checks as _checks
from keras_attn import description
from keras_attn.generation import cache as cache_lib
from keras_attn.generation import layout
from keras_attn.generation import lm_loss
from keras_attn.generation import lora
from keras_attn.layers import activations
from keras_attn.layers.relative_position_bias import RelativePositionBias
from keras_attn.layers.reversible_embedding import ReversibleEmbedding
from keras_attn.layers.rotary_embedding import RotaryEmbedding
from keras_attn.layers.rotary_embedding import check_rope_scaling
from keras_attn.layers.token_and_position_embedding import TokenAndPositionEmbedding
from keras_attn.layers.transformer_decoder_block import TransformerDecoderBlock
from keras_attn.layers.transformer_encoder_block import TransformerEncoderBlock
from keras_attn.saving import register


class _LMBase(keras.Model):
    def __init__(
        self,
        vocabulary_size,
        sequence_length,
        hidden_dim,
        num_layers,
        num_heads,
        intermediate_dim,
        num_key_value_heads=None,
        position="sinusoidal",
        pad_token_id=0,
        sliding_window=None,
        activation="relu",
        layer_norm_epsilon=1e-5,
        tie_embeddings=False,
        mask_padded_queries=True,
        head_dim=None,
        normalization="layer_norm",
        use_gated_feedforward=False,
        attention_use_bias=True,
        attention_output_use_bias=None,
        feedforward_use_bias=True,
        lm_head_use_bias=True,
        rope_max_wavelength=10000,
        rope_scaling=None,
        embedding_scale=None,
        relative_attention_num_buckets=32,
        relative_attention_max_distance=128,
        share_embeddings=False,
        num_decoder_layers=None,
        use_qk_norm=False,
        use_sandwich_norm=False,
        attention_logit_soft_cap=None,
        final_logit_soft_cap=None,
        local_rope_max_wavelength=None,
        rotary_layers=None,
        partial_rotary_factor=1.0,
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.vocabulary_size = _checks.check_positive_int("vocabulary_size", vocabulary_size)
        self.sequence_length = _checks.check_positive_int("sequence_length", sequence_length)
        self.hidden_dim = _checks.check_positive_int("hidden_dim", hidden_dim)
        self.num_layers = _checks.check_positive_int("num_layers", num_layers)
        # Seq2SeqLM: the decoder's depth when it differs from the encoder's (T5).
        self.num_decoder_layers = _checks.check_positive_int(
            "num_decoder_layers", num_decoder_layers or num_layers
        )
        self.num_heads = _checks.check_positive_int("num_heads", num_heads)
        # `intermediate_dim`, `num_key_value_heads` and `head_dim` take one
        # value per decoder layer too (Gemma 4: full-attention layers with
        # their own head size and key/value heads, wider feed-forwards on
        # the KV-shared layers); `DecoderOnlyLM` only.
        self.intermediate_dim = _check_per_layer(
            "intermediate_dim", intermediate_dim, self.num_decoder_layers,
            _checks.check_positive_int, "a positive int",
        )
        self.num_key_value_heads = _check_per_layer(
            "num_key_value_heads", num_key_value_heads, self.num_decoder_layers,
            lambda name, h: _checks.check_num_key_value_heads(
                _checks.check_positive_int(name, h), self.num_heads, name),
            "None, a positive int",
        ) or num_heads
        self.position = _checks.check_choice(
            "position", position, ("sinusoidal", "learned", "rotary", "relative")
        )
        self.pad_token_id = pad_token_id
        self.sliding_window = _check_per_layer(
            "sliding_window", sliding_window, self.num_decoder_layers,
            lambda name, w: _checks.check_positive_int(name, w, allow_none=True),
            "None, a positive int",
        )
        activations.get(activation)  # raises a ValueError naming `activation`
        self.activation = activation
        self.layer_norm_epsilon = _checks.check_positive_float(
            "layer_norm_epsilon", layer_norm_epsilon
        )
        self.tie_embeddings = _checks.check_bool("tie_embeddings", tie_embeddings)
        self.mask_padded_queries = _checks.check_bool("mask_padded_queries", mask_padded_queries)
        if head_dim is None and hidden_dim % num_heads:
            raise ValueError(
                f"`hidden_dim` must be divisible by `num_heads` when `head_dim` is None. "
                f"Received: hidden_dim={hidden_dim}, num_heads={num_heads}"
            )
        self.head_dim = _check_per_layer(
            "head_dim", head_dim, self.num_decoder_layers, _checks.check_positive_int,
            "None, a positive int",
        ) or (hidden_dim // num_heads)
        self.explicit_head_dim = head_dim is not None
        for name, value in _checks.check_block_switches(
            normalization, use_gated_feedforward, attention_use_bias,
            attention_output_use_bias, feedforward_use_bias,
        ).items():
            setattr(self, name, value)
        self.lm_head_use_bias = _checks.check_bool("lm_head_use_bias", lm_head_use_bias)
        self.rope_max_wavelength = _checks.check_positive_float(
            "rope_max_wavelength", rope_max_wavelength
        )
        self.rope_scaling = check_rope_scaling(rope_scaling)
        self.local_rope_max_wavelength = (
            None if local_rope_max_wavelength is None
            else _checks.check_positive_float("local_rope_max_wavelength", local_rope_max_wavelength)
        )
        self.rotary_layers = _check_per_layer(
            "rotary_layers", rotary_layers, self.num_decoder_layers,
            lambda name, r: _checks.check_bool(name, r), "None",
            allow_scalar=False,
        )
        self.partial_rotary_factor = _checks.check_positive_float(
            "partial_rotary_factor", partial_rotary_factor
        )
        rotary_options = (
            rope_scaling is not None or rope_max_wavelength != 10000
            or self.local_rope_max_wavelength is not None or self.rotary_layers is not None
            or self.partial_rotary_factor != 1.0
        )
        if rotary_options and position != "rotary":
            raise ValueError(
                "`rope_max_wavelength`, `rope_scaling`, `local_rope_max_wavelength`, "
                "`rotary_layers` and `partial_rotary_factor` need position='rotary'. Received: "
                f"position={position!r}, rope_max_wavelength={rope_max_wavelength}, "
                f"rope_scaling={rope_scaling!r}, local_rope_max_wavelength="
                f"{local_rope_max_wavelength!r}, rotary_layers={rotary_layers!r}, "
                f"partial_rotary_factor={partial_rotary_factor!r}"
            )
        self.use_qk_norm = _checks.check_bool("use_qk_norm", use_qk_norm)
        self.use_sandwich_norm = _checks.check_bool("use_sandwich_norm", use_sandwich_norm)
        self.attention_logit_soft_cap = _checks.check_soft_cap(
            "attention_logit_soft_cap", attention_logit_soft_cap
        )
        self.final_logit_soft_cap = _checks.check_soft_cap(
            "final_logit_soft_cap", final_logit_soft_cap
        )
        # position="relative": T5's bucketed bias, one table per stack (the
        # first layer's in Hugging Face's T5, shared by the others).
        self.relative_attention_num_buckets = _checks.check_positive_int(
            "relative_attention_num_buckets", relative_attention_num_buckets
        )
        self.relative_attention_max_distance = _checks.check_positive_int(
            "relative_attention_max_distance", relative_attention_max_distance
        )
        if self.position == "relative" and self.sliding_window is not None:
            raise ValueError(
                "position='relative' cannot be combined with `sliding_window` (its ring-buffer "
                f"cache has no fixed key positions). Received: sliding_window={sliding_window}"
            )
        # Seq2SeqLM: one token table for the encoder, the decoder and a tied head (T5).
        self.share_embeddings = _checks.check_bool("share_embeddings", share_embeddings)
        # Token embeddings are multiplied by it before the first block (Gemma:
        # sqrt(hidden_dim)); the tied output head uses the unscaled table.
        self.embedding_scale = (
            None if embedding_scale is None
            else _checks.check_positive_float("embedding_scale", embedding_scale)
        )

    def _embedding(self, name):
        if self.position in ("rotary", "relative"):
            return ReversibleEmbedding(self.vocabulary_size, self.hidden_dim, name=name)
        return TokenAndPositionEmbedding(
            self.vocabulary_size, self.sequence_length, self.hidden_dim,
            position=self.position, name=name,
        )

    def _embed(self, layer, ids, start_index=0):
        if self.position in ("rotary", "relative"):
            x = layer(ids)
        else:
            x = layer(ids, start_index=start_index)
        if self.embedding_scale is not None:
            x = x * ops.cast(self.embedding_scale, x.dtype)
        return x

    def _norm(self, name):
        if self.normalization == "rms_norm":
            return keras.layers.RMSNormalization(epsilon=self.layer_norm_epsilon, name=name)
        return keras.layers.LayerNormalization(epsilon=self.layer_norm_epsilon, name=name)

    def _head(self):
        """The output projection: a Dense (bias per `lm_head_use_bias`), or None when tied."""
        if self.tie_embeddings:
            return None
        return keras.layers.Dense(
            self.vocabulary_size, use_bias=self.lm_head_use_bias, name="lm_head"
        )

    def _logits(self, embedding, x):
        if self.lm_head is not None:
            logits = self.lm_head(x)
        else:
            table = embedding if self.position in ("rotary", "relative") else embedding.token_embedding
            logits = table(x, reverse=True)
        cap = self.final_logit_soft_cap
        if cap is not None:
            logits = ops.tanh(logits / ops.cast(cap, logits.dtype)) * ops.cast(cap, logits.dtype)
        return logits

    def layer_sliding_windows(self):
        """The self-attention window of each decoder layer (None: full attention)."""
        return _per_layer(self.sliding_window, self.num_decoder_layers)

    def layer_head_dims(self):
        """The head size of each decoder layer."""
        return _per_layer(self.head_dim, self.num_decoder_layers)

    def layer_num_key_value_heads(self):
        """The number of key/value heads of each decoder layer."""
        return _per_layer(self.num_key_value_heads, self.num_decoder_layers)

    def layer_intermediate_dims(self):
        """The feed-forward width of each decoder layer."""
        return _per_layer(self.intermediate_dim, self.num_decoder_layers)

    def _block_kwargs(self):
        return dict(
            activation=self.activation,
            layer_norm_epsilon=self.layer_norm_epsilon,
            mask_padded_queries=self.mask_padded_queries,
            normalization=self.normalization,
            use_gated_feedforward=self.use_gated_feedforward,
            attention_use_bias=self.attention_use_bias,
            attention_output_use_bias=self.attention_output_use_bias,
            feedforward_use_bias=self.feedforward_use_bias,
            use_qk_norm=self.use_qk_norm,
            use_sandwich_norm=self.use_sandwich_norm,
            logit_soft_cap=self.attention_logit_soft_cap,
        )

    def _rotary(self):
        if self.position != "rotary":
            return None
        return RotaryEmbedding(
            self.rope_max_wavelength, rope_scaling=self.rope_scaling,
            partial_rotary_factor=self.partial_rotary_factor,
        )

    def _layer_rotaries(self):
        """The rotary embedding of each decoder layer: None where
        `rotary_layers` says so, `local_rope_max_wavelength` (unscaled) on
        windowed layers when it is set, else the model's."""
        shared = self._rotary()
        if shared is None:
            return [None] * self.num_decoder_layers
        local = shared
        if self.local_rope_max_wavelength is not None:
            local = RotaryEmbedding(
                self.local_rope_max_wavelength, partial_rotary_factor=self.partial_rotary_factor,
            )
        uses = self.rotary_layers or [True] * self.num_decoder_layers
        return [
            None if not use else (shared if window is None else local)
            for use, window in zip(uses, self.layer_sliding_windows())
        ]

    def _relative_bias(self, name, bidirectional):
        if self.position != "relative":
            return None
        return RelativePositionBias(
            self.num_heads, self.relative_attention_num_buckets,
            self.relative_attention_max_distance, bidirectional=bidirectional, name=name,
        )

    @staticmethod
    def _self_bias(layer, x, cache=None, cache_index=0):
        """The relative bias of self-attention (None without one): over the
        sequence itself, or from the new tokens to every cached position."""
        if layer is None:
            return None
        if cache is None:
            return layer(x)
        return layer(x, cache[0]["self_attention"][0], start_index=cache_index)

    def _decoder_block_options(self, index):
        """Options of decoder block `index` beyond `_block_kwargs` (none here)."""
        return {}

    def _decoder_blocks(self):
        return [
            TransformerDecoderBlock(
                self.num_heads, intermediate_dim=width, num_key_value_heads=heads,
                key_dim=head_dim, normalize_first=True, rotary_embedding=rotary,
                sliding_window=window, name=f"decoder_{i}",
                **self._block_kwargs(), **self._decoder_block_options(i),
            )
            for i, (rotary, window, width, heads, head_dim) in enumerate(zip(
                self._layer_rotaries(), self.layer_sliding_windows(),
                self.layer_intermediate_dims(), self.layer_num_key_value_heads(),
                self.layer_head_dims(),
            ))
        ]

    @property
    def max_positions(self):
        """Number of positions the model can embed, or None if unbounded.

        `sequence_length` with learned positions (a table cannot extrapolate);
        None with sinusoidal or rotary positions.
        """
        return self.sequence_length if self.position == "learned" else None

    def enable_lora(self, rank, target_names=("query", "value"), lora_alpha=None, *,
                    style="peft", dropout=0.0):
        """Low-rank adapters (Hu et al., 2021) on the named projections, all
        other weights frozen; Hugging Face PEFT's LoRA by default.

        Every built `Dense`/`EinsumDense` sublayer named in `target_names`
        gets an adapter: ours names (the attention's `"query"`, `"key"`,
        `"value"`, `"attention_output"`, the blocks'
        `"feedforward_gate_dense"`, `"feedforward_intermediate_dense"`,
        `"feedforward_output_dense"`) or the `transformers` ones (`"q_proj"`,
        `"k_proj"`, `"v_proj"`, `"o_proj"`, `"gate_proj"`, `"up_proj"`,
        `"down_proj"`).

        With `style="peft"`, `enable_lora(r, ("q_proj", "v_proj"))` is
        `peft.LoraConfig(r=r, target_modules=["q_proj", "v_proj"])`: per
        projection `A (in, r)`, `B (r, out)` over its whole input and output
        (all heads), `y = x @ W + (lora_alpha / r) * dropout(x) @ A @ B + b`,
        `A` initialised as PEFT's, `B` at zero (outputs unchanged until
        trained); only `A` and `B` train (biases frozen). `lora_alpha`
        defaults to PEFT's 8 (not Keras's `rank`), so that the same
        arguments give the same model and the same learning-rate behaviour
        as a PEFT recipe. `style="keras"` is Keras's own
        `EinsumDense.enable_lora` (rank on the kernel's last axis: an
        adapter per head; `lora_alpha` defaults to `rank`; biases train).

        The layers' `kernel` is served merged, so the description, exports
        and `.keras` files see `W + (lora_alpha / r) * A @ B` (a reloaded
        `.keras` model has merged kernels and no adapters;
        `keras_attn.convert.save_peft_adapter` keeps them). Returns the
        adapted layers (`keras_attn.generation.lora.enable_lora`).

        Args:
            rank: the adapters' rank `r`, a positive integer.
            target_names: projection names, ours or `transformers`'.
            lora_alpha: the scale's numerator; None: 8 (`"peft"`) or `rank`
                (`"keras"`).
            style: `"peft"` or `"keras"`.
            dropout: PEFT's `lora_dropout`, on the adapters' input while
                training (`"peft"` only).

        Raises:
            ValueError: an unknown or absent target name (the known ones
                are listed), a bad `rank`, `lora_alpha`, `style` or
                `dropout`, or a model not built yet.
        """
        return lora.enable_lora(self, rank, target_names, lora_alpha, style=style, dropout=dropout)

    def merge_lora(self):
        """Adds each PEFT-style adapter into its kernel (`W += (alpha / r) * A @ B`);
        the forward pass is then the base model's (one matmul per
        projection, no adapter path) with the same logits. `unmerge_lora`
        takes the update out again (float32 rounding of the kernels aside).
        Returns the adapted layers (`keras_attn.generation.lora.merge_lora`)."""
        return lora.merge_lora(self)

    def unmerge_lora(self):
        """Undoes `merge_lora`: the kernels lose the update, the adapters act again."""
        return lora.unmerge_lora(self)

    def get_layout_map(self, device_mesh, model_axis="model", data_axis="data"):
        """A `keras.distribution.LayoutMap` that shards this model over
        `device_mesh` (Megatron-style tensor parallelism): attention heads
        and the feed-forward's intermediate features split over
        `model_axis`, everything else replicated; use it with
        `keras.distribution.ModelParallel(layout_map=..., batch_dim_name=data_axis)`.

        The sharded sizes (`num_heads`, `num_key_value_heads`,
        `intermediate_dim`, `vocabulary_size`) must be divisible by the
        mesh's `model_axis` size (`keras_attn.generation.layout.layout_map`).
        """
        return layout.layout_map(self, device_mesh, model_axis, data_axis)

    def _check_cache_write(self, token_ids, cache, cache_index):
        # Writes past a plain cache's end are dropped by `write_cache`: reject
        # them when the sizes are static (a ring buffer wraps by design).
        if not cache:
            return
        windows = [window for window, _, _ in self._cache_layers()]
        for layer, window in zip(cache, windows):
            length = layer["self_attention"][0].shape[1]
            ring = window is not None and window == length
            cache_lib.check_cache_write(length, token_ids.shape[1], cache_index, ring=ring)

    def init_cache(self, batch_size, max_length, dtype="float32", ring_buffers=True):
        """Zero caches for `max_length` positions.

        A layer with a `sliding_window` shorter than `max_length` gets a
        self-attention cache of only `sliding_window` positions: a ring buffer
        (slot = position mod window), so its memory stays bounded however
        long the generation. With a window per layer, windowed layers' caches
        are rings and the others hold `max_length` positions.
        `ring_buffers=False` gives every layer `max_length` positions, the
        window then a band over them (one cache length for every layer, as
        the LLM runtimes' cache layouts need). Each layer's cache has its
        own key/value heads and head size (`num_key_value_heads`,
        `head_dim` given per layer).
        """
        _checks.check_bool("ring_buffers", ring_buffers)
        return [
            cache_lib.empty_cache(
                batch_size,
                max_length if window is None or not ring_buffers else min(max_length, window), 1,
                heads, head_dim, dtype,
            )[0]
            for window, heads, head_dim in self._cache_layers()
        ]

    def _cache_layers(self):
        """`(window, num_key_value_heads, head_dim)` of each layer that has
        a cache (every layer here)."""
        return list(zip(self.layer_sliding_windows(), self.layer_num_key_value_heads(),
                        self.layer_head_dims()))

    def get_config(self):
        config = super().get_config()
        config.update(
            dict(
                vocabulary_size=self.vocabulary_size, sequence_length=self.sequence_length,
                hidden_dim=self.hidden_dim, num_layers=self.num_layers,
                num_heads=self.num_heads, intermediate_dim=self.intermediate_dim,
                num_key_value_heads=self.num_key_value_heads, position=self.position,
                pad_token_id=self.pad_token_id, sliding_window=self.sliding_window,
                activation=self.activation
                if isinstance(self.activation, str)
                else keras.activations.serialize(activations.get(self.activation)),
                layer_norm_epsilon=self.layer_norm_epsilon,
                tie_embeddings=self.tie_embeddings,
                mask_padded_queries=self.mask_padded_queries,
                head_dim=self.head_dim if self.explicit_head_dim else None,
                normalization=self.normalization,
                use_gated_feedforward=self.use_gated_feedforward,
                attention_use_bias=self.attention_use_bias,
                attention_output_use_bias=self.attention_output_use_bias,
                feedforward_use_bias=self.feedforward_use_bias,
                lm_head_use_bias=self.lm_head_use_bias,
                rope_max_wavelength=self.rope_max_wavelength,
                rope_scaling=self.rope_scaling,
                embedding_scale=self.embedding_scale,
                relative_attention_num_buckets=self.relative_attention_num_buckets,
                relative_attention_max_distance=self.relative_attention_max_distance,
                share_embeddings=self.share_embeddings,
                num_decoder_layers=self.num_decoder_layers,
                use_qk_norm=self.use_qk_norm,
                use_sandwich_norm=self.use_sandwich_norm,
                attention_logit_soft_cap=self.attention_logit_soft_cap,
                final_logit_soft_cap=self.final_logit_soft_cap,
                local_rope_max_wavelength=self.local_rope_max_wavelength,
                rotary_layers=self.rotary_layers,
                partial_rotary_factor=self.partial_rotary_factor,
            )
        )
        return config


def _remat_block(block, x, options):
    """`block(x, **options)` rematerialised. Tensor options are arguments of
    the rematerialised function, not closures: TensorFlow's `recompute_grad`
    gives gradients to its arguments and variables only."""
    names = [k for k, v in options.items() if v is not None and not isinstance(v, (bool, int, float))]
    fixed = {k: v for k, v in options.items() if k not in names}

    def run(x, *tensors):
        return block(x, **fixed, **dict(zip(names, tensors)))

    return keras.remat(run)(x, *(options[k] for k in names))


def _per_layer(value, num_layers):
    """A per-layer option as a list of one value per layer."""
    return list(value) if isinstance(value, list) else [value] * num_layers


def _check_per_layer(name, value, num_layers, check, scalars, allow_scalar=True):
    """`value` checked by `check(name, v)`: one value for every layer
    (`allow_scalar`) or a list with one per layer (returned as a list)."""
    if isinstance(value, (list, tuple)):
        if len(value) != num_layers:
            raise ValueError(
                f"Received an invalid value for argument `{name}`, expected {scalars} or a "
                f"list of one value per layer ({num_layers}). Received: {name}={value!r}"
            )
        return [check(f"{name}[{i}]", v) for i, v in enumerate(value)]
    if value is not None and not allow_scalar:
        raise ValueError(
            f"Received an invalid value for argument `{name}`, expected None or a list of "
            f"one value per layer ({num_layers}). Received: {name}={value!r}"
        )
    return check(name, value) if value is not None else None


@register
class DecoderOnlyLM(_LMBase):
    """A pre-norm GPT-style language model of `TransformerDecoderBlock`s.

    `call(token_ids)` gives `(B, T, vocabulary_size)` logits with causal
    attention; `call_with_cache` does the same incrementally. With
    `sliding_window=W` each token attends to the last `W` tokens only
    (itself included) and the cache is a ring buffer of `W` positions.

    Options shared with `Seq2SeqLM`:

    - `activation`: of the feed-forward networks (any name the blocks
      accept, e.g. `"gelu_new"` for GPT-2; see `keras_attn.activations`);
    - `layer_norm_epsilon`: of every LayerNorm;
    - `tie_embeddings`: the output head is the transposed token embedding
      table, without bias (GPT-2); else a `Dense` with bias (`lm_head`);
    - `mask_padded_queries`: passed to the blocks (False: padding masks keys
      only, as Hugging Face models do).
    - `head_dim`: size of each attention head (default
      `hidden_dim // num_heads`; Gemma's is independent of it);
    - `normalization`, `use_gated_feedforward`, `attention_use_bias`,
      `attention_output_use_bias`, `feedforward_use_bias`: passed to the
      blocks (see `TransformerEncoderBlock`); `normalization` also sets the
      final norm;
    - `lm_head_use_bias`: bias of an untied head (Llama's has none);
    - `rope_max_wavelength`, `rope_scaling`: of the `RotaryEmbedding`
      (`position="rotary"`);
    - `embedding_scale`: multiplies the token embeddings before the first
      block (Gemma: `sqrt(hidden_dim)`); a tied head uses the unscaled table;
    - `use_qk_norm`, `use_sandwich_norm`: passed to the blocks (RMSNorm of
      each query and key head; a norm after each residual branch too);
    - `attention_logit_soft_cap`: the blocks' `logit_soft_cap`;
      `final_logit_soft_cap`: the output logits become `cap * tanh(x / cap)`
      (Gemma 2);
    - `partial_rotary_factor`: of the `RotaryEmbedding` (Phi-3).

    Per layer (decoder-only):

    - `sliding_window`: an int for every layer, or a list with one int or
      None (full attention) per layer (Gemma 2/3, Qwen3); `init_cache` gives
      each windowed layer a ring buffer of its window;
    - `local_rope_max_wavelength`: the rotary base of the windowed layers,
      without `rope_scaling` (Gemma 3's `rope_local_base_freq`); None: the
      model's;
    - `rotary_layers`: None, or a list of one bool per layer, False for a
      layer without rotary positions (SmolLM3's `no_rope_layers`);
    - `head_dim`, `num_key_value_heads`, `intermediate_dim`: one value for
      every layer, or a list of one per layer (Gemma 4: full-attention
      layers with a larger head and fewer key/value heads, twice as wide
      feed-forwards on the KV-shared layers); `init_cache` gives each layer
      a cache of its own heads and head size (the exports that stack every
      layer's cache into one tensor refuse such a model by name);
    - `key_value_sources`: None, or a list with one entry per layer: None
      (the layer projects its own keys and values) or the index `j` of an
      earlier layer whose keys and values it attends over with its own
      queries (Gemma 4's `num_kv_shared_layers`). Layer `j` must project its
      own and have the same `sliding_window`, `num_key_value_heads` and
      `head_dim`. Such a layer has no key/value
      projections and no cache: `init_cache` returns one entry per layer
      that projects its own keys and values, in layer order.

    Gemma 4 (decoder-only):

    - `per_layer_input_dim` (`P`), `per_layer_input_vocabulary_size`
      (default `vocabulary_size`): per-layer input embeddings. A second
      token table `per_layer_embedding` `(vocabulary, num_layers * P)`,
      multiplied by `sqrt(P)`, plus a projection of the scaled token
      embeddings `per_layer_model_projection` `(hidden_dim -> num_layers *
      P)` multiplied by `hidden_dim ** -0.5` and normalised over each
      layer's `P` features (`per_layer_projection_norm`), their sum times
      `2 ** -0.5`, give each block `i` its `per_layer_input` (the blocks'
      `per_layer_input_dim`);
    - `use_value_norm`: an RMSNorm without scale on each value head;
    - `use_output_scale`: each block's output times a constant scalar
      weight (`output_scale`, Gemma 4's `layer_scalar`).

    `keras_attn.convert.from_huggingface` builds one from a Llama, Mistral,
    Qwen2/3, Gemma (1, 2, 3, 4), SmolLM3 or Phi-3 `*ForCausalLM` with these
    options.

    Example:

    >>> import numpy as np
    >>> lm = DecoderOnlyLM(50, 16, 16, num_layers=1, num_heads=2, intermediate_dim=32)
    >>> tuple(lm(np.array([[3, 4, 5]])).shape)
    (1, 3, 50)
    """

    def __init__(
        self,
        *args,
        key_value_sources=None,
        per_layer_input_dim=None,
        per_layer_input_vocabulary_size=None,
        use_value_norm=False,
        use_output_scale=False,
        **kwargs,
    ):
        super().__init__(*args, **kwargs)
        if self.num_decoder_layers != self.num_layers:
            raise ValueError(
                "`num_decoder_layers` is for Seq2SeqLM; a DecoderOnlyLM has `num_layers` "
                f"blocks. Received: num_layers={self.num_layers}, "
                f"num_decoder_layers={self.num_decoder_layers}"
            )
        self.key_value_sources = self._check_key_value_sources(key_value_sources)
        self.per_layer_input_dim = _checks.check_positive_int(
            "per_layer_input_dim", per_layer_input_dim, allow_none=True
        )
        self.per_layer_input_vocabulary_size = _checks.check_positive_int(
            "per_layer_input_vocabulary_size", per_layer_input_vocabulary_size, allow_none=True
        )
        if self.per_layer_input_vocabulary_size is not None and self.per_layer_input_dim is None:
            raise ValueError(
                "`per_layer_input_vocabulary_size` needs `per_layer_input_dim`. Received: "
                f"per_layer_input_vocabulary_size={per_layer_input_vocabulary_size}, "
                "per_layer_input_dim=None"
            )
        self.use_value_norm = _checks.check_bool("use_value_norm", use_value_norm)
        self.use_output_scale = _checks.check_bool("use_output_scale", use_output_scale)
        self.per_layer_embedding = None
        if self.per_layer_input_dim is not None:
            width = self.num_layers * self.per_layer_input_dim
            self.per_layer_embedding = keras.layers.Embedding(
                self.per_layer_input_vocabulary_size or self.vocabulary_size, width,
                name="per_layer_embedding",
            )
            self.per_layer_model_projection = keras.layers.Dense(
                width, use_bias=False, name="per_layer_model_projection"
            )
            self.per_layer_projection_norm = self._norm("per_layer_projection_norm")
        self.embedding = self._embedding("embedding")
        self.position_bias = self._relative_bias("relative_position_bias", bidirectional=False)
        self.blocks = self._decoder_blocks()
        self.final_norm = self._norm("final_norm")
        self.lm_head = self._head()
        self.remat_blocks = 0  # the first `remat_blocks` blocks are rematerialised

    def set_block_remat(self, enabled=True):
        """Rematerialise decoder blocks in training (`keras.remat`).

        While training, the backward pass then keeps a rematerialised
        block's input only and recomputes its activations from it (one
        block's at a time) instead of holding its attention and feed-forward
        intermediates: less memory for about one more forward pass through
        it. Off by default; the values computed are the same. Inference and
        cached decoding are never rematerialised.

        Args:
            enabled: True (every block), False (none) or an int `n`: the
                first `n` blocks only, each saving one block's activations
                for one block's recomputation (the peak falls by about
                `n / num_layers` of what all of them save, and the time
                grows by as much of what all of them cost).
        """
        if isinstance(enabled, bool):
            count = len(self.blocks) if enabled else 0
        elif isinstance(enabled, (int, np.integer)) and 0 <= enabled <= len(self.blocks):
            count = int(enabled)
        else:
            raise TypeError(
                "Received an invalid value for argument `enabled`, expected True, False or a number of "
                f"blocks from 0 to {len(self.blocks)}. Received: enabled={enabled!r}")
        self.remat_blocks = count
        lora.reset_traces(self)
        return self

    def compile(self, *args, **kwargs):
        super().compile(*args, **kwargs)
        if self._chunked_loss() is not None and (kwargs.get("metrics") or kwargs.get("weighted_metrics")):
            raise ValueError(
                "A chunked CausalLMLoss trains on hidden states (the logits are never whole), "
                "so compiled metrics would see no logits. Compile without `metrics` and "
                "`weighted_metrics`, or with CausalLMLoss(chunk_size=None). Received: "
                f"metrics={kwargs.get('metrics')!r}, weighted_metrics={kwargs.get('weighted_metrics')!r}"
            )
        lora.reset_traces(self)

    def _chunked_loss(self):
        loss = getattr(self, "loss", None)
        if isinstance(loss, lm_loss.CausalLMLoss) and loss.chunk_size is not None:
            return loss
        return None

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        loss = self._chunked_loss()
        if loss is None or not training:
            return super().compute_loss(x, y, y_pred, sample_weight, training=training)
        # `call(training=True)` gave the final hidden states (see CausalLMLoss).
        total = loss.from_hidden(self, y_pred, y, sample_weight)
        for extra in self.losses:
            total = total + self._aggregate_additional_loss(extra)
        return total

    def _check_key_value_sources(self, sources):
        if sources is None:
            return None
        if not isinstance(sources, (list, tuple)) or len(sources) != self.num_layers:
            raise ValueError(
                "Received an invalid value for argument `key_value_sources`, expected None or "
                f"a list of one entry per layer ({self.num_layers}). Received: "
                f"key_value_sources={sources!r}"
            )
        windows = self.layer_sliding_windows()
        sources = list(sources)
        for i, j in enumerate(sources):
            if j is None:
                continue
            if isinstance(j, bool) or not isinstance(j, int) or not 0 <= j < i or sources[j] is not None:
                raise ValueError(
                    f"Received an invalid value for argument `key_value_sources[{i}]`, expected "
                    "None or the index of an earlier layer that projects its own keys and "
                    f"values. Received: key_value_sources={sources!r}"
                )
            for name, what, values in (
                ("sliding_window", "sliding window", windows),
                ("num_key_value_heads", "number of key/value heads", self.layer_num_key_value_heads()),
                ("head_dim", "head size", self.layer_head_dims()),
            ):
                if values[j] != values[i]:
                    raise ValueError(
                        f"Layer {i} reuses the keys and values of layer {j}, which has another "
                        f"{what} ({values[j]} vs {values[i]}); they must be equal. Received: "
                        f"key_value_sources={sources!r}, {name}={getattr(self, name)!r}"
                    )
        return sources

    def _decoder_block_options(self, index):
        sources = self.key_value_sources
        return dict(
            use_value_norm=self.use_value_norm,
            shared_key_value=sources is not None and sources[index] is not None,
            per_layer_input_dim=self.per_layer_input_dim,
            use_output_scale=self.use_output_scale,
        )

    def _cache_layers(self):
        """`(window, num_key_value_heads, head_dim)` of each layer that has a
        cache (those that project their own keys and values)."""
        sources = self.key_value_sources or [None] * self.num_layers
        return [c for c, j in zip(_LMBase._cache_layers(self), sources) if j is None]

    def _per_layer_inputs(self, token_ids, x):
        """`(B, T, num_layers, P)` per-layer inputs (None without them):
        Gemma 4's token table and projection of the scaled embeddings `x`."""
        if self.per_layer_embedding is None:
            return None
        layers, dim = self.num_layers, self.per_layer_input_dim
        shape = (ops.shape(x)[0], -1, layers, dim)
        tokens = self.per_layer_embedding(token_ids)
        tokens = ops.reshape(tokens * ops.cast(float(np.float32(dim**0.5)), tokens.dtype), shape)
        projected = self.per_layer_model_projection(x)
        projected = projected * ops.cast(self.hidden_dim**-0.5, projected.dtype)
        projected = self.per_layer_projection_norm(ops.reshape(projected, shape))
        return (projected + ops.cast(tokens, projected.dtype)) * ops.cast(2.0**-0.5, projected.dtype)

    def _run_blocks(self, x, per_layer_inputs, cache=None, cache_index=None, **kwargs):
        """Every block over `x`; with a cache, returns the new one too."""
        sources = self.key_value_sources or [None] * self.num_layers
        needed = {j for j in sources if j is not None}
        key_values = {}
        caches = iter(cache or ())
        new_cache = []
        for i, (block, source) in enumerate(zip(self.blocks, sources)):
            options = dict(kwargs)
            if per_layer_inputs is not None:
                options["per_layer_input"] = per_layer_inputs[:, :, i, :]
            if source is not None:
                options["key_value"] = key_values[source]
            elif cache is not None:
                options["cache"] = next(caches)
            if cache is not None:
                options["cache_index"] = cache_index
            if i in needed:
                options["return_key_value"] = True
            if i < self.remat_blocks and kwargs.get("training") and cache is None \
                    and source is None and i not in needed:
                out = _remat_block(block, x, options)
            else:
                out = block(x, **options)
            out = list(out) if isinstance(out, (tuple, list)) else [out]
            if i in needed:
                key_values[i] = out.pop()
            if cache is not None and source is None:
                new_cache.append(out.pop())
            x = out[0]
        return (x, new_cache) if cache is not None else x

    def call(self, token_ids, padding_mask=None, training=None):
        # `training` passed on by hand: `stateless_call` (the Trainer's XLA
        # path) calls `call` directly, without the call context through which
        # `__call__` tells the blocks (and their LoRA dropout) that they train.
        x = self._embed(self.embedding, token_ids)
        per_layer_inputs = self._per_layer_inputs(token_ids, x)
        bias = self._self_bias(self.position_bias, x)
        x = self._run_blocks(
            x, per_layer_inputs, decoder_padding_mask=padding_mask, decoder_attention_bias=bias,
            training=training,
        )
        if training and self._chunked_loss() is not None:
            return self.final_norm(x)  # the loss applies the head chunk by chunk
        return self._logits(self.embedding, self.final_norm(x))

    def call_with_cache(self, token_ids, cache, cache_index, padding_mask=None):
        """Logits of `token_ids` at positions `[cache_index, ...)` and the new cache.

        `padding_mask` (optional) is `(B, max_length)` over the cache.
        Positions past the cache raise a ValueError when statically known.
        """
        token_ids = ops.convert_to_tensor(token_ids)
        self._check_cache_write(token_ids, cache, cache_index)
        x = self._embed(self.embedding, token_ids, start_index=cache_index)
        per_layer_inputs = self._per_layer_inputs(token_ids, x)
        bias = self._self_bias(self.position_bias, x, cache, cache_index)
        x, new_cache = self._run_blocks(
            x, per_layer_inputs, cache=cache, cache_index=cache_index,
            decoder_padding_mask=padding_mask, decoder_attention_bias=bias,
        )
        return self._logits(self.embedding, self.final_norm(x)), new_cache

    # get_config keys `describe()` carries into the description, or that do
    # not change what inference computes. An option added to the model and
    # not here is recorded as unsupported by name, so no writer drops it
    # silently (tests/export/test_description.py checks this set against get_config).
    DESCRIBED_OPTIONS = frozenset({
        "name", "trainable", "dtype", "vocabulary_size", "sequence_length", "hidden_dim",
        "num_layers", "num_heads", "intermediate_dim", "num_key_value_heads", "position",
        "pad_token_id", "sliding_window", "activation", "layer_norm_epsilon", "tie_embeddings",
        "mask_padded_queries", "head_dim", "normalization", "use_gated_feedforward",
        "attention_use_bias", "attention_output_use_bias", "feedforward_use_bias",
        "lm_head_use_bias", "rope_max_wavelength", "rope_scaling", "embedding_scale",
        "relative_attention_num_buckets", "relative_attention_max_distance",
        "share_embeddings", "num_decoder_layers", "use_qk_norm", "use_sandwich_norm",
        "attention_logit_soft_cap", "final_logit_soft_cap", "local_rope_max_wavelength",
        "rotary_layers", "partial_rotary_factor", "key_value_sources", "per_layer_input_dim",
        "per_layer_input_vocabulary_size", "use_value_norm", "use_output_scale",
    })

    def describe(self):
        """What this model computes, as plain data (`keras_attn.description.Decoder`):
        the one description the ONNX and TFLite writers read. Weights are read
        when a writer asks (views of the variables where the backend allows).

        Example:

        >>> lm = DecoderOnlyLM(vocabulary_size=64, sequence_length=16, hidden_dim=32,
        ...                    num_layers=2, num_heads=4, intermediate_dim=64,
        ...                    position="rotary", normalization="rms_norm")
        >>> d = lm.describe()
        >>> d.num_layers, d.layers[0].attention.num_heads, d.layers[0].attention.query.kernel.shape
        (2, 4, (32, 32))
        """
        if not self.built:
            self(np.zeros((1, 1), "int32"))
        return description.read_decoder(self, self.DESCRIBED_OPTIONS)

    def get_config(self):
        config = super().get_config()
        config.update(
            key_value_sources=self.key_value_sources,
            per_layer_input_dim=self.per_layer_input_dim,
            per_layer_input_vocabulary_size=self.per_layer_input_vocabulary_size,
            use_value_norm=self.use_value_norm,
            use_output_scale=self.use_output_scale,
        )
        return config


@register
class Seq2SeqLM(_LMBase):
    """An encoder-decoder Transformer (`TransformerEncoderBlock`s + decoder blocks).

    `call((encoder_ids, decoder_ids))` gives decoder logits; the encoder's
    padding (`pad_token_id`) is masked in self- and cross-attention.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        for name in ("intermediate_dim", "num_key_value_heads", "head_dim"):
            if isinstance(getattr(self, name), list):
                raise ValueError(
                    f"Received an invalid value for argument `{name}`, expected one value for "
                    "every layer (a list of one per layer is for DecoderOnlyLM). Received: "
                    f"{name}={getattr(self, name)!r}"
                )
        self.encoder_embedding = self._embedding("encoder_embedding")
        rotary = self._rotary()
        self.encoder_blocks = [
            TransformerEncoderBlock(
                self.num_heads, intermediate_dim=self.intermediate_dim,
                num_key_value_heads=self.num_key_value_heads, key_dim=self.head_dim,
                normalize_first=True,
                rotary_embedding=rotary, name=f"encoder_{i}",
                **self._block_kwargs(),
            )
            for i in range(self.num_layers)
        ]
        self.encoder_norm = self._norm("encoder_norm")
        self.encoder_position_bias = self._relative_bias(
            "encoder_relative_position_bias", bidirectional=True
        )
        self.decoder_embedding = (
            self.encoder_embedding if self.share_embeddings
            else self._embedding("decoder_embedding")
        )
        self.position_bias = self._relative_bias(
            "decoder_relative_position_bias", bidirectional=False
        )
        self.blocks = self._decoder_blocks()
        self.final_norm = self._norm("final_norm")
        self.lm_head = self._head()

    def encode(self, encoder_ids):
        mask = ops.not_equal(encoder_ids, self.pad_token_id)
        x = self._embed(self.encoder_embedding, encoder_ids)
        bias = self._self_bias(self.encoder_position_bias, x)
        for block in self.encoder_blocks:
            x = block(x, padding_mask=mask, attention_bias=bias)
        return self.encoder_norm(x), mask

    def call(self, inputs):
        encoder_ids, decoder_ids = inputs
        encoded, mask = self.encode(encoder_ids)
        x = self._embed(self.decoder_embedding, decoder_ids)
        bias = self._self_bias(self.position_bias, x)
        for block in self.blocks:
            x = block(x, encoded, encoder_padding_mask=mask, decoder_attention_bias=bias)
        return self._logits(self.decoder_embedding, self.final_norm(x))

    def call_with_cache(self, token_ids, cache, cache_index, encoder_outputs=None,
                        encoder_padding_mask=None):
        """As `DecoderOnlyLM.call_with_cache`; the first call (prefill) needs
        `encoder_outputs` and fills the cross-attention caches, later calls
        need only `encoder_padding_mask`."""
        token_ids = ops.convert_to_tensor(token_ids)
        self._check_cache_write(token_ids, cache, cache_index)
        x = self._embed(self.decoder_embedding, token_ids, start_index=cache_index)
        bias = self._self_bias(self.position_bias, x, cache, cache_index)
        new_cache = []
        for block, layer_cache in zip(self.blocks, cache):
            x, layer_cache = block(
                x, encoder_outputs, encoder_padding_mask=encoder_padding_mask,
                cache=layer_cache, cache_index=cache_index, decoder_attention_bias=bias,
            )
            new_cache.append(layer_cache)
        return self._logits(self.decoder_embedding, self.final_norm(x)), new_cache
