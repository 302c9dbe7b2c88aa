"""Deprecated alias of `keras_attn.runtimes.onnx_genai`, kept for one release."""

from keras_attn.generation import _deprecated
from keras_attn.runtimes import onnx_genai as _onnx_genai

_deprecated.alias(globals(), _onnx_genai)
