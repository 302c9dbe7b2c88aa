"""Fixed sinusoidal position encodings (Vaswani et al., 2017)."""

import keras
from keras import ops

from keras_attn import checks
from keras_attn import saving
from keras_attn.layers import _positions


@saving.register
class SinusoidalPositionEncoding(keras.layers.Layer):
    """Sinusoidal position encoding, `PE[p, 2i] = sin(p / w^(2i/d))`, `PE[p, 2i+1] = cos(...)`.

    Returns the encoding (not the sum) with the shape of `inputs`, so it is
    added to token embeddings by the caller. Computed from the (dynamic)
    sequence length at call time, so any length works, including after
    `resize_tensor_input` in TFLite, and positions beyond those seen in
    training extrapolate as the formula does. Math in float32, cast to the
    layer's compute dtype at the end.

    Args:
        max_wavelength: the largest wavelength `w` of the sinusoids.

    Call arguments:
        inputs: `(B, T, D)` (or `(T, D)`) tensor whose shape is matched.
        start_index: position of the first element (for cached decoding).

    Example:

    >>> import numpy as np
    >>> x = np.zeros((2, 5, 8), "float32")
    >>> tuple(SinusoidalPositionEncoding()(x).shape)
    (2, 5, 8)
    """

    def __init__(self, max_wavelength=10000, **kwargs):
        super().__init__(**kwargs)
        self.max_wavelength = checks.check_positive_float("max_wavelength", max_wavelength)
        self.supports_masking = True
        self.built = True

    def call(self, inputs, start_index=0):
        checks.check_start_index(start_index)
        if len(inputs.shape) < 2 or inputs.shape[-1] is None:
            raise ValueError(
                "Expected `inputs` of shape (..., seq, features) with a known "
                f"feature size. Received: inputs.shape={tuple(inputs.shape)}"
            )
        dim = inputs.shape[-1]
        length = ops.shape(inputs)[-2]
        pos = _positions.positions(length, start_index)
        index = ops.arange(dim, dtype="int32")
        exponent = ops.cast(2 * (index // 2), "float32") / float(dim)
        inv_timescale = ops.power(ops.cast(self.max_wavelength, "float32"), -exponent)
        angles = pos[:, None] * inv_timescale[None, :]
        encoding = ops.where(index[None, :] % 2 == 0, ops.sin(angles), ops.cos(angles))
        encoding = ops.cast(encoding, self.compute_dtype)
        return ops.broadcast_to(encoding, ops.shape(inputs))

    def compute_output_shape(self, inputs_shape):
        return tuple(inputs_shape)

    def get_config(self):
        config = super().get_config()
        config.update({"max_wavelength": self.max_wavelength})
        return config
