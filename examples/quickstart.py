"""Quickstart: train a small Transformer to normalise dates, then export it.

Same as `keras-attn demo`: builds the `human_dates` data set through tfds,
trains (progress bar), prints test accuracy and a few translations, writes a
cross-attention heatmap PNG, and exports SavedModel / TFLite / ONNX with
their parity to Keras. About 3-5 minutes on 2 CPU cores with the defaults.

    python examples/quickstart.py
    python examples/quickstart.py --num-train 2000 --epochs 1 --no-export   # a smoke run
"""

import sys

from keras_attn.training.quickstart import main

if __name__ == "__main__":
    sys.exit(main())
