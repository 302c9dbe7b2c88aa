"""Hugging Face `transformers` checkpoints onto keras_attn layers.

`from_huggingface(model_or_local_dir)` reads a PyTorch `transformers` model
(an instance, or a directory written by `save_pretrained`; nothing is ever
downloaded) and returns the same network built from keras_attn layers with
the weights copied, so it trains with Keras and exports to SavedModel,
TFLite (builtins only) and ONNX like any other keras_attn model.

Supported families and what they become (one module each, found through
the table in `keras_attn/convert/registry.py`; each module's docstring has
its tensor name mapping):

- **BERT-family encoders** (`model_type` `"bert"`, `"roberta"`,
  `"xlm-roberta"`; `bert.py`): a functional `keras.Model` with int32 inputs
  `input_ids`, `attention_mask` (1 = token, 0 = padding) and, when the
  config has more than one token type, `token_type_ids`; a base model
  outputs `last_hidden_state` (and `pooler_output`), a
  `*ForSequenceClassification` model `logits`.
- **GPT-2-family decoders** (`"gpt2"`; `gpt2.py`): a
  `keras_attn.generation.DecoderOnlyLM` (learned positions, pre-norm
  blocks, tied head), so `keras_attn.generation.greedy_search` and the
  generation exporters work on it.
- **Llama, Mistral, Qwen2** (`llama.py`) and **Gemma** (`gemma.py`)
  `*ForCausalLM`: a `DecoderOnlyLM` with RMSNorm, gated feed-forward, rotary
  positions (with the config's `rope_scaling`), grouped-query heads, the
  family's biases and window.
- **Qwen3** (`qwen3.py`), **Gemma 2 and Gemma 3 text** (`gemma2.py`),
  **SmolLM3** (`smollm3.py`), **Phi-3 / Phi-4-mini** (`phi3.py`)
  `*ForCausalLM`: the same, plus what each adds (QK-norm, sandwich norms,
  soft-capping, per-layer windows and rotary bases, rotary-free layers,
  fused projections, partial rotary, LongRoPE).
- **T5** (`T5ForConditionalGeneration`, `T5EncoderModel`; `t5.py`): a
  `Seq2SeqLM` with relative position buckets, or a functional encoder.

What the converter cannot represent, it refuses with a ValueError naming
the config field (e.g. `position_embedding_type="relative_key"`,
`add_cross_attention=True`, an unknown `hidden_act`, `model_type="qwen3_moe"`
with what it has), the `model_type` or
the architecture. Every tensor of the checkpoint must be consumed by the
family's mapping, else a ValueError lists the leftovers (an unsupported
head, say).

Requires `torch` and `transformers` (the `test` extra); they are imported
only when `from_huggingface` is called.
"""

import os

from keras_attn.convert import bert
from keras_attn.convert import common
from keras_attn.convert import gpt2
from keras_attn.convert import registry

ENCODER_TYPES = bert.FAMILY.model_types
DECODER_TYPES = gpt2.FAMILY.model_types


def from_huggingface(model_or_local_dir, *, dropout=None):
    """Converts a Hugging Face BERT-, RoBERTa-, GPT-2-, Llama-, Mistral-, Qwen2-, Gemma- or T5-style model.

    Args:
        model_or_local_dir: a `transformers.PreTrainedModel` (PyTorch) or the
            path of a local directory written by `save_pretrained` (only
            local files are read; the class is taken from the config's
            `architectures`).
        dropout: dropout of the converted encoder (embeddings, attention,
            residual branches, classifier head), for fine-tuning; None uses
            the config's `hidden_dropout_prob`. Decoders have none.

    Returns:
        A functional `keras.Model` for encoders (BERT family,
        `T5EncoderModel`), a `DecoderOnlyLM` for decoders, a `Seq2SeqLM` for
        `T5ForConditionalGeneration` (see the module docstring).

    Raises:
        ValueError: a model type, head or config field that keras_attn
            cannot represent, named with its value.
        TypeError: `model_or_local_dir` is neither a model nor a path.

    Example:

    >>> import transformers  # doctest: +SKIP
    >>> hf = transformers.BertModel(transformers.BertConfig(
    ...     vocab_size=100, hidden_size=32, num_hidden_layers=2,
    ...     num_attention_heads=4, intermediate_size=64))  # doctest: +SKIP
    >>> model = from_huggingface(hf)  # doctest: +SKIP
    >>> sorted(model.output_names)  # doctest: +SKIP
    ['last_hidden_state', 'pooler_output']
    """
    hf_model = _load(model_or_local_dir)
    checkpoint = common.Checkpoint(
        config=hf_model.config,
        architecture=type(hf_model).__name__,
        tensors=common.StateDictTensors(hf_model.state_dict()),
    )
    return registry.convert(checkpoint, dropout=dropout)


def _load(model_or_local_dir):
    if isinstance(model_or_local_dir, (str, os.PathLike)):
        path = os.fspath(model_or_local_dir)
        if not os.path.isdir(path):
            raise ValueError(
                "`model_or_local_dir` must be a transformers model or an existing "
                "local directory written by `save_pretrained` (nothing is "
                f"downloaded). Received: model_or_local_dir={path!r}"
            )
        import transformers

        config = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
        names = getattr(config, "architectures", None) or []
        cls = getattr(transformers, names[0], None) if names else None
        if cls is None:
            cls = transformers.AutoModel
        return cls.from_pretrained(path, local_files_only=True)
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is in the test extra
        torch = None
    if torch is not None and isinstance(model_or_local_dir, torch.nn.Module) and hasattr(
        model_or_local_dir, "config"
    ):
        return model_or_local_dir  # only its config and state_dict are read
    raise TypeError(
        "Received an invalid value for argument `model_or_local_dir`, expected a "
        "PyTorch transformers.PreTrainedModel or a local directory path. "
        f"Received: model_or_local_dir={type(model_or_local_dir).__name__}"
    )
