"""Training across devices and machines: a strategy-aware `Trainer` and model recipes."""

from keras_attn.training.recipes import seq2seq_transformer, transformer_classifier
from keras_attn.training.trainer import Trainer

__all__ = ["Trainer", "seq2seq_transformer", "transformer_classifier"]
