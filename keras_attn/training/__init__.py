"""Training across devices and machines: a strategy-aware `Trainer`, checkpoints
that resume `model.fit` exactly, and model recipes."""

from typing import TYPE_CHECKING

from keras_attn.training.fit_checkpoint import FitCheckpoint
from keras_attn.training.recipes import seq2seq_transformer, transformer_classifier

if TYPE_CHECKING:  # what readers and the API docs resolve the name to
    from keras_attn.training.trainer import Trainer


def __getattr__(name):
    # The Trainer drives tf.distribute: imported on first use, so fitting
    # with FitCheckpoint on JAX or torch does not load TensorFlow.
    if name == "Trainer":
        from keras_attn.training.trainer import Trainer

        return Trainer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["FitCheckpoint", "Trainer", "seq2seq_transformer", "transformer_classifier"]
