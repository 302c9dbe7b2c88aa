"""`python -m keras_attn.cli`: the `keras-attn` console script.

The script itself is the top-level module `keras_attn_cli`, which imports no
TensorFlow until a command runs (`keras-attn --help` is instant).
"""

import sys

from keras_attn_cli import main  # noqa: F401

if __name__ == "__main__":
    sys.exit(main())
