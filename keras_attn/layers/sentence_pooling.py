"""sentence-transformers' `Pooling`: token vectors to one sentence vector."""

import keras
from keras import ops

from keras_attn import checks
from keras_attn import saving

MODES = ("cls", "max", "mean", "mean_sqrt_len_tokens", "weightedmean", "lasttoken")
# The library clamps token counts to this before dividing (mean pooling).
MIN_COUNT = 1e-9


@saving.register
class SentencePooling(keras.layers.Layer):
    """Pools `(B, T, D)` hidden states over the tokens of `attention_mask`.

    The pooling of sentence-transformers (Reimers and Gurevych, 2019,
    "Sentence-BERT"), its `Pooling` module: each mode gives a `(B, D)`
    vector, and several modes are concatenated in the order given. Computed
    in float32 from cumulative sums of the mask (no length in the graph, no
    gather), right or left padding alike:

    - `"cls"`: the first kept token (token 0 in a row without one);
    - `"lasttoken"`: the last kept token (zeros in a row without one);
    - `"mean"`, `"mean_sqrt_len_tokens"`: the sum over kept tokens divided by
      their count (clamped to 1e-9) or its square root;
    - `"max"`: the largest value of each feature over kept tokens;
    - `"weightedmean"`: tokens weighted 1, 2, ... from the first one.

    Args:
        modes: a tuple of the modes above (a string: one mode).

    Call arguments:
        hidden: `(B, T, D)` float token vectors.
        attention_mask: `(B, T)` integer or bool, nonzero on tokens.
        prompt_length: None, or int32 `(B,)`: that many tokens after the
            padding (the leading special token included) are left out, as
            the library's `include_prompt=False` does.

    Returns:
        float32 `(B, D * len(modes))`.

    Example:

    >>> import numpy as np
    >>> layer = SentencePooling("mean")
    >>> hidden = np.arange(12, dtype="float32").reshape(1, 3, 4)
    >>> np.asarray(layer(hidden, np.array([[1, 1, 0]]))).tolist()
    [[2.0, 3.0, 4.0, 5.0]]
    """

    def __init__(self, modes=("mean",), **kwargs):
        super().__init__(**kwargs)
        modes = (modes,) if isinstance(modes, str) else tuple(modes)
        if not modes:
            raise ValueError(f"Received an invalid value for argument `modes`, expected at least one "
                             f"of {list(MODES)}. Received: modes={modes!r}")
        for mode in modes:
            checks.check_choice("modes", mode, MODES)
        self.modes = modes
        self.built = True

    def call(self, hidden, attention_mask, prompt_length=None):
        # `expand_dims`, not `[:, None]`: TensorFlow's new-axis slice is no
        # TFLite builtin.
        hidden = ops.cast(hidden, "float32")
        original = ops.cast(ops.not_equal(attention_mask, 0), "int32")  # (B, T)
        positions = ops.cumsum(ops.ones_like(original), axis=1) - 1
        # The library's first token of each row (its `argmax` of the mask: 0
        # for a row without tokens): the number of left-padding positions.
        leading = ops.sum(ops.cast(ops.equal(ops.cumsum(original, axis=1), 0), "int32"), axis=1)
        first = ops.where(ops.greater(ops.sum(original, axis=1), 0), leading, 0)  # (B,)
        mask = original
        if prompt_length is not None:
            keep = ops.greater_equal(positions, ops.expand_dims(first + ops.cast(prompt_length, "int32"), 1))
            mask = mask * ops.cast(keep, "int32")
        weights = ops.expand_dims(ops.cast(mask, "float32"), 2)  # (B, T, 1)
        counted = ops.cumsum(mask, axis=1)  # kept tokens up to each position
        vectors = []
        for mode in self.modes:
            if mode == "cls":
                selected = ops.logical_and(ops.equal(counted, 1), ops.greater(mask, 0))
                selected = ops.where(ops.any(selected, axis=1, keepdims=True), selected, ops.equal(positions, 0))
                vectors.append(_take(hidden, selected))
            elif mode == "lasttoken":
                selected = ops.logical_and(ops.equal(counted, ops.sum(mask, axis=1, keepdims=True)),
                                           ops.greater(mask, 0))
                vectors.append(_take(hidden, selected))
            elif mode == "max":
                vectors.append(ops.max(ops.where(ops.greater(weights, 0), hidden, float("-inf")), axis=1))
            elif mode in ("mean", "mean_sqrt_len_tokens"):
                count = ops.maximum(ops.sum(weights, axis=1), MIN_COUNT)  # (B, 1)
                total = ops.sum(hidden * weights, axis=1)
                vectors.append(total / (count if mode == "mean" else ops.sqrt(count)))
            else:  # "weightedmean": weights 1, 2, ... from the first token
                position_weights = ops.expand_dims(
                    ops.cast(positions + 1 - ops.expand_dims(first, 1), "float32"), 2)
                weighted = weights * position_weights
                vectors.append(ops.sum(hidden * weighted, axis=1)
                               / ops.maximum(ops.sum(weighted, axis=1), MIN_COUNT))
        return vectors[0] if len(vectors) == 1 else ops.concatenate(vectors, axis=-1)

    def compute_output_shape(self, hidden_shape, attention_mask_shape=None, prompt_length_shape=None):
        features = hidden_shape[-1]
        return (hidden_shape[0], None if features is None else features * len(self.modes))

    def compute_output_spec(self, hidden, attention_mask, prompt_length=None):
        return keras.KerasTensor(self.compute_output_shape(hidden.shape), dtype="float32")

    def get_config(self):
        config = super().get_config()
        config.update({"modes": list(self.modes)})
        return config


def _take(hidden, selected):
    """The token of `hidden` `(B, T, D)` where `selected` `(B, T)` (one per
    row, or none: zeros) is True, as a masked sum: no gather, which the
    exports' builtin ops cover."""
    return ops.sum(hidden * ops.expand_dims(ops.cast(selected, hidden.dtype), 2), axis=1)
