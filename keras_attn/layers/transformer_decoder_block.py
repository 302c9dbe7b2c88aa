"""Transformer decoder block: causal self-attention, cross-attention, feed-forward."""

import keras
from keras import ops

from keras_attn import checks
from keras_attn import saving
from keras_attn.layers import _peer_weights
from keras_attn.layers import _transformer
from keras_attn.layers import activations
from keras_attn.ops import masking


# Self-attention takes its keys and values from its (normalised) query.
_SAME_AS_QUERY = object()


@saving.register
class TransformerDecoderBlock(_transformer.BlockBase):
    """One Transformer decoder layer (Vaswani et al., 2017).

    Causal self-attention, then cross-attention over `encoder_sequence`
    (skipped when it is None, so the block also serves decoder-only models),
    then the feed-forward network; each with a residual connection, dropout
    and LayerNorm (post-norm by default, pre-norm with `normalize_first`).
    Sublayer names follow KerasHub's `TransformerDecoder`.

    Args: as `TransformerEncoderBlock` (but `use_self_attention_norm`), and
        for the self-attention:
        use_value_norm: an RMSNorm without scale over each value head
            (Gemma 4; see `MultiHeadAttention`).
        shared_key_value: the self-attention has no key/value projections and
            attends over another block's keys and values, passed as
            `key_value=` (what that block returned with
            `return_key_value=True`); such a block has no self-attention
            cache (Gemma 4's KV-shared layers; see `MultiHeadAttention`).
        per_layer_input_dim: None, or the size `P` of a per-layer input
            (Gemma 4's per-layer embeddings): after the feed-forward branch,
            `x + norm(projection(act(gate(x)) * per_layer_input))` with
            `gate` `(D -> P)` and `projection` `(P -> D)` denses without bias
            (`per_layer_input_gate`, `per_layer_input_projection`), the
            feed-forward's `activation` and a `normalization` norm
            (`per_layer_input_norm`). Each call then takes `per_layer_input`.
        use_output_scale: the block's output is multiplied by a scalar
            weight `output_scale` (initialized to 1, not trained; Gemma 4's
            `layer_scalar`).

    Call arguments:
        decoder_sequence: `(B, T_dec, D)`.
        encoder_sequence: `(B, T_enc, D_enc)` or None.
        decoder_padding_mask: `(B, T_dec)`; from the Keras mask when None.
        encoder_padding_mask: `(B, T_enc)`; from the Keras mask when None.
        decoder_attention_mask: explicit self-attention mask.
        encoder_attention_mask: explicit cross-attention mask.
        decoder_attention_bias: additive self-attention logits bias
            `(B|1, H|1, T_dec, T_keys)` (e.g. a causal `RelativePositionBias`;
            with a cache, `T_keys` is the cache length).
        use_causal_mask: causal self-attention (default True).
        training: dropout on/off.
        return_attention_scores: also return a dict of scores:
            `{"self_attention": (B, H, T_dec, T_dec)}` plus
            `"cross_attention": (B, H, T_dec, T_enc)` when there is an encoder.
        cache: for incremental decoding, `{"self_attention": (k, v),
            "cross_attention": (k, v) or None}` with `(B, max_length, H_kv,
            head_dim)` self-attention caches (see `keras_attn.generation`).
        cache_index: position of the first token of `decoder_sequence`.
        per_layer_input: `(B, T_dec, per_layer_input_dim)`, with
            `per_layer_input_dim` only.
        return_key_value: also return (last) the self-attention's keys and
            values, for a `shared_key_value` block's `key_value=`.
        key_value: with `shared_key_value` only: another block's keys and
            values (with `cache_index` when that block's call was cached).
        self_attention_cache, self_attention_cache_update_index,
        cross_attention_cache, cross_attention_cache_update_index:
            KerasHub's `TransformerDecoder` cache arguments, for code written
            against it: stacked caches `(B, 2, max_length, H_kv, head_dim)`
            (keys, values). The self-attention cache is written at
            `self_attention_cache_update_index`; the cross-attention cache is
            computed from `encoder_sequence` and written at
            `cross_attention_cache_update_index` (usually 0), or used as it
            is when that index is None. Not combined with `cache=`.

    Returns:
        `(B, T_dec, D)`, or `(output, scores_dict)`; with a cache the updated
        cache dict is appended. With KerasHub's cache arguments, as KerasHub:
        `(output, self_attention_cache)`, plus `cross_attention_cache` when the
        block has cross-attention (scores, if asked for, come after `output`).

    Example:

    >>> import numpy as np
    >>> block = TransformerDecoderBlock(num_heads=2, intermediate_dim=32)
    >>> dec = np.random.rand(2, 4, 16).astype("float32")
    >>> enc = np.random.rand(2, 7, 16).astype("float32")
    >>> out, scores = block(dec, enc, return_attention_scores=True)
    >>> tuple(out.shape), tuple(scores["cross_attention"].shape)
    ((2, 4, 16), (2, 2, 4, 7))
    """

    def __init__(
        self,
        num_heads,
        *args,
        use_value_norm=False,
        shared_key_value=False,
        per_layer_input_dim=None,
        use_output_scale=False,
        **kwargs,
    ):
        super().__init__(num_heads, *args, **kwargs)
        self.use_value_norm = checks.check_bool("use_value_norm", use_value_norm)
        self.shared_key_value = checks.check_bool("shared_key_value", shared_key_value)
        self.per_layer_input_dim = checks.check_positive_int(
            "per_layer_input_dim", per_layer_input_dim, allow_none=True
        )
        self.use_output_scale = checks.check_bool("use_output_scale", use_output_scale)

    @classmethod
    def from_keras_hub(cls, layer):
        """A block with the weights and outputs of a built `keras_hub.layers.TransformerDecoder`.

        Post-norm or pre-norm, with or without cross-attention. Outputs
        equal KerasHub's except at padded query positions: our padding mask
        also zeroes the attention output of padded queries, KerasHub's masks
        keys only (docs/guides/coming_from.md). Call order differs too:
        KerasHub's `TransformerDecoder(intermediate_dim, num_heads)` is ours
        `(num_heads, intermediate_dim=...)`; and pass masks by keyword.
        """
        return _peer_weights.decoder_from_keras_hub(cls, layer)

    def build(self, decoder_sequence_shape, encoder_sequence_shape=None):
        layout = "(batch, seq, features)"
        checks.check_shape_rank("decoder_sequence", decoder_sequence_shape, 3, layout)
        hidden = decoder_sequence_shape[-1]
        self.self_attention = self._attention(
            "self_attention", hidden, self.rotary_embedding, self.sliding_window,
            use_value_norm=self.use_value_norm, shared_key_value=self.shared_key_value,
        )
        self.self_attention.build(decoder_sequence_shape, decoder_sequence_shape)
        self.self_attention_layer_norm = self._norm("self_attention_layer_norm")
        self.self_attention_layer_norm.build(decoder_sequence_shape)
        self.self_attention_post_norm = self._post_norm(
            "self_attention_post_norm", decoder_sequence_shape
        )
        self.self_attention_dropout = self._dropout("self_attention_dropout")
        self.cross_attention = None
        if encoder_sequence_shape is not None:
            checks.check_shape_rank("encoder_sequence", encoder_sequence_shape, 3, layout)
            self.cross_attention = self._attention("cross_attention", hidden, None)
            self.cross_attention.build(decoder_sequence_shape, encoder_sequence_shape)
            self.cross_attention_layer_norm = self._norm("cross_attention_layer_norm")
            self.cross_attention_layer_norm.build(decoder_sequence_shape)
            self.cross_attention_post_norm = self._post_norm(
                "cross_attention_post_norm", decoder_sequence_shape
            )
            self.cross_attention_dropout = self._dropout("cross_attention_dropout")
        self._build_feedforward(decoder_sequence_shape)
        self._build_per_layer_input(decoder_sequence_shape)
        self.output_scale = None
        if self.use_output_scale:
            self.output_scale = self.add_weight(
                shape=(1,), initializer="ones", trainable=False, name="output_scale"
            )
        self.built = True

    def _build_per_layer_input(self, sequence_shape):
        self.per_layer_input_gate = self.per_layer_input_projection = None
        self.per_layer_input_norm = None
        if self.per_layer_input_dim is None:
            return
        hidden, dim = sequence_shape[-1], self.per_layer_input_dim
        self.per_layer_input_gate = keras.layers.Dense(
            dim, use_bias=False, name="per_layer_input_gate", **self._dense_kwargs()
        )
        self.per_layer_input_gate.build(sequence_shape)
        self.per_layer_input_projection = keras.layers.Dense(
            hidden, use_bias=False, name="per_layer_input_projection", **self._dense_kwargs()
        )
        self.per_layer_input_projection.build(tuple(sequence_shape[:-1]) + (dim,))
        self.per_layer_input_norm = self._norm("per_layer_input_norm")
        self.per_layer_input_norm.build(sequence_shape)

    def _add_per_layer_input(self, x, per_layer_input):
        if self.per_layer_input_dim is None:
            if per_layer_input is not None:
                raise ValueError(
                    "`per_layer_input` needs a block built with `per_layer_input_dim`. "
                    f"Received: per_layer_input.shape={tuple(per_layer_input.shape)}"
                )
            return x
        if per_layer_input is None or per_layer_input.shape[-1] != self.per_layer_input_dim:
            raise ValueError(
                "A block with `per_layer_input_dim` needs `per_layer_input` of shape (batch, "
                f"seq, {self.per_layer_input_dim}). Received: per_layer_input="
                f"{None if per_layer_input is None else tuple(per_layer_input.shape)}"
            )
        h = activations.get(self.activation)(self.per_layer_input_gate(x))
        h = h * ops.cast(per_layer_input, h.dtype)
        return x + self.per_layer_input_norm(self.per_layer_input_projection(h))

    def call(
        self,
        decoder_sequence,
        encoder_sequence=None,
        *,
        decoder_padding_mask=None,
        encoder_padding_mask=None,
        decoder_attention_mask=None,
        encoder_attention_mask=None,
        decoder_attention_bias=None,
        use_causal_mask=True,
        training=None,
        return_attention_scores=False,
        cache=None,
        cache_index=None,
        self_attention_cache=None,
        self_attention_cache_update_index=None,
        cross_attention_cache=None,
        cross_attention_cache_update_index=None,
        per_layer_input=None,
        return_key_value=False,
        key_value=None,
    ):
        hub_cache = (
            self_attention_cache,
            self_attention_cache_update_index,
            cross_attention_cache,
            cross_attention_cache_update_index,
        )
        if any(arg is not None for arg in hub_cache):
            return self._call_with_keras_hub_cache(
                decoder_sequence,
                encoder_sequence,
                *hub_cache,
                cache=cache,
                cache_index=cache_index,
                decoder_padding_mask=decoder_padding_mask,
                encoder_padding_mask=encoder_padding_mask,
                decoder_attention_mask=decoder_attention_mask,
                encoder_attention_mask=encoder_attention_mask,
                decoder_attention_bias=decoder_attention_bias,
                use_causal_mask=use_causal_mask,
                training=training,
                return_attention_scores=return_attention_scores,
            )
        cached = cache is not None
        # A shared-key/value block in a cached call: no cache of its own.
        incremental = cached or (self.shared_key_value and cache_index is not None)
        if cached:
            cross_cache = self._check_cache(cache, cache_index, encoder_sequence)
        else:
            self._check_encoder(encoder_sequence, None if incremental else cache_index)
        if decoder_padding_mask is None and not incremental:
            decoder_padding_mask = masking.keras_mask_of(decoder_sequence)
        if encoder_sequence is not None and encoder_padding_mask is None:
            encoder_padding_mask = masking.keras_mask_of(encoder_sequence)
        new_cache = {}
        key_values = {}

        def attend(name, value, layer_cache, **kwargs):
            """One attention sublayer as a residual branch: `x -> (out, scores)`."""
            layer = getattr(self, name)

            def branch(x):
                if cached:
                    kwargs["cache"] = layer_cache
                # Scores only when asked: they force the full (T, T)
                # probabilities and rule out the blocked attention path.
                result = layer(
                    x,
                    x if value is _SAME_AS_QUERY else value,
                    return_attention_scores=return_attention_scores,
                    training=training,
                    **kwargs,
                )
                # (output, [scores], [cache], [key_value])
                result = list(result) if isinstance(result, (tuple, list)) else [result]
                if kwargs.get("return_key_value"):
                    key_values[name] = result.pop()
                if cached:
                    new_cache[name] = result.pop()
                return result[0], (result[1] if return_attention_scores else None)

            return branch

        # With a cache, `decoder_padding_mask` masks keys only: `(B,
        # max_length)` over the cached positions (left-padded prompts), or
        # `(B, T_dec)` over the new tokens (e.g. their Keras mask).
        self_branch = attend(
            "self_attention",
            _SAME_AS_QUERY,
            cache["self_attention"] if cached else None,
            query_mask=None if incremental else self._query_padding(decoder_padding_mask),
            value_mask=decoder_padding_mask,
            attention_mask=decoder_attention_mask,
            attention_bias=decoder_attention_bias,
            use_causal_mask=use_causal_mask,
            **({"cache_index": cache_index} if incremental else {}),
            **({"return_key_value": True} if return_key_value else {}),
            **({"key_value": key_value} if key_value is not None else {}),
        )
        x, self_scores = self._residual(
            decoder_sequence,
            self.self_attention_layer_norm,
            self.self_attention_dropout,
            self_branch,
            training,
            self.self_attention_post_norm,
        )
        scores = {"self_attention": self_scores}
        if self.cross_attention is not None:
            cross_branch = attend(
                "cross_attention",
                None if cached else encoder_sequence,
                cross_cache if cached else None,
                query_mask=None if cached else self._query_padding(decoder_padding_mask),
                value_mask=encoder_padding_mask,
                attention_mask=encoder_attention_mask,
            )
            x, scores["cross_attention"] = self._residual(
                x,
                self.cross_attention_layer_norm,
                self.cross_attention_dropout,
                cross_branch,
                training,
                self.cross_attention_post_norm,
            )
        x = self._feedforward(x, training)
        x = self._add_per_layer_input(x, per_layer_input)
        if self.output_scale is not None:
            x = x * ops.cast(self.output_scale, x.dtype)
        outputs = (x, scores) if return_attention_scores else (x,)
        if cached:
            outputs += (new_cache,)
        if return_key_value:
            outputs += (key_values["self_attention"],)
        return outputs if len(outputs) > 1 else x

    def _call_with_keras_hub_cache(
        self,
        decoder_sequence,
        encoder_sequence,
        self_cache,
        self_index,
        cross_cache,
        cross_index,
        *,
        cache,
        cache_index,
        **kwargs,
    ):
        """KerasHub's stacked-cache call, run as a `cache=` / `cache_index=` call."""
        if cache is not None or cache_index is not None:
            raise ValueError(
                "Pass either `cache`/`cache_index` or KerasHub's "
                "`self_attention_cache`/`cross_attention_cache` arguments, not both."
            )
        if self_cache is None or self_index is None:
            raise ValueError(
                "KerasHub-style cached calls need `self_attention_cache` "
                "`(batch, 2, max_length, num_key_value_heads, head_dim)` and "
                "`self_attention_cache_update_index` (where the new tokens are "
                f"written). Received: self_attention_cache="
                f"{None if self_cache is None else tuple(self_cache.shape)}, "
                f"self_attention_cache_update_index={self_index!r}"
            )
        has_cross = self.cross_attention is not None
        if has_cross != (cross_cache is not None):
            raise ValueError(
                "A block with cross-attention needs both `self_attention_cache` "
                "and `cross_attention_cache`; one without needs no "
                "`cross_attention_cache`. Received: cross_attention_cache="
                f"{None if cross_cache is None else tuple(cross_cache.shape)} "
                f"for a block {'with' if has_cross else 'without'} cross-attention"
            )
        for name, stacked in (("self_attention_cache", self_cache), ("cross_attention_cache", cross_cache)):
            if stacked is not None and (len(stacked.shape) != 5 or stacked.shape[1] != 2):
                raise ValueError(
                    f"Received an invalid `{name}`: expected shape (batch, 2, "
                    "length, num_key_value_heads, head_dim) (keys, values). "
                    f"Received: {name}.shape={tuple(stacked.shape)}"
                )
        ours = {"self_attention": (self_cache[:, 0], self_cache[:, 1])}
        if has_cross:
            keys, values = cross_cache[:, 0], cross_cache[:, 1]
            if cross_index is not None:
                if encoder_sequence is None:
                    raise ValueError(
                        "`cross_attention_cache_update_index` writes the encoder's "
                        "keys and values into the cache: pass `encoder_sequence`."
                    )
                new_k, new_v = self.cross_attention.project_key_value(encoder_sequence)
                start = [0, cross_index, 0, 0]
                keys = ops.slice_update(keys, start, ops.cast(new_k, keys.dtype))
                values = ops.slice_update(values, start, ops.cast(new_v, values.dtype))
            ours["cross_attention"] = (keys, values)
        *result, new_cache = self.call(
            decoder_sequence, encoder_sequence, cache=ours, cache_index=self_index, **kwargs
        )
        stacked = [ops.stack(new_cache["self_attention"], axis=1)]
        if has_cross:
            stacked.append(ops.stack(new_cache["cross_attention"], axis=1))
        return tuple(result) + tuple(stacked)

    def _check_encoder(self, encoder_sequence, cache_index):
        if cache_index is not None:
            raise ValueError(
                "`cache_index` was given without a `cache`. Received: "
                f"cache_index={cache_index!r}, cache=None"
            )
        if encoder_sequence is not None and self.cross_attention is None:
            raise ValueError(
                "This TransformerDecoderBlock was built without an "
                "`encoder_sequence`, so it has no cross-attention weights; it "
                "cannot be called with one. Build or first call it with "
                "`encoder_sequence` for an encoder-decoder model."
            )
        if encoder_sequence is None and self.cross_attention is not None:
            raise ValueError(
                "This TransformerDecoderBlock has cross-attention; it must be "
                "called with `encoder_sequence`."
            )

    def _check_cache(self, cache, cache_index, encoder_sequence):
        """Validates a decoding cache; returns the cross-attention `(k, v)` (or None).

        `cache["self_attention"]` is `(B, max_length, H_kv, head_dim)` twice;
        the new tokens are written at `cache_index`. `cache["cross_attention"]`
        holds the projected encoder keys/values: when it is missing or None it
        is computed from `encoder_sequence` (prefill) and returned in the new
        cache, so later steps reuse it and may pass `encoder_sequence=None`.
        """
        if not isinstance(cache, dict) or "self_attention" not in cache:
            raise ValueError(
                "Received an invalid value for argument `cache`, expected a dict "
                "with a `self_attention` (key, value) pair and, for "
                "encoder-decoder blocks, a `cross_attention` pair (or None). "
                f"Received: cache={cache!r}"
            )
        if cache_index is None:
            raise ValueError(
                "A decoder-block cache needs `cache_index`, the position of the "
                "first new token. Received: cache_index=None"
            )
        cross_cache = cache.get("cross_attention")
        if self.cross_attention is None and (
            encoder_sequence is not None or cross_cache is not None
        ):
            raise ValueError(
                "This TransformerDecoderBlock was built without an "
                "`encoder_sequence`; it has no cross-attention. Received an "
                "`encoder_sequence` or a `cross_attention` cache."
            )
        if self.cross_attention is not None and cross_cache is None:
            if encoder_sequence is None:
                raise ValueError(
                    "This TransformerDecoderBlock has cross-attention: pass "
                    "`encoder_sequence` (prefill) or a `cross_attention` cache."
                )
            cross_cache = self.cross_attention.project_key_value(encoder_sequence)
        return cross_cache

    def compute_output_spec(
        self, decoder_sequence, encoder_sequence=None, return_attention_scores=False, **kwargs
    ):
        out = keras.KerasTensor(decoder_sequence.shape, dtype=self.compute_dtype)
        if not return_attention_scores:
            return out
        b, t = decoder_sequence.shape[0], decoder_sequence.shape[1]
        scores = {
            "self_attention": keras.KerasTensor(
                (b, self.num_heads, t, t), dtype=self.compute_dtype
            )
        }
        if encoder_sequence is not None:
            scores["cross_attention"] = keras.KerasTensor(
                (b, self.num_heads, t, encoder_sequence.shape[1]), dtype=self.compute_dtype
            )
        return out, scores

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "use_value_norm": self.use_value_norm,
                "shared_key_value": self.shared_key_value,
                "per_layer_input_dim": self.per_layer_input_dim,
                "use_output_scale": self.use_output_scale,
            }
        )
        return config
