"""Trainable absolute position embeddings."""

import keras
from keras import ops

from keras_attn import checks
from keras_attn import saving


@saving.register
class LearnedPositionEmbedding(keras.layers.Layer):
    """A trainable table of `sequence_length` position vectors.

    Returns the embeddings of positions `[start_index, start_index + T)`
    broadcast to the shape of `inputs` (add them to token embeddings). A
    request beyond the table raises a ValueError when it is known statically
    (an integer `start_index` and a static length, or a static length longer
    than the table). With a tensor `start_index`, TensorFlow's slice raises
    at run time, but XLA clamps the slice to the last rows without an error:
    bound the positions before the call (the `keras_attn.generation` search
    functions check `max_length` against the table). A learned table cannot
    extrapolate, so use `SinusoidalPositionEncoding` or `RotaryEmbedding` for
    unbounded lengths.

    Args:
        sequence_length: number of positions in the table.
        initializer: initializer of the table.

    Call arguments:
        inputs: `(B, T, D)` tensor whose shape is matched.
        start_index: position of the first element (for cached decoding), a
            non-negative integer or a scalar integer tensor.

    Example:

    >>> import numpy as np
    >>> layer = LearnedPositionEmbedding(sequence_length=16)
    >>> tuple(layer(np.zeros((2, 5, 8), "float32")).shape)
    (2, 5, 8)
    """

    def __init__(self, sequence_length, initializer="glorot_uniform", **kwargs):
        super().__init__(**kwargs)
        self.sequence_length = checks.check_positive_int("sequence_length", sequence_length)
        self.initializer = keras.initializers.get(initializer)
        self.supports_masking = True

    def build(self, inputs_shape):
        if len(inputs_shape) < 2 or inputs_shape[-1] is None:
            raise ValueError(
                "Expected `inputs` of shape (..., seq, features) with a known "
                f"feature size. Received: inputs_shape={tuple(inputs_shape)}"
            )
        self.position_embeddings = self.add_weight(
            name="embeddings",
            shape=(self.sequence_length, inputs_shape[-1]),
            initializer=self.initializer,
        )
        self.built = True

    def call(self, inputs, start_index=0):
        length_static = inputs.shape[-2]
        checks.check_start_index(
            start_index, length_static, self.sequence_length, "LearnedPositionEmbedding"
        )
        length = ops.shape(inputs)[-2]
        table = ops.convert_to_tensor(self.position_embeddings)
        start = ops.cast(start_index, "int32")
        rows = ops.slice(table, (start, 0), (length, ops.shape(table)[-1]))
        rows = ops.cast(rows, self.compute_dtype)
        return ops.broadcast_to(rows, ops.shape(inputs))

    def compute_output_shape(self, inputs_shape):
        return tuple(inputs_shape)

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "sequence_length": self.sequence_length,
                "initializer": keras.initializers.serialize(self.initializer),
            }
        )
        return config
