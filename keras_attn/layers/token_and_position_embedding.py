"""Token embedding plus position information, with Keras masking."""

import keras

from keras_attn import checks
from keras_attn import saving
from keras_attn.layers import _common
from keras_attn.layers._layer_norm import LastAxisLayerNorm
from keras_attn.layers.learned_position_embedding import LearnedPositionEmbedding
from keras_attn.layers.reversible_embedding import ReversibleEmbedding
from keras_attn.layers.sinusoidal_position_encoding import SinusoidalPositionEncoding

POSITION_KINDS = ("sinusoidal", "learned")


def _is_float(x):
    return "float" in keras.backend.standardize_dtype(x.dtype)


@saving.register
class TokenAndPositionEmbedding(keras.layers.Layer):
    """Embeds token ids and adds sinusoidal or learned position information.

    With `mask_zero=True`, id 0 is padding: the layer emits a Keras mask that
    the blocks downstream (and pooling layers) use automatically.

    BERT-style embeddings (Devlin et al., 2019) add two options: a table of
    `type_vocabulary_size` token-type (segment) embeddings added to the sum,
    and a LayerNorm of the sum (`use_layer_norm=True`):
    `LN(token[ids] + position[i] + type[token_type_ids])`. The token table is
    a `ReversibleEmbedding`: `layer(hidden, reverse=True)` is the tied output
    head, `hidden @ token_table.T` (no bias; positions, types and the
    LayerNorm play no part), as GPT-2 and BERT's masked-LM head use it.

    Args:
        vocabulary_size: number of token ids.
        sequence_length: the longest sequence expected. A learned table has
            exactly this many positions (positions past it raise a ValueError
            when known statically; see `LearnedPositionEmbedding` for a tensor
            `start_index` under XLA); sinusoidal positions extrapolate beyond it.
        embedding_dim: size of the embeddings.
        position: `"sinusoidal"` or `"learned"`.
        mask_zero: treat id 0 as padding and emit a mask.
        embeddings_initializer: initializer of the token table (and the
            learned position table).
        max_wavelength: of the sinusoids.
        type_vocabulary_size: None (no token types) or the number of token
            types; the call then takes `token_type_ids` (default all 0).
        use_layer_norm: normalise the summed embeddings (BERT, RoBERTa).
        layer_norm_epsilon: epsilon of that LayerNorm.

    Call arguments:
        inputs: integer ids `(B, T)` in `[0, vocabulary_size)`. Float ids
            raise a TypeError; in an eager call (concrete values), an id out
            of range raises a ValueError naming it. Traced calls (`fit`,
            `predict`, exports) are not checked; an exported signature
            checks ids as its `check_ids` says.
        start_index: position of the first token (for cached decoding).
        token_type_ids: integer `(B, T)` token types (segment ids), only with
            `type_vocabulary_size`; None means type 0 everywhere.
        reverse: if True, `inputs` are hidden states `(B, T, embedding_dim)`
            and the call returns logits `(B, T, vocabulary_size)` (the layer
            must have embedded ids before, which builds it).

    Example:

    >>> import numpy as np
    >>> layer = TokenAndPositionEmbedding(100, 16, 8, mask_zero=True)
    >>> tuple(layer(np.array([[5, 3, 0]])).shape)
    (1, 3, 8)
    >>> bert = TokenAndPositionEmbedding(
    ...     100, 16, 8, position="learned", type_vocabulary_size=2, use_layer_norm=True
    ... )
    >>> tuple(bert(np.array([[5, 3, 7]]), token_type_ids=np.array([[0, 0, 1]])).shape)
    (1, 3, 8)
    """

    def __init__(
        self,
        vocabulary_size,
        sequence_length,
        embedding_dim,
        position="sinusoidal",
        mask_zero=False,
        embeddings_initializer="uniform",
        max_wavelength=10000,
        type_vocabulary_size=None,
        use_layer_norm=False,
        layer_norm_epsilon=1e-5,
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.vocabulary_size = checks.check_positive_int("vocabulary_size", vocabulary_size)
        self.sequence_length = checks.check_positive_int("sequence_length", sequence_length)
        self.embedding_dim = checks.check_positive_int("embedding_dim", embedding_dim)
        self.position = checks.check_choice("position", position, POSITION_KINDS)
        self.mask_zero = checks.check_bool("mask_zero", mask_zero)
        self.embeddings_initializer = keras.initializers.get(embeddings_initializer)
        self.max_wavelength = max_wavelength
        self.type_vocabulary_size = checks.check_positive_int(
            "type_vocabulary_size", type_vocabulary_size, allow_none=True
        )
        self.use_layer_norm = checks.check_bool("use_layer_norm", use_layer_norm)
        self.layer_norm_epsilon = checks.check_positive_float(
            "layer_norm_epsilon", layer_norm_epsilon
        )
        self.token_embedding = ReversibleEmbedding(
            vocabulary_size,
            embedding_dim,
            embeddings_initializer=self.embeddings_initializer,
            mask_zero=mask_zero,
            dtype=self.dtype_policy,
            name="token_embedding",
        )
        if position == "sinusoidal":
            self.position_embedding = SinusoidalPositionEncoding(
                max_wavelength=max_wavelength, dtype=self.dtype_policy, name="position_embedding"
            )
        else:
            self.position_embedding = LearnedPositionEmbedding(
                sequence_length,
                initializer=keras.initializers.serialize(self.embeddings_initializer),
                dtype=self.dtype_policy,
                name="position_embedding",
            )
        self.token_type_embedding = None
        if self.type_vocabulary_size is not None:
            self.token_type_embedding = keras.layers.Embedding(
                self.type_vocabulary_size,
                embedding_dim,
                embeddings_initializer=_common.clone_initializer(self.embeddings_initializer),
                dtype=self.dtype_policy,
                name="token_type_embedding",
            )
        self.layer_norm = None
        if self.use_layer_norm:
            self.layer_norm = LastAxisLayerNorm(
                epsilon=self.layer_norm_epsilon, dtype=self.dtype_policy, name="layer_norm"
            )
        self.supports_masking = mask_zero

    def build(self, inputs_shape, token_type_ids_shape=None):
        checks.check_shape_rank("inputs", inputs_shape, 2, "(batch, seq) of token ids")
        self.token_embedding.build(inputs_shape)
        self.position_embedding.build(tuple(inputs_shape) + (self.embedding_dim,))
        if self.token_type_embedding is not None:
            self.token_type_embedding.build(inputs_shape)
        if self.layer_norm is not None:
            self.layer_norm.build(tuple(inputs_shape) + (self.embedding_dim,))
        self.built = True

    def call(self, inputs, start_index=0, token_type_ids=None, reverse=False):
        if reverse:
            return self.token_embedding(inputs, reverse=True)
        layer = f"TokenAndPositionEmbedding '{self.name}'"
        checks.check_integer_ids(layer, "inputs", inputs)
        checks.check_ids_in_range(layer, "inputs", inputs, self.vocabulary_size)
        if self.position == "learned":
            checks.check_start_index(
                start_index, inputs.shape[1], self.sequence_length, "TokenAndPositionEmbedding"
            )
        if token_type_ids is not None and self.token_type_embedding is None:
            raise ValueError(
                "`token_type_ids` needs a layer built with `type_vocabulary_size`. "
                "Received: token_type_ids with type_vocabulary_size=None"
            )
        tokens = self.token_embedding(inputs)
        x = tokens + self.position_embedding(tokens, start_index=start_index)
        if self.token_type_embedding is not None:
            if token_type_ids is None:
                token_type_ids = keras.ops.zeros_like(inputs)
            elif tuple(token_type_ids.shape) != tuple(inputs.shape) and None not in (
                tuple(token_type_ids.shape) + tuple(inputs.shape)
            ):
                raise ValueError(
                    "`token_type_ids` must have the shape of `inputs`. Received: "
                    f"token_type_ids.shape={tuple(token_type_ids.shape)}, "
                    f"inputs.shape={tuple(inputs.shape)}"
                )
            checks.check_integer_ids(layer, "token_type_ids", token_type_ids)
            checks.check_ids_in_range(layer, "token_type_ids", token_type_ids,
                                      self.type_vocabulary_size, "type_vocabulary_size")
            x = x + self.token_type_embedding(token_type_ids)
        if self.layer_norm is not None:
            x = self.layer_norm(x)
        return x

    def compute_mask(self, inputs, mask=None, **kwargs):
        if _is_float(inputs):  # reverse=True: hidden states keep their mask
            return mask
        if not self.mask_zero:
            return None
        return keras.ops.not_equal(inputs, 0)

    def compute_output_spec(self, inputs, start_index=0, token_type_ids=None, reverse=False):
        if reverse:
            shape = tuple(inputs.shape[:-1]) + (self.vocabulary_size,)
        else:
            shape = tuple(inputs.shape) + (self.embedding_dim,)
        return keras.KerasTensor(shape, dtype=self.compute_dtype)

    def compute_output_shape(self, inputs_shape, token_type_ids_shape=None):
        return tuple(inputs_shape) + (self.embedding_dim,)

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "vocabulary_size": self.vocabulary_size,
                "sequence_length": self.sequence_length,
                "embedding_dim": self.embedding_dim,
                "position": self.position,
                "mask_zero": self.mask_zero,
                "embeddings_initializer": keras.initializers.serialize(
                    self.embeddings_initializer
                ),
                "max_wavelength": self.max_wavelength,
                "type_vocabulary_size": self.type_vocabulary_size,
                "use_layer_norm": self.use_layer_norm,
                "layer_norm_epsilon": self.layer_norm_epsilon,
            }
        )
        return config
