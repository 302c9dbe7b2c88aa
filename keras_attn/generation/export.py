"""Deprecated alias of `keras_attn.runtimes.signatures` (and of the writers
`export_litertlm`, `export_onnx_genai` it re-exported), kept for one release."""

from keras_attn.generation import _deprecated
from keras_attn.runtimes import signatures as _signatures
from keras_attn.runtimes import litertlm as _litertlm
from keras_attn.runtimes import onnx_genai as _onnx_genai

_deprecated.alias(globals(), _signatures, _litertlm, _onnx_genai)
