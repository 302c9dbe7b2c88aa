"""Position arithmetic shared by the position layers (float32, keras.ops)."""

from keras import ops


def positions(length, start_index=0):
    """`start_index + [0, 1, ..., length - 1]` as float32."""
    return ops.arange(length, dtype="float32") + ops.cast(start_index, "float32")
