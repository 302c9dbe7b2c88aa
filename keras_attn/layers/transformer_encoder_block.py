"""Transformer encoder block: self-attention and feed-forward."""

import keras

from keras_attn import checks
from keras_attn import saving
from keras_attn.layers import _peer_weights
from keras_attn.layers import _transformer
from keras_attn.ops import masking


@saving.register
class TransformerEncoderBlock(_transformer.BlockBase):
    """One Transformer encoder layer (Vaswani et al., 2017).

    Multi-head self-attention and a two-layer feed-forward network, each with
    a residual connection, dropout and LayerNorm: post-norm
    (`x = LN(x + f(x))`, the original) by default, pre-norm
    (`x = x + f(LN(x))`) with `normalize_first=True`. Weights have the same
    shapes and order as KerasHub's `TransformerEncoder`, and the sublayers
    its names except the attention: `self_attention` here,
    `self_attention_layer` there (the decoder's name in both).

    Args:
        num_heads: attention heads.
        intermediate_dim: hidden size of the feed-forward network.
        key_dim: size of each head; defaults to `features // num_heads`.
        dropout: dropout of the attention probabilities and of both residual
            branches.
        activation: activation of the feed-forward network.
        normalize_first: pre-norm if True, post-norm if False.
        layer_norm_epsilon: LayerNorm epsilon.
        num_key_value_heads: grouped-query attention (see `MultiHeadAttention`).
        kernel_initializer, bias_initializer: of every dense sublayer.
        rotary_embedding: optional `RotaryEmbedding` used in self-attention.
        sliding_window: optional int: self-attention sees only keys fewer
            than this many positions away (with the causal mask, the last
            `sliding_window` tokens; the decoder's cache can then be a ring
            buffer of that length, see `keras_attn.generation`).
        chunk_size: None, an int or `(q_chunk, k_chunk)`: memory-efficient
            exact attention in every attention sublayer (see
            `MultiHeadAttention`); None uses it only for long sequences, 0
            never.
        mask_padded_queries: True (default): a padding mask masks padded
            keys and zeroes the attention output of padded query rows. False:
            it masks keys only, so padded positions are computed as any
            other token (their outputs are not used, but they are finite and
            equal to what BERT, GPT-2 or KerasHub's blocks give there).
            Unpadded positions are the same either way.
        normalization: `"layer_norm"` (default) or `"rms_norm"` (Keras's
            `RMSNormalization`, scale only, as Llama, Mistral, Qwen2, Gemma
            and T5; `layer_norm_epsilon` is its epsilon).
        use_gated_feedforward: False (default): `output(act(intermediate(x)))`.
            True: `output(act(gate(x)) * intermediate(x))` with a third dense
            `feedforward_gate_dense` (SwiGLU with `activation="silu"`, GeGLU
            with a GELU; Shazeer, 2020).
        attention_use_bias: biases on the query/key/value projections.
        attention_output_use_bias: bias on the attention output projection;
            None follows `attention_use_bias` (Qwen2: True, False).
        feedforward_use_bias: biases on the feed-forward denses.
        use_qk_norm: an RMSNorm over each query and key head of every
            attention sublayer, before the rotary embedding (Qwen3, Gemma 3;
            `layer_norm_epsilon`; see `MultiHeadAttention`).
        use_sandwich_norm: with `normalize_first=True`, a second norm
            (`normalization`) on the output of each residual branch:
            `x + post_norm(f(norm(x)))` (Gemma 2 and 3). Sublayers
            `self_attention_post_norm`, `cross_attention_post_norm`,
            `feedforward_post_norm`.
        logit_soft_cap: None or a positive float: attention logits become
            `cap * tanh(logits / cap)` (Gemma 2; see `MultiHeadAttention`).
        layer_norm_use_bias: False: the LayerNorms scale without a bias
            (`center=False`; ModernBERT). No effect with `"rms_norm"`.
        use_self_attention_norm: False (pre-norm only): no norm before the
            self-attention, `x + attention(x)`, and no
            `self_attention_layer_norm` sublayer (ModernBERT's first layer,
            whose input is the normalized embedding).

    Call arguments:
        inputs: `(B, T, D)`.
        padding_mask: `(B, T)` valid-token mask; taken from the Keras mask of
            `inputs` when None.
        attention_mask: explicit mask (see `MultiHeadAttention`).
        attention_bias: additive logits bias, e.g. from `AlibiBias`.
        use_causal_mask: causal self-attention (for decoder-only stacks).
        training: dropout on/off.
        return_attention_scores: also return `(B, H, T, T)` scores.

    Returns:
        `(B, T, D)`, or `(output, scores)`.

    Example:

    >>> import numpy as np
    >>> block = TransformerEncoderBlock(num_heads=2, intermediate_dim=32)
    >>> tuple(block(np.random.rand(2, 5, 16).astype("float32")).shape)
    (2, 5, 16)

    A Llama-style pre-norm block (RMSNorm, SwiGLU, no biases, rotary GQA):

    >>> from keras_attn.layers import RotaryEmbedding
    >>> llama = TransformerEncoderBlock(
    ...     num_heads=4, num_key_value_heads=2, intermediate_dim=48, normalize_first=True,
    ...     normalization="rms_norm", use_gated_feedforward=True, activation="silu",
    ...     attention_use_bias=False, feedforward_use_bias=False,
    ...     rotary_embedding=RotaryEmbedding(), layer_norm_epsilon=1e-6)
    >>> y = llama(np.random.rand(2, 5, 16).astype("float32"), use_causal_mask=True)
    >>> sorted({w.path.split("/")[-2] for w in llama.weights if "feedforward" in w.path})
    ['feedforward_gate_dense', 'feedforward_intermediate_dense', 'feedforward_layer_norm', 'feedforward_output_dense']
    """

    @classmethod
    def from_keras_hub(cls, layer):
        """A block with the weights and outputs of a built `keras_hub.layers.TransformerEncoder`.

        Post-norm or pre-norm. Outputs
        equal KerasHub's except at padded query positions: our padding mask
        also zeroes the attention output of padded queries, KerasHub's masks
        keys only (docs/guides/coming_from.md). Call order differs too:
        KerasHub's `TransformerEncoder(intermediate_dim, num_heads)` is ours
        `(num_heads, intermediate_dim=...)`.
        """
        return _peer_weights.encoder_from_keras_hub(cls, layer)

    def __init__(self, num_heads, *args, use_self_attention_norm=True, **kwargs):
        super().__init__(num_heads, *args, **kwargs)
        self.use_self_attention_norm = checks.check_bool(
            "use_self_attention_norm", use_self_attention_norm
        )
        if not self.use_self_attention_norm and not self.normalize_first:
            raise ValueError(
                "`use_self_attention_norm=False` drops the norm before the attention of a "
                "pre-norm block: it needs `normalize_first=True`. Received: "
                f"use_self_attention_norm=False, normalize_first={self.normalize_first!r}"
            )

    def build(self, inputs_shape):
        checks.check_shape_rank("inputs", inputs_shape, 3, "(batch, seq, features)")
        self.self_attention = self._attention(
            "self_attention", inputs_shape[-1], self.rotary_embedding, self.sliding_window
        )
        self.self_attention.build(inputs_shape, inputs_shape)
        self.self_attention_layer_norm = None
        if self.use_self_attention_norm:
            self.self_attention_layer_norm = self._norm("self_attention_layer_norm")
            self.self_attention_layer_norm.build(inputs_shape)
        self.self_attention_post_norm = self._post_norm("self_attention_post_norm", inputs_shape)
        self.self_attention_dropout = self._dropout("self_attention_dropout")
        self._build_feedforward(inputs_shape)
        self.built = True

    def call(
        self,
        inputs,
        padding_mask=None,
        attention_mask=None,
        *,
        attention_bias=None,
        use_causal_mask=False,
        training=None,
        return_attention_scores=False,
    ):
        if padding_mask is None:
            padding_mask = masking.keras_mask_of(inputs)

        def attend(x):
            # Scores only when asked: they force the full (T, T) probabilities
            # and rule out the blocked attention path.
            result = self.self_attention(
                x,
                x,
                query_mask=self._query_padding(padding_mask),
                value_mask=padding_mask,
                attention_mask=attention_mask,
                attention_bias=attention_bias,
                use_causal_mask=use_causal_mask,
                return_attention_scores=return_attention_scores,
                training=training,
            )
            return result if return_attention_scores else (result, None)

        x, scores = self._residual(
            inputs, self.self_attention_layer_norm, self.self_attention_dropout, attend, training,
            self.self_attention_post_norm,
        )
        x = self._feedforward(x, training)
        if return_attention_scores:
            return x, scores
        return x

    def get_config(self):
        config = super().get_config()
        config["use_self_attention_norm"] = self.use_self_attention_norm
        return config

    def compute_output_spec(self, inputs, return_attention_scores=False, **kwargs):
        out = keras.KerasTensor(inputs.shape, dtype=self.compute_dtype)
        if not return_attention_scores:
            return out
        b, t = inputs.shape[0], inputs.shape[1]
        return out, keras.KerasTensor((b, self.num_heads, t, t), dtype=self.compute_dtype)
