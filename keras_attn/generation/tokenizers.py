"""Deprecated alias of `keras_attn.runtimes.tokenizers`, kept for one release."""

from keras_attn.generation import _deprecated
from keras_attn.runtimes import tokenizers as _tokenizers

_deprecated.alias(globals(), _tokenizers)
