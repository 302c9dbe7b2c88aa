"""Training across devices and machines: a strategy-aware `Trainer` and model recipes."""

from keras_attn.training.recipes import seq2seq_transformer, transformer_classifier
from keras_attn.training.trainer import Trainer, strategy_from_env

__all__ = ["Trainer", "seq2seq_transformer", "strategy_from_env", "transformer_classifier"]
