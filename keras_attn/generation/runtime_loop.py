"""Deprecated alias of `keras_attn.runtimes.loop`, kept for one release."""

from keras_attn.generation import _deprecated
from keras_attn.runtimes import loop as _loop

_deprecated.alias(globals(), _loop)
