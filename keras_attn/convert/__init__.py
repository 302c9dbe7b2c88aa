"""Pretrained models from other libraries onto keras_attn layers.

`from_huggingface` converts Hugging Face `transformers` checkpoints: BERT-,
RoBERTa-, GPT-2-, Llama-, Mistral-, Qwen2/3-, Gemma (1, 2, 3, 4)-, SmolLM3-,
Phi-3- and T5-style models (see `keras_attn.convert.huggingface` for what
each becomes). One module per family (`bert`, `gpt2`, `llama`, `gemma`,
`gemma2`, `gemma4`, `qwen3`, `smollm3`, `phi3`, `t5`), found through the table in
`keras_attn.convert.registry`; what they share (the checkpoint and weight
source, the refusals, the weight copies) is `keras_attn.convert.common`.
A sentence-transformers folder (`modules.json`) becomes one model of its
sentence embedding (`keras_attn.convert.sentence_transformers`).

LoRA adapters convert both ways as Hugging Face PEFT folders
(`save_peft_adapter`, `from_huggingface(..., adapter=folder)`; see
`keras_attn.convert.adapters`); `save_huggingface` writes a Llama, Mistral,
Qwen2/3, Gemma (1, 2, 3 text), SmolLM3 or Phi-3 decoder back as a
`transformers` folder (`keras_attn.convert.to_huggingface`).
"""

from keras_attn.convert.adapters import save_peft_adapter
from keras_attn.convert.huggingface import from_huggingface
from keras_attn.convert.to_huggingface import save_huggingface

__all__ = ["from_huggingface", "save_huggingface", "save_peft_adapter"]
