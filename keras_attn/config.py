"""Global settings: which attention kernel runs, and on which device type.

`keras_attn.ops.dot_product_attention` (and every layer built on it) runs one
of several kernels, chosen by `keras_attn.ops.dispatch.select_kernel`:

- `"reference"`: plain `keras.ops` (mask, float32 softmax, weighted sum),
  the definition every other kernel is tested against;
- `"tf_cpu"`: TensorFlow on a CPU, with the optimisations of
  `keras_attn.ops.tf_kernels` (head groups, folded key-padding bias,
  hand-written softmax gradient; the Transformer blocks' LayerNorm backward);
- `"blocked"`: exact attention blocked over queries and keys in `O(T)`
  memory (`keras_attn.ops.chunked`);
- `"keras"`: `keras.ops.dot_product_attention` (cuDNN / flash attention on
  GPUs with the JAX and torch backends);
- `"auto"` (default): the blocked path for long static sequences, else
  `"tf_cpu"` on TensorFlow on a CPU, `"keras"` on a GPU with JAX or torch,
  `"reference"` otherwise. On a GPU, `"auto"` never picks a CPU-only kernel.

The setting is read when a function is traced: set it before building or
compiling a model. Like `keras.config`, it is process-wide.

Example:

>>> import keras_attn
>>> keras_attn.config.get_attention_implementation()
'auto'
>>> with keras_attn.config.attention_implementation("reference"):
...     keras_attn.config.get_attention_implementation()
'reference'
"""

import contextlib
import os

import keras

ENV_VAR = "KERAS_ATTN_ATTENTION_IMPLEMENTATION"
IMPLEMENTATIONS = ("auto", "reference", "tf_cpu", "blocked", "keras")
DEVICE_TYPES = ("cpu", "gpu", "tpu")

_state = {"implementation": None, "device_type": None}


def _check_implementation(name, source="implementation"):
    if name not in IMPLEMENTATIONS:
        raise ValueError(
            f"Received an invalid attention implementation: expected one of "
            f"{list(IMPLEMENTATIONS)}. Received: {source}={name!r}"
        )
    if name == "tf_cpu" and keras.backend.backend() != "tensorflow":
        raise ValueError(
            "The 'tf_cpu' attention implementation needs the TensorFlow backend. "
            f"Received: {source}={name!r} with backend={keras.backend.backend()!r}"
        )
    return name


def set_attention_implementation(name):
    """Sets the attention kernel for every later trace: one of
    `keras_attn.config.IMPLEMENTATIONS`. `None` goes back to the environment
    variable `KERAS_ATTN_ATTENTION_IMPLEMENTATION`, or `"auto"`.

    A forced kernel runs every call it can serve, whatever the call's
    `chunk_size` (which only guides `"auto"`). The blocked and `"keras"`
    kernels never build the score matrix, so calls that return it, apply
    dropout to it or soft-cap the logits run on `"reference"`; `keras_attn.ops.last_kernel()` tells
    which one ran.
    """
    _state["implementation"] = None if name is None else _check_implementation(name)


def get_attention_implementation():
    """The attention kernel setting: `set_attention_implementation`'s value,
    else `$KERAS_ATTN_ATTENTION_IMPLEMENTATION`, else `"auto"`."""
    if _state["implementation"] is not None:
        return _state["implementation"]
    env = os.environ.get(ENV_VAR)
    if env:
        return _check_implementation(env.strip().lower(), source=ENV_VAR)
    return "auto"


@contextlib.contextmanager
def attention_implementation(name):
    """Context manager: `set_attention_implementation(name)` inside the block."""
    previous = _state["implementation"]
    set_attention_implementation(name)
    try:
        yield
    finally:
        _state["implementation"] = previous


def set_device_type(device_type):
    """Overrides the detected device type (`"cpu"`, `"gpu"`, `"tpu"`; None
    detects it again). For tests of the kernel choice on a machine without
    the device; real runs never need it."""
    if device_type is not None and device_type not in DEVICE_TYPES:
        raise ValueError(
            f"Received an invalid device type: expected None or one of "
            f"{list(DEVICE_TYPES)}. Received: device_type={device_type!r}"
        )
    _state["device_type"] = device_type


def get_device_type():
    """`"gpu"` (or `"tpu"`) when the backend has an accelerator, else `"cpu"`
    (or the value of `set_device_type`)."""
    if _state["device_type"] is not None:
        return _state["device_type"]
    return _detected_device_type()


@contextlib.contextmanager
def device_type(name):
    """Context manager: `set_device_type(name)` inside the block."""
    previous = _state["device_type"]
    set_device_type(name)
    try:
        yield
    finally:
        _state["device_type"] = previous


_detected = []


def _detected_device_type():
    if not _detected:
        _detected.append(_detect())
    return _detected[0]


def _detect():
    backend = keras.backend.backend()
    if backend == "tensorflow":
        import tensorflow as tf

        return "gpu" if tf.config.list_logical_devices("GPU") else "cpu"
    if backend == "jax":
        import jax

        platform = jax.default_backend()
        return {"gpu": "gpu", "cuda": "gpu", "rocm": "gpu", "tpu": "tpu"}.get(platform, "cpu")
    if backend == "torch":
        import torch

        return "gpu" if torch.cuda.is_available() else "cpu"
    return "cpu"
