"""Deprecated alias of `keras_attn.runtimes.tflite_convert` (and
`keras_attn.runtimes.trace` for the cache dtypes), kept for one release."""

from keras_attn.generation import _deprecated
from keras_attn.runtimes import tflite_convert as _tflite_convert
from keras_attn.runtimes import trace as _trace

_deprecated.alias(globals(), _tflite_convert, _trace)
