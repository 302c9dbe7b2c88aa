"""Rotary position embedding (RoPE, Su et al., 2021)."""

import math

import keras
from keras import ops

from keras_attn import checks
from keras_attn import saving
from keras_attn.layers import _positions


@saving.register
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
        rope_scaling: None, or a dict choosing how the frequencies are
            stretched for contexts longer than training, as Hugging Face's
            `rope_scaling` / `rope_parameters` (same keys, same numbers):
            - `{"rope_type": "linear", "factor": f}`: positions divided by
              `f` (the same as `scaling_factor=f`);
            - `{"rope_type": "dynamic", "factor": f,
              "original_max_position_embeddings": n}`: dynamic NTK scaling;
              once a call reaches position `L > n`, the base becomes
              `max_wavelength * (f * L / n - (f - 1)) ** (D / (D - 2))`,
              with `L` = the last position of the call + 1 (as Hugging Face
              does while a generation grows);
            - `{"rope_type": "llama3", "factor", "low_freq_factor",
              "high_freq_factor", "original_max_position_embeddings"}`:
              Llama 3.1's frequency-dependent interpolation;
            - `{"rope_type": "longrope", "short_factor", "long_factor",
              "original_max_position_embeddings", "attention_factor"}`:
              LongRoPE (Phi-3): frequency `i` divided by `short_factor[i]`,
              or by `long_factor[i]` once a call reaches a position
              `L > original_max_position_embeddings` (`L` as for
              "dynamic"); the rotated features are multiplied by
              `attention_factor` (default 1.0; Hugging Face's default is
              `sqrt(1 + log(s) / log(original_max_position_embeddings))`
              with `s` the context extension, which `from_huggingface`
              fills in). Each factor list has `rotary_dim / 2` numbers;
            - `{"rope_type": "proportional", "partial_rotary_factor": p,
              "factor": f}` (Gemma 4's global layers): frequencies of the
              whole head (`max_wavelength^(-2i/D)`, divided by `f`, default
              1) on the first `int(p * D // 2)` feature pairs `(i, i + D/2)`,
              zero on the others, which therefore pass unchanged.
        partial_rotary_factor: the fraction of each head's features that is
            rotated: the first `rotary_dim = int(D * partial_rotary_factor)`
            (an even number), the others pass unchanged (Phi-3 / Phi-4-mini,
            GPT-NeoX); frequencies are those of a `rotary_dim`-sized head.

    Call arguments:
        inputs: `(B, T, H, D)` or `(B, T, D)`, with an even `D`.
        start_index: position of the first element (for cached decoding).

    Example:

    >>> import numpy as np
    >>> q = np.random.rand(2, 5, 4, 8).astype("float32")
    >>> tuple(RotaryEmbedding()(q).shape)
    (2, 5, 4, 8)
    """

    def __init__(
        self, max_wavelength=10000, scaling_factor=1.0, sequence_axis=1, rope_scaling=None,
        partial_rotary_factor=1.0, **kwargs,
    ):
        super().__init__(**kwargs)
        self.max_wavelength = checks.check_positive_float("max_wavelength", max_wavelength)
        self.scaling_factor = checks.check_positive_float("scaling_factor", scaling_factor)
        self.rope_scaling = check_rope_scaling(rope_scaling)
        self.partial_rotary_factor = checks.check_positive_float(
            "partial_rotary_factor", partial_rotary_factor
        )
        if self.partial_rotary_factor > 1.0:
            raise ValueError(
                "Received an invalid value for argument `partial_rotary_factor`, expected a "
                f"fraction in (0, 1]. Received: partial_rotary_factor={partial_rotary_factor!r}"
            )
        if isinstance(sequence_axis, bool) or not isinstance(sequence_axis, int):
            raise TypeError(f"`sequence_axis` must be an int. Received: sequence_axis={sequence_axis!r}")
        self.sequence_axis = sequence_axis
        self.supports_masking = True
        self.built = True

    def call(self, inputs, start_index=0):
        checks.check_start_index(start_index)
        rank = len(inputs.shape)
        dim = inputs.shape[-1]
        axis = self.sequence_axis % rank
        if dim is None or dim % 2 or axis == rank - 1:
            raise ValueError(
                "RotaryEmbedding needs an even, static feature size on the last "
                f"axis and a sequence axis before it. Received: inputs.shape="
                f"{tuple(inputs.shape)}, sequence_axis={self.sequence_axis}"
            )
        rotary_dim = self.rotary_dim(dim)
        x = ops.cast(inputs, "float32")
        passed = None
        if rotary_dim < dim:
            x, passed = x[..., :rotary_dim], x[..., rotary_dim:]
        length = ops.shape(inputs)[axis]
        pos = _positions.positions(length, start_index)
        inv_freq = self.inverse_frequencies(rotary_dim, pos[-1] + 1.0)
        freqs = (pos[:, None] / self.scaling_factor) * inv_freq[None, :]
        angles = ops.concatenate([freqs, freqs], axis=-1)  # (T, rotary_dim)
        shape = [1] * rank
        shape[axis] = -1
        shape[-1] = rotary_dim
        cos = ops.reshape(ops.cos(angles), shape)
        sin = ops.reshape(ops.sin(angles), shape)
        x1, x2 = ops.split(x, 2, axis=-1)
        rotated = ops.concatenate([-x2, x1], axis=-1)
        out = x * cos + rotated * sin
        attention_factor = (self.rope_scaling or {}).get("attention_factor", 1.0)
        if attention_factor != 1.0:
            out = out * attention_factor
        if passed is not None:
            out = ops.concatenate([out, passed], axis=-1)
        return ops.cast(out, self.compute_dtype)

    def rotary_dim(self, dim):
        """How many of `dim` features are rotated (`partial_rotary_factor`)."""
        rotary_dim = int(dim * self.partial_rotary_factor)
        if rotary_dim < 2 or rotary_dim % 2:
            raise ValueError(
                f"`partial_rotary_factor`={self.partial_rotary_factor} of a feature size of "
                f"{dim} rotates {rotary_dim} features; an even number (at least 2) is needed."
            )
        if self.rope_scaling is not None and self.rope_scaling["rope_type"] == "longrope":
            for key in ("short_factor", "long_factor"):
                if len(self.rope_scaling[key]) != rotary_dim // 2:
                    raise ValueError(
                        f"`rope_scaling['{key}']` needs one number per rotated feature pair: "
                        f"{rotary_dim // 2} for {rotary_dim} rotated features. Received "
                        f"{len(self.rope_scaling[key])}."
                    )
        return rotary_dim

    def inverse_frequencies(self, dim, seq_len):
        """`(dim/2,)` float32 frequencies of `dim` rotated features: the angle
        at position `p` is `p / scaling_factor` times them. `seq_len` (a
        float32 scalar) matters only for dynamic and LongRoPE scaling."""
        exponent = ops.arange(0, dim, 2, dtype="float32") / float(dim)
        scaling = self.rope_scaling or {"rope_type": "default"}
        kind = scaling["rope_type"]
        base = ops.cast(self.max_wavelength, "float32")
        if kind == "dynamic":
            factor = float(scaling["factor"])
            original = float(scaling["original_max_position_embeddings"])
            seq_len = ops.maximum(ops.cast(seq_len, "float32"), original)
            base = base * ops.power(factor * seq_len / original - (factor - 1.0), dim / (dim - 2.0))
        inv_freq = ops.power(base, -exponent)
        if kind == "linear":
            inv_freq = inv_freq / float(scaling["factor"])
        elif kind == "proportional":
            # As Hugging Face: only the first `int(p * D // 2)` pairs rotate.
            rotated = int(scaling["partial_rotary_factor"] * dim // 2)
            keep = ops.cast(ops.less(ops.arange(dim // 2), rotated), "float32")
            inv_freq = inv_freq * keep / scaling["factor"]
        elif kind == "llama3":
            inv_freq = _llama3_frequencies(inv_freq, scaling)
        elif kind == "longrope":
            long = ops.greater(
                ops.cast(seq_len, "float32"), scaling["original_max_position_embeddings"]
            )
            factors = ops.where(
                long,
                ops.convert_to_tensor(scaling["long_factor"], "float32"),
                ops.convert_to_tensor(scaling["short_factor"], "float32"),
            )
            # As Hugging Face: 1 / (factor * base^(2i/D)).
            inv_freq = 1.0 / (factors * ops.power(base, exponent))
        return inv_freq

    def compute_output_shape(self, inputs_shape):
        return tuple(inputs_shape)

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "max_wavelength": self.max_wavelength,
                "scaling_factor": self.scaling_factor,
                "sequence_axis": self.sequence_axis,
                "rope_scaling": self.rope_scaling,
                "partial_rotary_factor": self.partial_rotary_factor,
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


def _llama3_frequencies(inv_freq, scaling):
    """Llama 3.1: long wavelengths divided by `factor`, short ones kept, a
    smooth blend in between (the numbers of `transformers`'
    `_compute_llama3_parameters`)."""
    factor = float(scaling["factor"])
    low = float(scaling["low_freq_factor"])
    high = float(scaling["high_freq_factor"])
    original = float(scaling["original_max_position_embeddings"])
    low_wavelength = original / low
    high_wavelength = original / high
    wavelength = 2.0 * math.pi / inv_freq
    scaled = ops.where(wavelength > low_wavelength, inv_freq / factor, inv_freq)
    smooth = (original / wavelength - low) / (high - low)
    blended = (1.0 - smooth) * scaled / factor + smooth * scaled
    medium = ops.logical_and(wavelength >= high_wavelength, wavelength <= low_wavelength)
    return ops.where(medium, blended, scaled)


_ROPE_SCALING_KEYS = {
    "default": (),
    "linear": ("factor",),
    "dynamic": ("factor", "original_max_position_embeddings"),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "longrope": ("original_max_position_embeddings",),
    "proportional": (),
}
# Optional keys with their defaults.
_ROPE_SCALING_DEFAULTS = {"proportional": {"partial_rotary_factor": 1.0, "factor": 1.0}}
_FACTOR_LISTS = ("short_factor", "long_factor")


def check_rope_scaling(rope_scaling):
    """None or a normalised `rope_scaling` dict (plain floats), else a ValueError."""
    if rope_scaling is None:
        return None
    if not isinstance(rope_scaling, dict):
        raise TypeError(
            "Received an invalid value for argument `rope_scaling`, expected None or a "
            f"dict with a `rope_type`. Received: rope_scaling={rope_scaling!r}"
        )
    kind = rope_scaling.get("rope_type", rope_scaling.get("type"))
    if kind not in _ROPE_SCALING_KEYS:
        raise ValueError(
            "Received an unsupported `rope_scaling`: `rope_type` must be one of "
            f"{sorted(_ROPE_SCALING_KEYS)} ('yarn' is not represented). Received: rope_scaling={rope_scaling!r}"
        )
    if kind == "default":
        return None
    normalized = {"rope_type": kind}
    for key in _ROPE_SCALING_KEYS[kind]:
        value = rope_scaling.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise ValueError(
                f"`rope_scaling` of type {kind!r} needs a positive number `{key}`. "
                f"Received: rope_scaling={rope_scaling!r}"
            )
        normalized[key] = float(value)
    for key, default in _ROPE_SCALING_DEFAULTS.get(kind, {}).items():
        value = rope_scaling.get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise ValueError(
                f"`rope_scaling` of type {kind!r} needs a positive number `{key}` (default "
                f"{default}). Received: rope_scaling={rope_scaling!r}"
            )
        normalized[key] = float(value)
    if kind == "proportional" and normalized["partial_rotary_factor"] > 1.0:
        raise ValueError(
            "`rope_scaling['partial_rotary_factor']` of type 'proportional' must be a fraction "
            f"in (0, 1]. Received: rope_scaling={rope_scaling!r}"
        )
    if kind == "longrope":
        for key in _FACTOR_LISTS:
            value = rope_scaling.get(key)
            if not isinstance(value, (list, tuple)) or not value or any(
                isinstance(f, bool) or not isinstance(f, (int, float)) or f <= 0 for f in value
            ):
                raise ValueError(
                    f"`rope_scaling` of type 'longrope' needs `{key}`, a list of positive "
                    f"numbers. Received: rope_scaling={rope_scaling!r}"
                )
            normalized[key] = [float(f) for f in value]
        factor = rope_scaling.get("attention_factor", 1.0)
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or factor <= 0:
            raise ValueError(
                "`rope_scaling['attention_factor']` must be a positive number. Received: "
                f"rope_scaling={rope_scaling!r}"
            )
        normalized["attention_factor"] = float(factor)
    if kind == "llama3" and normalized["high_freq_factor"] <= normalized["low_freq_factor"]:
        raise ValueError(
            "`rope_scaling` of type 'llama3' needs high_freq_factor > low_freq_factor. "
            f"Received: rope_scaling={rope_scaling!r}"
        )
    return normalized
