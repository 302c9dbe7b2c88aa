"""Quickstart: train a small Transformer to normalise dates, then export it.

Same as `keras-attn demo`: builds the `human_dates` data set through tfds,
trains (progress bar), prints test accuracy and a few translations, saves the
model as `outputs/demo/dates.keras`, writes a cross-attention heatmap PNG, and
exports SavedModel / TFLite / ONNX with their parity to Keras. About 3-5
minutes on 2 CPU cores with the defaults.

    python examples/quickstart.py
    python examples/quickstart.py --num-train 2000 --epochs 1 --no-export   # a smoke run
"""

import sys

import keras_attn_cli

if __name__ == "__main__":
    sys.exit(keras_attn_cli.main(["demo", *sys.argv[1:]]))
