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
- **ModernBERT** (`"modernbert"`: `ModernBertModel`, `ModernBertForMaskedLM`,
  `ModernBertForSequenceClassification`; `modernbert.py`), **EuroBERT**
  (`EuroBertModel`, `EuroBertForMaskedLM`; `eurobert.py`), **NomicBERT**
  (`NomicBertModel`; `nomic_bert.py`) and **Gemma 3's text model**
  (`Gemma3TextModel`, bidirectional with `use_bidirectional_attention=True`
  as in EmbeddingGemma; `gemma2.py`): a functional encoder with int32
  inputs `input_ids` and `attention_mask` (NomicBERT: and `token_type_ids`)
  and the output `last_hidden_state` or `logits`; local layers' windows are
  symmetric bands.
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
- **Gemma 4 text** (`Gemma4ForCausalLM`; `gemma4.py`): the same, plus
  per-layer input embeddings, layers reusing an earlier layer's keys and
  values (and cache), the value norm, per-layer output scales and
  "proportional" rotary; full-attention layers with another head size,
  experts and wider feed-forwards on the shared layers are refused by field.
- **T5** (`T5ForConditionalGeneration`, `T5EncoderModel`; `t5.py`): a
  `Seq2SeqLM` with relative position buckets, or a functional encoder.
- **sentence-transformers folders** (a `modules.json`: Transformer, Pooling,
  Dense, Normalize; `sentence_transformers.py`): one functional model whose
  output `sentence_embedding` is `SentenceTransformer.encode`'s.

What the converter cannot represent, it refuses with a ValueError naming
the config field (e.g. `position_embedding_type="relative_key"`,
`add_cross_attention=True`, an unknown `hidden_act`, `model_type="qwen3_moe"`
with what it has), the `model_type` or
the architecture. Every tensor of the checkpoint must be consumed by the
family's mapping, else a ValueError lists the leftovers (an unsupported
head, say).

A `save_pretrained` folder with safetensors files is converted without
building the PyTorch model: its `config.json` is read by
`transformers.AutoConfig` (which imports torch when it is installed), each
tensor from disk when the converter asks for it (`common.SafetensorsTensors`),
so no copy of the checkpoint stays in memory. Whatever the source, the Keras
model is built symbolically with no variable values and each variable is
made once, from its tensor (`common.values_from_checkpoint`): no random
initial values, no forward call. The peak is the Keras model plus its
biggest tensor (`benchmarks/RESULTS.md`, "Real sizes"). A `transformers`
model object, or a folder of PyTorch `.bin` files, gives its tensors through
the torch model's state dict. Requires `transformers` and `torch`
(`pip install "keras-attn[huggingface]"`), imported only when
`from_huggingface` is called.
"""

import importlib
import os
import sys

import keras

from keras_attn import checks
from keras_attn.convert import adapters
from keras_attn.convert import bert
from keras_attn.convert import common
from keras_attn.convert import gpt2
from keras_attn.convert import registry
from keras_attn.convert import sentence_transformers

ENCODER_TYPES = bert.FAMILY.model_types
DECODER_TYPES = gpt2.FAMILY.model_types


DTYPES = ("float32", "bfloat16", "float16")


def from_huggingface(model_or_local_dir, *, dropout=None, dtype="float32", adapter=None, use_modules=True,
                     output_dim=None):
    """Converts a Hugging Face encoder, decoder or T5 model (the families: see the module docstring).

    Args:
        model_or_local_dir: a `transformers.PreTrainedModel` (PyTorch) or the
            path of a local directory written by `save_pretrained` (only
            local files are read; the class is taken from the config's
            `architectures`). A directory with safetensors files (one or
            shards) is read tensor by tensor into the Keras variables,
            without building the PyTorch model; one with PyTorch `.bin`
            files is loaded with `transformers`.
        dropout: dropout of the converted encoder (embeddings, attention,
            residual branches, classifier head), for fine-tuning; None uses
            the config's `hidden_dropout_prob`. Decoders have none.
        dtype: the dtype of the converted model's variables and computations
            (its Keras dtype policy): `"float32"`, `"bfloat16"` or
            `"float16"`, whatever the checkpoint's. The checkpoint's tensors
            are read as float32 (exactly, from bfloat16 or float16) and
            rounded to nearest even into `dtype`.
        adapter: None, or the path of a PEFT LoRA adapter folder
            (`adapter_config.json` + `adapter_model.safetensors`, as
            `PeftModel.save_pretrained` writes it) for this model: it is put
            on the converted decoder as PEFT-style LoRA (`enable_lora`'s
            default), active and not merged, every other weight frozen, so
            the logits are `PeftModel.from_pretrained`'s. Families whose
            projections map one to one (Llama, Mistral, Qwen2/3, SmolLM3,
            Gemma) take adapters (`keras_attn.convert.adapters`).
        use_modules: for a sentence-transformers folder (one with
            `modules.json`): True converts all its modules (Transformer,
            Pooling, Dense, Normalize) into one model whose output
            `"sentence_embedding"` is `SentenceTransformer.encode`'s
            (`keras_attn.convert.sentence_transformers`); False converts its
            Transformer module alone (the encoder's hidden states).
        output_dim: None, or (sentence-transformers folders) the number of
            leading embedding features kept: the library's Matryoshka
            `truncate_dim`, applied after the last module.

    Returns:
        For a sentence-transformers folder (`use_modules=True`), a
        functional `keras.Model` with the output `{"sentence_embedding": (B, D)}`.
        Otherwise a functional `keras.Model` for encoders (BERT family,
        ModernBERT, EuroBERT, NomicBERT, `Gemma3TextModel`, `T5EncoderModel`), a `DecoderOnlyLM` for decoders, a `Seq2SeqLM` for
        `T5ForConditionalGeneration` (see the module docstring).

    Raises:
        ValueError: a model type, head or config field that keras_attn
            cannot represent, named with its value; an unknown `dtype`; an
            adapter that is not plain LoRA (DoRA, rsLoRA, trained biases,
            ...: the field is named) or for a family whose adapters do not
            convert.
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
    checks.check_choice("dtype", dtype, DTYPES)
    checks.check_bool("use_modules", use_modules)
    checks.check_positive_int("output_dim", output_dim, allow_none=True)
    if adapter is not None:  # checked before the (long) conversion
        adapters.read_config(os.fspath(adapter))
    modules = (use_modules and isinstance(model_or_local_dir, (str, os.PathLike))
               and sentence_transformers.is_folder(os.fspath(model_or_local_dir)))
    if output_dim is not None and not modules:
        raise ValueError(
            "Received an invalid value for argument `output_dim`: it truncates the embedding "
            "of a sentence-transformers folder (with modules.json, use_modules=True). "
            f"Received: output_dim={output_dim}, model_or_local_dir={model_or_local_dir!r}")
    if adapter is not None and modules:
        raise ValueError(
            "Received an invalid value for argument `adapter`: adapters convert onto decoders, "
            f"not sentence-transformers folders. Received: adapter={adapter!r}")
    checkpoint = None if modules else _checkpoint(model_or_local_dir)
    if adapter is not None:  # a family whose adapters do not convert: before converting it
        adapters.check_family(registry.find(checkpoint))
    # The family converters build their layers under the global policy.
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy(dtype)
    try:
        if modules:
            with common.values_from_checkpoint():
                model = sentence_transformers.convert(
                    os.fspath(model_or_local_dir),
                    lambda path: registry.convert(_checkpoint(path), dropout=dropout),
                    output_dim=output_dim,
                )
        else:
            model = registry.convert(checkpoint, dropout=dropout)
    finally:
        keras.config.set_dtype_policy(previous)
    if adapter is not None:
        adapters.load_peft_adapter(model, registry.find(checkpoint), os.fspath(adapter))
    return model


def _checkpoint(model_or_local_dir):
    """The `common.Checkpoint` of a model or a folder: a folder with
    safetensors files and an architecture in its config is read lazily
    (`common.SafetensorsTensors`); anything else goes through a
    `transformers` model."""
    if isinstance(model_or_local_dir, (str, os.PathLike)):
        path = os.fspath(model_or_local_dir)
        if not os.path.isdir(path):
            raise ValueError(
                "`model_or_local_dir` must be a transformers model or an existing "
                "local directory written by `save_pretrained` (nothing is "
                f"downloaded). Received: model_or_local_dir={path!r}"
            )
        transformers = _require("transformers")
        config = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
        names = getattr(config, "architectures", None) or []
        if names and common.safetensors_files(path):
            return common.Checkpoint(config=config, architecture=names[0],
                                     tensors=common.SafetensorsTensors(path))
    hf_model = _load(model_or_local_dir)
    return common.Checkpoint(
        config=hf_model.config,
        architecture=type(hf_model).__name__,
        tensors=common.StateDictTensors(hf_model.state_dict()),
    )


def _load(model_or_local_dir):
    if isinstance(model_or_local_dir, (str, os.PathLike)):
        path = os.fspath(model_or_local_dir)
        import transformers

        config = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
        names = getattr(config, "architectures", None) or []
        cls = getattr(transformers, names[0], None) if names else None
        if cls is None:
            cls = transformers.AutoModel
        return cls.from_pretrained(path, local_files_only=True)
    torch = sys.modules.get("torch")  # a torch model was built with torch imported
    if torch is not None and isinstance(model_or_local_dir, torch.nn.Module) and hasattr(
        model_or_local_dir, "config"
    ):
        return model_or_local_dir  # only its config and state_dict are read
    raise TypeError(
        "Received an invalid value for argument `model_or_local_dir`, expected a "
        "PyTorch transformers.PreTrainedModel or a local directory path. "
        f"Received: model_or_local_dir={type(model_or_local_dir).__name__}"
    )


def _require(name):
    try:
        return importlib.import_module(name)
    except ImportError as error:
        raise ImportError(
            f"from_huggingface needs `{name}` (and torch) to read a checkpoint: "
            f'pip install "keras-attn[huggingface]". Cause: {error}'
        ) from error
