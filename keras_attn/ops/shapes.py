"""Shape helpers for graphs traced with unknown sizes."""

from keras import ops


def dim(x, axis):
    """`x.shape[axis]` when static, else the dynamic size (a scalar tensor)."""
    size = x.shape[axis]
    return size if size is not None else ops.shape(x)[axis]


def dims(x, axes=None):
    """`[dim(x, a) for a in axes]` (all axes by default)."""
    axes = range(len(x.shape)) if axes is None else axes
    return [dim(x, a) for a in axes]
