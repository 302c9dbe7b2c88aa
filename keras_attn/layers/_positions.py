"""Position arithmetic shared by the position layers (float32, keras.ops)."""

from keras import ops


def check_start_index(start_index, length=None, table_size=None, layer_name=""):
    """Validates a Python-int `start_index` (tensors are checked at run time)."""
    if isinstance(start_index, bool):
        raise TypeError(f"`start_index` must be an integer. Received: start_index={start_index!r}")
    if isinstance(start_index, int):
        if start_index < 0:
            raise ValueError(
                f"Received an invalid value for argument `start_index`, expected a "
                f"non-negative integer. Received: start_index={start_index}"
            )
        if table_size is not None and length is not None and start_index + length > table_size:
            raise ValueError(
                f"{layer_name} covers {table_size} positions, but positions "
                f"[{start_index}, {start_index + length}) were requested "
                f"(start_index={start_index}, sequence length={length}). "
                "Use a larger `sequence_length` or a sinusoidal/rotary encoding, "
                "which extrapolate."
            )


def positions(length, start_index=0):
    """`start_index + [0, 1, ..., length - 1]` as float32."""
    return ops.arange(length, dtype="float32") + ops.cast(start_index, "float32")
