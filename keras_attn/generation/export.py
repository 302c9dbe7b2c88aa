"""Deprecated alias of `keras_attn.runtimes.signatures` (0.2.0's path), kept for one release."""

import types
import warnings

from keras_attn.runtimes import signatures as _signatures

# stacklevel 2: the line that imports this module.
warnings.warn("`keras_attn.generation.export` moved to `keras_attn.runtimes.signatures`; the old "
              "path is deprecated and will be removed in the next release. Import from the new path.",
              DeprecationWarning, stacklevel=2)
__all__ = [name for name, value in sorted(vars(_signatures).items())
           if not name.startswith("_") and not isinstance(value, types.ModuleType)]


def __getattr__(name):
    return getattr(_signatures, name)
