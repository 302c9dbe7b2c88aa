"""keras_attn: attention layers for Keras 3 that export everywhere."""

__version__ = "0.2.0"

from keras_attn import config  # noqa: F401
from keras_attn import ops  # noqa: F401
from keras_attn.layers import activations  # noqa: F401
from keras_attn import saving  # noqa: F401
from keras_attn.layers import *  # noqa: F401,F403
from keras_attn.layers import __all__ as _layers_all

__all__ = ["activations", "config", "ops", "saving", "__version__", *_layers_all]
