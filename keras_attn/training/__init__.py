"""Training across devices and machines: a strategy-aware `Trainer`, checkpoints
that resume `model.fit` exactly, and model recipes."""

from keras_attn.training.fit_checkpoint import FitCheckpoint
from keras_attn.training.recipes import seq2seq_transformer, transformer_classifier
from keras_attn.training.trainer import Trainer

__all__ = ["FitCheckpoint", "Trainer", "seq2seq_transformer", "transformer_classifier"]
