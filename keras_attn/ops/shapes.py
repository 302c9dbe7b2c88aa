"""Shape helpers for graphs traced with unknown sizes."""

import numpy as np
from keras import ops


def dim(x, axis):
    """`x.shape[axis]` when static, else the dynamic size (a scalar tensor)."""
    size = x.shape[axis]
    return size if size is not None else ops.shape(x)[axis]


def dims(x, axes=None):
    """`[dim(x, a) for a in axes]` (all axes by default)."""
    axes = range(len(x.shape)) if axes is None else axes
    return [dim(x, a) for a in axes]


def static_int(value):
    """`value` as a Python int when it is known before run time, else None.

    Python/NumPy integers, 0-d NumPy arrays and eager scalar tensors (Keras
    converts NumPy call arguments to them). Variables and symbolic tensors
    (traced functions, loop variables) give None.
    """
    if isinstance(value, (bool, np.bool_)):
        return None
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, np.ndarray):
        if value.ndim == 0 and np.issubdtype(value.dtype, np.integer):
            return int(value)
        return None
    if hasattr(value, "assign"):  # a variable: its value may change before run time
        return None
    if ops.is_tensor(value) and len(value.shape) == 0 and "int" in str(value.dtype):
        try:  # eager tensors have a value; symbolic ones (tracing) do not
            return int(ops.convert_to_numpy(value))
        except Exception:  # noqa: BLE001  (each backend raises its own type)
            return None
    return None
