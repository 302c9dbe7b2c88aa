"""The Transformer blocks' LayerNorm: Keras' own, or on TensorFlow on a CPU
the kernel with a written-out backward pass (`keras_attn.ops.tf_kernels`)."""

import keras
from keras import ops

from keras_attn.ops import dispatch
from keras_attn.ops import tf_kernels


class LastAxisLayerNorm(keras.layers.LayerNormalization):
    """`keras.layers.LayerNormalization(axis=-1)` (same weights, same numbers),
    computed by `tf_kernels.layer_norm` when `dispatch.select_kernel().cpu_kernels`.

    Internal to the Transformer blocks; elsewhere it is Keras' own call.
    """

    def call(self, inputs):
        rank = len(inputs.shape)
        axes = self.axis if isinstance(self.axis, (list, tuple)) else [self.axis]
        if (
            not dispatch.select_kernel().cpu_kernels
            or self.rms_scaling
            or not (self.center and self.scale)
            or [a % rank for a in axes] != [rank - 1]
        ):
            return super().call(inputs)
        outputs = tf_kernels.layer_norm(inputs, self.gamma, self.beta, self.epsilon)
        return ops.cast(outputs, self.compute_dtype)
