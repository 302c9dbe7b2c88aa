"""LayerNorm over the last axis with a hand-written gradient (used by the blocks)."""

import keras
from keras import ops


def layer_norm(x, gamma, beta, epsilon):
    """`(x - mean) / sqrt(var + epsilon) * gamma + beta` over the last axis.

    float32 arithmetic whatever `x`'s dtype. The backward pass is written out
    (`dx = rstd * (g - mean(g) - x_hat * mean(g * x_hat))`, `g = dy * gamma`)
    instead of differentiated through the forward ops: on TensorFlow, forward
    plus backward took ~25% less time than `keras.layers.LayerNormalization`
    (benchmarks/README.md).
    """
    x = ops.cast(x, "float32")
    gamma = ops.cast(gamma, "float32")
    beta = ops.cast(beta, "float32")
    batch_axes = tuple(range(len(x.shape) - 1))  # all but the normalised axis

    def run(x, gamma, beta):
        mean = ops.mean(x, axis=-1, keepdims=True)
        centered = x - mean
        rstd = ops.rsqrt(ops.mean(ops.square(centered), axis=-1, keepdims=True) + epsilon)
        x_hat = centered * rstd

        def grad(*args, upstream=None):
            if upstream is None:
                (upstream,) = args
            d_y = ops.cast(upstream, "float32")
            g = d_y * gamma
            d_x = rstd * (
                g
                - ops.mean(g, axis=-1, keepdims=True)
                - x_hat * ops.mean(g * x_hat, axis=-1, keepdims=True)
            )
            d_gamma = ops.sum(d_y * x_hat, axis=batch_axes)
            d_beta = ops.sum(d_y, axis=batch_axes)
            return d_x, d_gamma, d_beta

        return x_hat * gamma + beta, grad

    return ops.custom_gradient(run)(x, gamma, beta)


class LastAxisLayerNorm(keras.layers.LayerNormalization):
    """`keras.layers.LayerNormalization(axis=-1)` (same weights, same numbers),
    computed by `layer_norm` on TensorFlow.

    Internal to the Transformer blocks; other backends use Keras' own call.
    """

    def call(self, inputs):
        rank = len(inputs.shape)
        axes = self.axis if isinstance(self.axis, (list, tuple)) else [self.axis]
        if (
            keras.backend.backend() != "tensorflow"
            or self.rms_scaling
            or not (self.center and self.scale)
            or [a % rank for a in axes] != [rank - 1]
        ):
            return super().call(inputs)
        outputs = layer_norm(inputs, self.gamma, self.beta, self.epsilon)
        return ops.cast(outputs, self.compute_dtype)
