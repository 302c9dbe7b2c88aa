"""keras_attn: attention layers for Keras 3 that export everywhere."""

__version__ = "0.2.0"

# Before anything imports TensorFlow: Triton (PyTorch) imported after it must not
# bind to its LLVM (see keras_attn/native_libraries.py).
from keras_attn import native_libraries  # noqa: E402

native_libraries.install()

from keras_attn import config  # noqa: F401
from keras_attn import ops  # noqa: F401
from keras_attn.layers import activations  # noqa: F401
from keras_attn import saving  # noqa: F401
from keras_attn.layers import *  # noqa: F401,F403
from keras_attn.layers import __all__ as _layers_all

__all__ = ["activations", "config", "ops", "saving", "__version__", *_layers_all]
