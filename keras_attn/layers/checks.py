"""Deprecated: the argument checks are `keras_attn.checks`, registration is
`keras_attn.saving.register`. This module forwards to them for one release."""

import warnings

from keras_attn import checks as _checks
from keras_attn import saving as _saving

_MOVED = {
    "PACKAGE": _saving,
    "register": _saving,
    "check_positive_int": _checks,
    "check_positive_float": _checks,
    "check_choice": _checks,
    "check_bool": _checks,
    "check_block_switches": _checks,
}


def __getattr__(name):
    if name not in _MOVED:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    home = _MOVED[name]
    warnings.warn(
        f"`keras_attn.layers.checks.{name}` moved to `{home.__name__}.{name}`; "
        "the old path will be removed in the next release.",
        DeprecationWarning,
        stacklevel=2,
    )
    return getattr(home, name)
