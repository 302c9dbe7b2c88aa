"""Pieces shared by the Transformer encoder and decoder blocks."""

import keras
from keras import ops

from keras_attn import checks
from keras_attn.layers import _common
from keras_attn.layers import activations
from keras_attn.layers._layer_norm import LastAxisLayerNorm
from keras_attn.layers.multi_head_attention import MultiHeadAttention
from keras_attn.layers.rotary_embedding import check_rotary_embedding
from keras_attn.ops import dispatch


class BlockBase(keras.layers.Layer):
    """Argument checks, sublayer factories and the residual pattern."""

    def __init__(
        self,
        num_heads,
        *args,
        intermediate_dim=None,
        key_dim=None,
        dropout=0.0,
        activation="relu",
        normalize_first=False,
        layer_norm_epsilon=1e-5,
        num_key_value_heads=None,
        kernel_initializer="glorot_uniform",
        bias_initializer="zeros",
        rotary_embedding=None,
        sliding_window=None,
        chunk_size=None,
        mask_padded_queries=True,
        normalization="layer_norm",
        use_gated_feedforward=False,
        attention_use_bias=True,
        attention_output_use_bias=None,
        feedforward_use_bias=True,
        use_qk_norm=False,
        use_sandwich_norm=False,
        logit_soft_cap=None,
        layer_norm_use_bias=True,
        **kwargs,
    ):
        name = type(self).__name__
        if args:
            # KerasHub's TransformerEncoder/Decoder take `(intermediate_dim,
            # num_heads)`: a positional second argument would silently swap them.
            raise TypeError(
                f"{name} takes `num_heads` as its only positional argument; pass "
                f"the others by keyword, e.g. {name}(num_heads=4, intermediate_dim=64). "
                "(KerasHub's blocks take `(intermediate_dim, num_heads)` positionally; "
                "keyword arguments keep such a call from building another block.) "
                f"Received positional arguments: {(num_heads,) + args!r}"
            )
        super().__init__(**kwargs)
        self.num_heads = checks.check_positive_int("num_heads", num_heads)
        self.intermediate_dim = checks.check_positive_int("intermediate_dim", intermediate_dim)
        self.key_dim = checks.check_positive_int("key_dim", key_dim, allow_none=True)
        self.dropout = checks.check_dropout("dropout", dropout)
        self.chunk_size = checks.check_layer_chunk_size(chunk_size, self.dropout)
        activations.get(activation)  # raises a ValueError naming `activation`
        self.activation = activation
        self.normalize_first = checks.check_bool("normalize_first", normalize_first)
        self.layer_norm_epsilon = checks.check_positive_float("layer_norm_epsilon", layer_norm_epsilon)
        self.num_key_value_heads = checks.check_num_key_value_heads(
            num_key_value_heads, num_heads
        )
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self.bias_initializer = keras.initializers.get(bias_initializer)
        rotary_embedding = check_rotary_embedding(rotary_embedding)
        self.rotary_embedding = rotary_embedding
        # Self-attention only: each query sees keys fewer than `sliding_window`
        # positions away (causal in the decoder, so a ring-buffer cache of
        # that length suffices for generation).
        self.sliding_window = checks.check_positive_int(
            "sliding_window", sliding_window, allow_none=True
        )
        # False: padding masks only keys, and padded positions are computed
        # like any token (BERT, GPT-2 and KerasHub semantics); True also
        # zeroes the attention output of padded query rows.
        self.mask_padded_queries = checks.check_bool("mask_padded_queries", mask_padded_queries)
        # "rms_norm": Keras's RMSNormalization (scale only; Llama, Gemma, T5);
        # use_gated_feedforward: `output(activation(gate(x)) * intermediate(x))`
        # (SwiGLU with "silu", GeGLU with a GELU; Shazeer, 2020).
        for name, value in checks.check_block_switches(
            normalization, use_gated_feedforward, attention_use_bias,
            attention_output_use_bias, feedforward_use_bias,
        ).items():
            setattr(self, name, value)
        # RMSNorm of each query and key head in every attention sublayer
        # (Qwen3, Gemma 3), with `layer_norm_epsilon`.
        self.use_qk_norm = checks.check_bool("use_qk_norm", use_qk_norm)
        # A second norm on each residual branch's output, `x + post(f(pre(x)))`
        # (Gemma 2 and 3); needs pre-norm.
        self.use_sandwich_norm = checks.check_bool("use_sandwich_norm", use_sandwich_norm)
        if self.use_sandwich_norm and not self.normalize_first:
            raise ValueError(
                "`use_sandwich_norm=True` adds a norm after each branch of a pre-norm "
                "block: it needs `normalize_first=True`. Received: "
                f"use_sandwich_norm=True, normalize_first={normalize_first!r}"
            )
        self.logit_soft_cap = checks.check_soft_cap("logit_soft_cap", logit_soft_cap)
        # False: LayerNorms scale only (ModernBERT's `norm_bias=False`).
        self.layer_norm_use_bias = checks.check_bool("layer_norm_use_bias", layer_norm_use_bias)
        self.supports_masking = True

    def _query_padding(self, padding_mask):
        """The padding mask used as `query_mask`: None when only keys are masked."""
        return padding_mask if self.mask_padded_queries else None

    def _head_size(self, hidden_dim, name):
        if hidden_dim is None:
            raise ValueError(
                f"The feature size of `{name}` must be known. Received: "
                f"{name}_shape with last axis None"
            )
        if self.key_dim is not None:
            return self.key_dim
        if hidden_dim % self.num_heads:
            raise ValueError(
                f"The feature size of `{name}` ({hidden_dim}) must be divisible by "
                f"num_heads={self.num_heads} when `key_dim` is None. Pass `key_dim` "
                "explicitly or change `num_heads`."
            )
        return hidden_dim // self.num_heads

    def _dense_kwargs(self):
        return dict(
            kernel_initializer=_common.clone_initializer(self.kernel_initializer),
            bias_initializer=_common.clone_initializer(self.bias_initializer),
            dtype=self.dtype_policy,
        )

    def _attention(self, name, hidden_dim, rotary, sliding_window=None, **options):
        return MultiHeadAttention(
            num_heads=self.num_heads,
            key_dim=self._head_size(hidden_dim, "inputs"),
            dropout=self.dropout,
            num_key_value_heads=self.num_key_value_heads,
            rotary_embedding=rotary,
            sliding_window=sliding_window,
            chunk_size=self.chunk_size,
            use_bias=self.attention_use_bias,
            output_use_bias=self.attention_output_use_bias,
            use_qk_norm=self.use_qk_norm,
            qk_norm_epsilon=self.layer_norm_epsilon,
            logit_soft_cap=self.logit_soft_cap,
            name=name,
            **options,
            **self._dense_kwargs(),
        )

    def _norm(self, name):
        if self.normalization == "rms_norm":
            return keras.layers.RMSNormalization(
                epsilon=self.layer_norm_epsilon, dtype=self.dtype_policy, name=name
            )
        return LastAxisLayerNorm(
            epsilon=self.layer_norm_epsilon, center=self.layer_norm_use_bias,
            dtype=self.dtype_policy, name=name,
        )

    def _post_norm(self, name, shape):
        """The norm after a residual branch (`use_sandwich_norm`), built; else None."""
        if not self.use_sandwich_norm:
            return None
        norm = self._norm(name)
        norm.build(shape)
        return norm

    def _dropout(self, name):
        return keras.layers.Dropout(self.dropout, dtype=self.dtype_policy, name=name)

    def _build_feedforward(self, sequence_shape):
        hidden = sequence_shape[-1]
        self.feedforward_layer_norm = self._norm("feedforward_layer_norm")
        self.feedforward_layer_norm.build(sequence_shape)
        self.feedforward_post_norm = self._post_norm("feedforward_post_norm", sequence_shape)
        activation = activations.get(self.activation)
        bias = self.feedforward_use_bias
        self.feedforward_gate_dense = None
        if self.use_gated_feedforward:
            self.feedforward_gate_dense = keras.layers.Dense(
                self.intermediate_dim, activation=activation, use_bias=bias,
                name="feedforward_gate_dense", **self._dense_kwargs(),
            )
            self.feedforward_gate_dense.build(sequence_shape)
        self.feedforward_intermediate_dense = keras.layers.Dense(
            self.intermediate_dim,
            activation=None if self.use_gated_feedforward else activation,
            use_bias=bias,
            name="feedforward_intermediate_dense",
            **self._dense_kwargs(),
        )
        self.feedforward_intermediate_dense.build(sequence_shape)
        self.feedforward_output_dense = keras.layers.Dense(
            hidden, use_bias=bias, name="feedforward_output_dense", **self._dense_kwargs()
        )
        self.feedforward_output_dense.build(tuple(sequence_shape[:-1]) + (self.intermediate_dim,))
        self.feedforward_dropout = self._dropout("feedforward_dropout")

    def _residual(self, x, norm, dropout, fn, training, post_norm=None):
        """`norm(x + f(x))` (post-norm), `x + f(norm(x))` (pre-norm) or
        `x + post_norm(f(norm(x)))` (sandwich)."""
        residual = x
        if self.normalize_first and norm is not None:  # None: no norm on this branch
            x = norm(x)
        x, extra = fn(x)
        if post_norm is not None:
            x = post_norm(x)
        x = residual + dropout(x, training=training)
        if not self.normalize_first:
            x = norm(x)
        return x, extra

    def _feedforward(self, x, training):
        flat = dispatch.select_kernel().fused_projections

        def ffn(h):
            # On `(B * T, features)`: Dense runs one 2-D matmul (+ bias,
            # activation) instead of a batched one, measurably faster on
            # TensorFlow's CPU kernels (benchmarks/README.md).
            shape = ops.shape(h)
            h2 = ops.reshape(h, (-1, h.shape[-1])) if flat else h
            if self.feedforward_gate_dense is None:
                h2 = self.feedforward_intermediate_dense(h2)
            else:
                h2 = self.feedforward_gate_dense(h2) * self.feedforward_intermediate_dense(h2)
            h2 = self.feedforward_output_dense(h2)
            return (ops.reshape(h2, shape) if flat else h2), None

        x, _ = self._residual(
            x, self.feedforward_layer_norm, self.feedforward_dropout, ffn, training,
            self.feedforward_post_norm,
        )
        return x

    def compute_output_shape(self, *shapes, **kwargs):
        return tuple(shapes[0])

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "num_heads": self.num_heads,
                "intermediate_dim": self.intermediate_dim,
                "key_dim": self.key_dim,
                "dropout": self.dropout,
                "activation": self.activation
                if isinstance(self.activation, str)
                else keras.activations.serialize(activations.get(self.activation)),
                "normalize_first": self.normalize_first,
                "layer_norm_epsilon": self.layer_norm_epsilon,
                "num_key_value_heads": self.num_key_value_heads,
                "kernel_initializer": keras.initializers.serialize(self.kernel_initializer),
                "bias_initializer": keras.initializers.serialize(self.bias_initializer),
                "rotary_embedding": (
                    keras.saving.serialize_keras_object(self.rotary_embedding)
                    if self.rotary_embedding is not None
                    else None
                ),
                "sliding_window": self.sliding_window,
                "chunk_size": self.chunk_size,
                "mask_padded_queries": self.mask_padded_queries,
                "normalization": self.normalization,
                "use_gated_feedforward": self.use_gated_feedforward,
                "attention_use_bias": self.attention_use_bias,
                "attention_output_use_bias": self.attention_output_use_bias,
                "feedforward_use_bias": self.feedforward_use_bias,
                "use_qk_norm": self.use_qk_norm,
                "use_sandwich_norm": self.use_sandwich_norm,
                "logit_soft_cap": self.logit_soft_cap,
                "layer_norm_use_bias": self.layer_norm_use_bias,
            }
        )
        return config
