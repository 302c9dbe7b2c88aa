"""Pretrained models from other libraries onto keras_attn layers.

`from_huggingface` converts BERT-/RoBERTa-style encoders and GPT-2-style
decoders from Hugging Face `transformers` (see `keras_attn.convert.huggingface`
for the supported configs and the tensor name mapping).
"""

from keras_attn.convert.huggingface import from_huggingface

__all__ = ["from_huggingface"]
