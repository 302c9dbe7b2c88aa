"""Deprecated alias of `keras_attn.runtimes.litertlm`, kept for one release."""

from keras_attn.generation import _deprecated
from keras_attn.runtimes import litertlm as _litertlm

_deprecated.alias(globals(), _litertlm)
