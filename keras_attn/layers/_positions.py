"""Position arithmetic shared by the position layers (float32, keras.ops)."""

import numpy as np
from keras import ops

from keras_attn.ops.shapes import static_int


def check_start_index(start_index, length=None, table_size=None, layer_name=""):
    """Validates `start_index` against a table of `table_size` positions.

    A Python/NumPy integer `start_index` is checked with a static `length`.
    With a tensor `start_index` only a static `length` longer than the whole
    table can be rejected here: the rest is checked by TensorFlow's slice at
    run time, except under XLA, which clamps an out-of-range dynamic slice to
    the last rows (so callers such as the generation loops check their
    `max_length` against the table up front).
    """
    if isinstance(start_index, (bool, np.bool_)):
        raise TypeError(f"`start_index` must be an integer. Received: start_index={start_index!r}")
    start = static_int(start_index)
    if start is not None and start < 0:
        raise ValueError(
            f"Received an invalid value for argument `start_index`, expected a "
            f"non-negative integer. Received: start_index={start}"
        )
    if table_size is None or length is None:
        return
    if start is not None and start + length > table_size:
        raise ValueError(
            f"{layer_name} covers {table_size} positions, but positions "
            f"[{start}, {start + length}) were requested "
            f"(start_index={start}, sequence length={length}). "
            "Use a larger `sequence_length` or a sinusoidal/rotary encoding, "
            "which extrapolate."
        )
    if start is None and length > table_size:
        raise ValueError(
            f"{layer_name} covers {table_size} positions, but a sequence of "
            f"length {length} was given (from a dynamic start_index). "
            "Use a larger `sequence_length` or a sinusoidal/rotary encoding, "
            "which extrapolate."
        )


def positions(length, start_index=0):
    """`start_index + [0, 1, ..., length - 1]` as float32."""
    return ops.arange(length, dtype="float32") + ops.cast(start_index, "float32")
