"""Dtype checks of layer inputs that Keras would otherwise accept silently."""

import keras

try:  # Keras sets this scope while it computes output specs on placeholders.
    from keras.src.backend import in_symbolic_scope as _in_symbolic_scope
except ImportError:  # pragma: no cover - older/newer Keras without it
    def _in_symbolic_scope():
        return False


def _dtype(x):
    return keras.backend.standardize_dtype(getattr(x, "dtype", None) or "float32")


def check_float_features(layer_name, **tensors):
    """Raises a TypeError naming the argument if a feature tensor is not floating.

    Integer features would run (the projections cast them), but token ids or
    a mask passed where features belong is a bug, not a request.
    """
    for name, x in tensors.items():
        if x is None:
            continue
        dtype = _dtype(x)
        if "float" not in dtype:
            raise TypeError(
                f"{layer_name} expects floating-point `{name}` features (e.g. "
                f"float32); token ids need an embedding first. Received: {name} with "
                f"dtype={dtype} and shape={tuple(x.shape)}"
            )


def check_integer_ids(layer_name, name, x):
    """Raises a TypeError naming the argument if token ids are not integers.

    Float ids would be truncated silently by the embedding lookup. Symbolic
    placeholders are let through: Keras builds a subclassed model on float
    placeholders when it reloads a `.keras` file (`build_from_config`), and a
    refusal there would leave the model unbuilt and its saved weights unloaded.
    A functional model with a float `keras.Input` fails on its first real call.
    """
    if isinstance(x, keras.KerasTensor) or _in_symbolic_scope():
        return
    dtype = _dtype(x)
    if "int" not in dtype:
        raise TypeError(
            f"{layer_name} expects integer token ids in `{name}` (int32 or int64); "
            f"float ids would be truncated silently. For a `keras.Input`, pass "
            f"dtype='int32'. Received: {name} with dtype={dtype} and "
            f"shape={tuple(x.shape)}"
        )
