"""Token embedding plus position information, with Keras masking."""

import keras

from keras_attn.layers import _common
from keras_attn.layers import _dtype_checks
from keras_attn.layers import _positions
from keras_attn.layers.learned_position_embedding import LearnedPositionEmbedding
from keras_attn.layers.sinusoidal_position_encoding import SinusoidalPositionEncoding

POSITION_KINDS = ("sinusoidal", "learned")


@_common.register
class TokenAndPositionEmbedding(keras.layers.Layer):
    """Embeds token ids and adds sinusoidal or learned position information.

    With `mask_zero=True`, id 0 is padding: the layer emits a Keras mask that
    the blocks downstream (and pooling layers) use automatically.

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

    Call arguments:
        inputs: integer ids `(B, T)`.
        start_index: position of the first token (for cached decoding).

    Example:

    >>> import numpy as np
    >>> layer = TokenAndPositionEmbedding(100, 16, 8, mask_zero=True)
    >>> tuple(layer(np.array([[5, 3, 0]])).shape)
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
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.vocabulary_size = _common.check_positive_int("vocabulary_size", vocabulary_size)
        self.sequence_length = _common.check_positive_int("sequence_length", sequence_length)
        self.embedding_dim = _common.check_positive_int("embedding_dim", embedding_dim)
        self.position = _common.check_choice("position", position, POSITION_KINDS)
        self.mask_zero = _common.check_bool("mask_zero", mask_zero)
        self.embeddings_initializer = keras.initializers.get(embeddings_initializer)
        self.max_wavelength = max_wavelength
        self.token_embedding = keras.layers.Embedding(
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
        self.supports_masking = mask_zero

    def build(self, inputs_shape):
        _common.check_shape_rank("inputs", inputs_shape, 2, "(batch, seq) of token ids")
        self.token_embedding.build(inputs_shape)
        self.position_embedding.build(tuple(inputs_shape) + (self.embedding_dim,))
        self.built = True

    def call(self, inputs, start_index=0):
        _dtype_checks.check_integer_ids("TokenAndPositionEmbedding", "inputs", inputs)
        if self.position == "learned":
            _positions.check_start_index(
                start_index, inputs.shape[1], self.sequence_length, "TokenAndPositionEmbedding"
            )
        tokens = self.token_embedding(inputs)
        return tokens + self.position_embedding(tokens, start_index=start_index)

    def compute_mask(self, inputs, mask=None):
        if not self.mask_zero:
            return None
        return keras.ops.not_equal(inputs, 0)

    def compute_output_spec(self, inputs, start_index=0):
        _dtype_checks.check_integer_ids("TokenAndPositionEmbedding", "inputs", inputs)
        return keras.KerasTensor(self.compute_output_shape(inputs.shape),
                                 dtype=self.compute_dtype)

    def compute_output_shape(self, inputs_shape):
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
            }
        )
        return config
