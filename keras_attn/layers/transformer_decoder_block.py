"""Transformer decoder block: causal self-attention, cross-attention, feed-forward."""

import keras

from keras_attn.layers import _common
from keras_attn.layers import _transformer
from keras_attn.ops import masking


@_common.register
class TransformerDecoderBlock(_transformer.BlockBase):
    """One Transformer decoder layer (Vaswani et al., 2017).

    Causal self-attention, then cross-attention over `encoder_sequence`
    (skipped when it is None, so the block also serves decoder-only models),
    then the feed-forward network; each with a residual connection, dropout
    and LayerNorm (post-norm by default, pre-norm with `normalize_first`).
    Sublayer names follow KerasHub's `TransformerDecoder`.

    Args: as `TransformerEncoderBlock`.

    Call arguments:
        decoder_sequence: `(B, T_dec, D)`.
        encoder_sequence: `(B, T_enc, D_enc)` or None.
        decoder_padding_mask: `(B, T_dec)`; from the Keras mask when None.
        encoder_padding_mask: `(B, T_enc)`; from the Keras mask when None.
        decoder_attention_mask: explicit self-attention mask.
        encoder_attention_mask: explicit cross-attention mask.
        use_causal_mask: causal self-attention (default True).
        training: dropout on/off.
        return_attention_scores: also return a dict of scores:
            `{"self_attention": (B, H, T_dec, T_dec)}` plus
            `"cross_attention": (B, H, T_dec, T_enc)` when there is an encoder.
        cache: for incremental decoding, `{"self_attention": (k, v),
            "cross_attention": (k, v) or None}` with `(B, max_length, H_kv,
            head_dim)` self-attention caches (see `keras_attn.generation`).
        cache_index: position of the first token of `decoder_sequence`.

    Returns:
        `(B, T_dec, D)`, or `(output, scores_dict)`; with a cache the updated
        cache dict is appended.

    Example:

    >>> import numpy as np
    >>> block = TransformerDecoderBlock(num_heads=2, intermediate_dim=32)
    >>> dec = np.random.rand(2, 4, 16).astype("float32")
    >>> enc = np.random.rand(2, 7, 16).astype("float32")
    >>> out, scores = block(dec, enc, return_attention_scores=True)
    >>> tuple(out.shape), tuple(scores["cross_attention"].shape)
    ((2, 4, 16), (2, 2, 4, 7))
    """

    def build(self, decoder_sequence_shape, encoder_sequence_shape=None):
        layout = "(batch, seq, features)"
        _common.check_shape_rank("decoder_sequence", decoder_sequence_shape, 3, layout)
        hidden = decoder_sequence_shape[-1]
        self.self_attention = self._attention(
            "self_attention", hidden, self.rotary_embedding, self.sliding_window
        )
        self.self_attention.build(decoder_sequence_shape, decoder_sequence_shape)
        self.self_attention_layer_norm = self._norm("self_attention_layer_norm")
        self.self_attention_layer_norm.build(decoder_sequence_shape)
        self.self_attention_dropout = self._dropout("self_attention_dropout")
        self.cross_attention = None
        if encoder_sequence_shape is not None:
            _common.check_shape_rank("encoder_sequence", encoder_sequence_shape, 3, layout)
            self.cross_attention = self._attention("cross_attention", hidden, None)
            self.cross_attention.build(decoder_sequence_shape, encoder_sequence_shape)
            self.cross_attention_layer_norm = self._norm("cross_attention_layer_norm")
            self.cross_attention_layer_norm.build(decoder_sequence_shape)
            self.cross_attention_dropout = self._dropout("cross_attention_dropout")
        self._build_feedforward(decoder_sequence_shape)
        self.built = True

    def call(
        self,
        decoder_sequence,
        encoder_sequence=None,
        decoder_padding_mask=None,
        encoder_padding_mask=None,
        decoder_attention_mask=None,
        encoder_attention_mask=None,
        use_causal_mask=True,
        training=None,
        return_attention_scores=False,
        cache=None,
        cache_index=None,
    ):
        if cache is not None:
            return self._call_with_cache(
                decoder_sequence,
                encoder_sequence,
                cache=cache,
                cache_index=cache_index,
                decoder_padding_mask=decoder_padding_mask,
                encoder_padding_mask=encoder_padding_mask,
                decoder_attention_mask=decoder_attention_mask,
                encoder_attention_mask=encoder_attention_mask,
                use_causal_mask=use_causal_mask,
                training=training,
                return_attention_scores=return_attention_scores,
            )
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
        if decoder_padding_mask is None:
            decoder_padding_mask = masking.keras_mask_of(decoder_sequence)
        if encoder_sequence is not None and encoder_padding_mask is None:
            encoder_padding_mask = masking.keras_mask_of(encoder_sequence)

        def self_attend(x):
            # Scores only when asked: they force the full (T, T) probabilities
            # and rule out the blocked attention path.
            result = self.self_attention(
                x,
                x,
                query_mask=decoder_padding_mask,
                value_mask=decoder_padding_mask,
                attention_mask=decoder_attention_mask,
                use_causal_mask=use_causal_mask,
                return_attention_scores=return_attention_scores,
                training=training,
            )
            return result if return_attention_scores else (result, None)

        x, self_scores = self._residual(
            decoder_sequence,
            self.self_attention_layer_norm,
            self.self_attention_dropout,
            self_attend,
            training,
        )
        scores = {"self_attention": self_scores}
        if encoder_sequence is not None:

            def cross_attend(x):
                result = self.cross_attention(
                    x,
                    encoder_sequence,
                    query_mask=decoder_padding_mask,
                    value_mask=encoder_padding_mask,
                    attention_mask=encoder_attention_mask,
                    return_attention_scores=return_attention_scores,
                    training=training,
                )
                return result if return_attention_scores else (result, None)

            x, scores["cross_attention"] = self._residual(
                x,
                self.cross_attention_layer_norm,
                self.cross_attention_dropout,
                cross_attend,
                training,
            )
        x = self._feedforward(x, training)
        if return_attention_scores:
            return x, scores
        return x

    def _call_with_cache(
        self,
        decoder_sequence,
        encoder_sequence,
        *,
        cache,
        cache_index,
        decoder_padding_mask,
        encoder_padding_mask,
        decoder_attention_mask,
        encoder_attention_mask,
        use_causal_mask,
        training,
        return_attention_scores,
    ):
        """Incremental decoding: `cache` is a dict of `(key, value)` pairs.

        `cache["self_attention"]` is `(B, max_length, H_kv, head_dim)` twice;
        the new tokens are written at `cache_index`. `cache["cross_attention"]`
        holds the projected encoder keys/values: when it is missing or None it
        is computed from `encoder_sequence` (prefill) and returned, so later
        steps reuse it and may pass `encoder_sequence=None`. In this mode
        `decoder_padding_mask`, if given, is a `(B, max_length)` mask over
        the cached positions (for left-padded prompts).
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
        if encoder_sequence is not None and encoder_padding_mask is None:
            encoder_padding_mask = masking.keras_mask_of(encoder_sequence)
        new_cache = {}

        def self_attend(x):
            out, scores, new_cache["self_attention"] = self.self_attention(
                x,
                x,
                value_mask=decoder_padding_mask,
                attention_mask=decoder_attention_mask,
                use_causal_mask=use_causal_mask,
                return_attention_scores=True,
                training=training,
                cache=cache["self_attention"],
                cache_index=cache_index,
            )
            return out, scores

        x, self_scores = self._residual(
            decoder_sequence,
            self.self_attention_layer_norm,
            self.self_attention_dropout,
            self_attend,
            training,
        )
        scores = {"self_attention": self_scores}
        if self.cross_attention is not None:

            def cross_attend(x):
                out, scores, new_cache["cross_attention"] = self.cross_attention(
                    x,
                    None,
                    value_mask=encoder_padding_mask,
                    attention_mask=encoder_attention_mask,
                    return_attention_scores=True,
                    training=training,
                    cache=cross_cache,
                )
                return out, scores

            x, scores["cross_attention"] = self._residual(
                x,
                self.cross_attention_layer_norm,
                self.cross_attention_dropout,
                cross_attend,
                training,
            )
        x = self._feedforward(x, training)
        if return_attention_scores:
            return x, scores, new_cache
        return x, new_cache

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
