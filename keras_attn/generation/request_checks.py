"""Deprecated alias of `keras_attn.runtimes.request_checks`, kept for one release."""

from keras_attn.generation import _deprecated
from keras_attn.runtimes import request_checks as _request_checks

_deprecated.alias(globals(), _request_checks)
