"""Rotary position embedding (RoPE, Su et al., 2021)."""

import keras
from keras import ops

from keras_attn.layers import _common
from keras_attn.layers import _positions


@_common.register
class RotaryEmbedding(keras.layers.Layer):
    """Rotates feature pairs by position-dependent angles (RoPE).

    Feature `i` and feature `i + D/2` of position `p` are rotated by
    `p / (scaling_factor * max_wavelength^(2i/D))` (the "rotate half" layout
    of GPT-NeoX, LLaMA and KerasHub). Apply it to queries and keys; give an
    instance to `MultiHeadAttention(rotary_embedding=...)` to have the layer
    do so. Math in float32, cast back at the end.

    Args:
        max_wavelength: the largest wavelength.
        scaling_factor: positions are divided by it (linear position
            interpolation for longer contexts).
        sequence_axis: the sequence axis of the inputs (default 1).

    Call arguments:
        inputs: `(B, T, H, D)` or `(B, T, D)`, with an even `D`.
        start_index: position of the first element (for cached decoding).

    Example:

    >>> import numpy as np
    >>> q = np.random.rand(2, 5, 4, 8).astype("float32")
    >>> tuple(RotaryEmbedding()(q).shape)
    (2, 5, 4, 8)
    """

    def __init__(self, max_wavelength=10000, scaling_factor=1.0, sequence_axis=1, **kwargs):
        super().__init__(**kwargs)
        self.max_wavelength = _common.check_positive_float("max_wavelength", max_wavelength)
        self.scaling_factor = _common.check_positive_float("scaling_factor", scaling_factor)
        if isinstance(sequence_axis, bool) or not isinstance(sequence_axis, int):
            raise TypeError(f"`sequence_axis` must be an int. Received: sequence_axis={sequence_axis!r}")
        self.sequence_axis = sequence_axis
        self.supports_masking = True
        self.built = True

    def call(self, inputs, start_index=0):
        _positions.check_start_index(start_index)
        rank = len(inputs.shape)
        dim = inputs.shape[-1]
        axis = self.sequence_axis % rank
        if dim is None or dim % 2 or axis == rank - 1:
            raise ValueError(
                "RotaryEmbedding needs an even, static feature size on the last "
                f"axis and a sequence axis before it. Received: inputs.shape="
                f"{tuple(inputs.shape)}, sequence_axis={self.sequence_axis}"
            )
        x = ops.cast(inputs, "float32")
        length = ops.shape(inputs)[axis]
        pos = _positions.positions(length, start_index) / self.scaling_factor
        exponent = ops.arange(0, dim, 2, dtype="float32") / float(dim)
        inv_freq = ops.power(ops.cast(self.max_wavelength, "float32"), -exponent)
        freqs = pos[:, None] * inv_freq[None, :]
        angles = ops.concatenate([freqs, freqs], axis=-1)  # (T, D)
        shape = [1] * rank
        shape[axis] = -1
        shape[-1] = dim
        cos = ops.reshape(ops.cos(angles), shape)
        sin = ops.reshape(ops.sin(angles), shape)
        x1, x2 = ops.split(x, 2, axis=-1)
        rotated = ops.concatenate([-x2, x1], axis=-1)
        return ops.cast(x * cos + rotated * sin, self.compute_dtype)

    def compute_output_shape(self, inputs_shape):
        return tuple(inputs_shape)

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "max_wavelength": self.max_wavelength,
                "scaling_factor": self.scaling_factor,
                "sequence_axis": self.sequence_axis,
            }
        )
        return config


def check_rotary_embedding(rotary_embedding):
    """None or a `RotaryEmbedding` (also from its serialized config)."""
    if isinstance(rotary_embedding, dict):
        rotary_embedding = keras.saving.deserialize_keras_object(rotary_embedding)
    if rotary_embedding is not None and not isinstance(rotary_embedding, RotaryEmbedding):
        raise TypeError(
            "Received an invalid value for argument `rotary_embedding`, "
            "expected a keras_attn.layers.RotaryEmbedding or None. Received: "
            f"rotary_embedding={rotary_embedding!r}"
        )
    return rotary_embedding
