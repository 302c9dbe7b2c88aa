"""keras_attn: attention layers for Keras 3 that export everywhere."""

__version__ = "0.2.0"

# Before anything imports TensorFlow: Triton (PyTorch) imported after it must not
# bind to its LLVM (see keras_attn/native_libraries.py).
from keras_attn import native_libraries  # noqa: E402

native_libraries.install()

import importlib.util as _util
import os as _os
import sys as _sys

# TensorFlow's C++ start-up lines (oneDNN notice, CUDA probing on a CPU
# machine) are hidden by default, as in the CLI; KERAS_ATTN_VERBOSE=1 keeps
# them. Only when keras_attn is what first imports TensorFlow.
if (
    "tensorflow" not in _sys.modules
    and _os.environ.get("KERAS_ATTN_VERBOSE", "") in ("", "0")
    and _os.environ.get("KERAS_BACKEND", "tensorflow") == "tensorflow"
    and _util.find_spec("tensorflow") is not None
):
    native_libraries.import_tensorflow_quietly()

from keras_attn import config  # noqa: F401
from keras_attn import ops  # noqa: F401
from keras_attn.layers import activations  # noqa: F401
from keras_attn import saving  # noqa: F401
from keras_attn.layers import *  # noqa: F401,F403
from keras_attn.layers import __all__ as _layers_all

__all__ = ["activations", "config", "ops", "saving", "__version__", *_layers_all]
