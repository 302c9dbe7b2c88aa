"""Feed-forward activations that export to SavedModel, TFLite and ONNX.

The Transformer blocks resolve their `activation` argument here, so the
names used by Hugging Face configs (`hidden_act`, `activation_function`)
work as they are and every one of them converts with TFLite builtins and
tf2onnx:

| name(s)                                              | function                                   |
|------------------------------------------------------|--------------------------------------------|
| `"gelu"`, `"gelu_python"`                            | `gelu`: exact, `0.5 x (1 + erf(x / sqrt 2))` |
| `"gelu_tanh"`, `"gelu_new"`, `"gelu_pytorch_tanh"`, `"gelu_fast"`, `"gelu_accurate"`, `"gelu_python_tanh"` | `gelu_tanh`: tanh approximation |
| `"quick_gelu"`                                       | `quick_gelu`: `x * sigmoid(1.702 x)`       |
| `"silu"`, `"swish"`                                  | `silu`: `x * sigmoid(x)`                   |
| `"relu"`                                             | `keras.activations.relu`                   |

Any other Keras activation name or callable is passed through
`keras.activations.get` unchanged.

Why not `keras.activations.gelu`: on TensorFlow, `tf.nn.gelu` computes the
exact form with `Erfc`, an op tf2onnx cannot convert, so every model using it
failed ONNX export. `erf` has an ONNX op (`Erf`), and the TFLite converter
folds `0.5 x (1 + erf(x / sqrt 2))` into its builtin `GELU`. The two forms
agree to float32 rounding (1e-6); only far in the negative tail, where
GELU is below 1e-7 in magnitude, does `erf` round to -1 and give 0.
"""

import math

import keras
from keras import ops

from keras_attn import saving

_INV_SQRT2 = 1.0 / math.sqrt(2.0)
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


@keras.saving.register_keras_serializable(package=saving.PACKAGE)
def gelu(x):
    """Exact GELU (Hendrycks & Gimpel, 2016): `0.5 x (1 + erf(x / sqrt(2)))`.

    The same function as `keras.activations.gelu(x, approximate=False)` and
    PyTorch's `gelu`, written with `erf` so that it exports to ONNX.

    Example:

    >>> import numpy as np
    >>> round(float(gelu(np.float32(1.0))), 5)
    0.84134
    """
    x = ops.convert_to_tensor(x)
    return 0.5 * x * (1.0 + ops.erf(x * ops.cast(_INV_SQRT2, x.dtype)))


@keras.saving.register_keras_serializable(package=saving.PACKAGE)
def gelu_tanh(x):
    """GELU's tanh approximation, `0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`.

    GPT-2's `gelu_new` and PyTorch's `gelu(approximate="tanh")`.

    Example:

    >>> import numpy as np
    >>> round(float(gelu_tanh(np.float32(1.0))), 5)
    0.84119
    """
    x = ops.convert_to_tensor(x)
    inner = ops.cast(_SQRT_2_OVER_PI, x.dtype) * (x + ops.cast(0.044715, x.dtype) * x * x * x)
    return 0.5 * x * (1.0 + ops.tanh(inner))


@keras.saving.register_keras_serializable(package=saving.PACKAGE)
def quick_gelu(x):
    """`x * sigmoid(1.702 x)`, the GELU approximation of CLIP.

    Example:

    >>> import numpy as np
    >>> round(float(quick_gelu(np.float32(1.0))), 5)
    0.8458
    """
    x = ops.convert_to_tensor(x)
    return x * ops.sigmoid(ops.cast(1.702, x.dtype) * x)


@keras.saving.register_keras_serializable(package=saving.PACKAGE)
def silu(x):
    """SiLU / swish, `x * sigmoid(x)`.

    Example:

    >>> import numpy as np
    >>> round(float(silu(np.float32(1.0))), 5)
    0.73106
    """
    x = ops.convert_to_tensor(x)
    return x * ops.sigmoid(x)


ALIASES = {
    "gelu": gelu,
    "gelu_python": gelu,
    "gelu_tanh": gelu_tanh,
    "gelu_new": gelu_tanh,
    "gelu_pytorch_tanh": gelu_tanh,
    "gelu_python_tanh": gelu_tanh,
    "gelu_fast": gelu_tanh,
    "gelu_accurate": gelu_tanh,
    "quick_gelu": quick_gelu,
    "silu": silu,
    "swish": silu,
    "relu": keras.activations.relu,
}


def get(identifier, argument="activation"):
    """The activation function for a name, a serialized config or a callable.

    Names in `ALIASES` (the Hugging Face names included) map to the
    exportable functions of this module; `keras.activations.gelu` given as
    a callable is replaced by the exportable `gelu` (same function). Anything
    else goes through `keras.activations.get`.

    Raises:
        ValueError: naming `argument` when the identifier is unknown.
    """
    if isinstance(identifier, str) and identifier in ALIASES:
        return ALIASES[identifier]
    if identifier is keras.activations.gelu:
        return gelu
    try:
        fn = keras.activations.get(identifier)
    except (ValueError, TypeError) as error:
        raise ValueError(
            f"Received an invalid value for argument `{argument}`, expected the "
            "name of a Keras activation or of a Hugging Face activation "
            f"({', '.join(sorted(ALIASES))}) or a callable. "
            f"Received: {argument}={identifier!r}"
        ) from error
    if fn is None:
        return keras.activations.linear
    return fn


def canonical_name(fn):
    """`"gelu"`, `"gelu_tanh"`, `"silu"`, `"relu"`, `"tanh"`, `"linear"` or None (unknown):
    the name the graph writers know an activation function by."""
    if fn is None or fn is keras.activations.linear:
        return "linear"
    for name in ("gelu", "gelu_tanh", "silu", "relu"):
        if fn is ALIASES[name]:
            return name
    if fn is keras.activations.gelu:
        return "gelu"
    if fn is keras.activations.relu:
        return "relu"
    if fn is keras.activations.tanh:
        return "tanh"
    if fn is keras.activations.silu:
        return "silu"
    return None
