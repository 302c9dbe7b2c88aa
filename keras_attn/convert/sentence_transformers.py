"""sentence-transformers folders onto one functional model of the sentence embedding.

A sentence-transformers folder lists its modules in `modules.json`: a
`Transformer` (a Hugging Face encoder, converted by its family, e.g.
`bert.py`), then `Pooling`, optionally `Dense` layers and `Normalize`.
`convert(folder)` builds them into one functional `keras.Model`: the
encoder's inputs (`input_ids`, `attention_mask`, maybe `token_type_ids`)
and, when the folder's pooling excludes prompt tokens
(`include_prompt=False`), an int32 `prompt_length` `(B,)`; one output,
`{"sentence_embedding": (B, D)}` (the library's name for it; `embedding` is
the encoder's embedding layer), equal to `SentenceTransformer(folder).encode`
on the same tokens. Every step is a Keras layer or `keras.ops` in the graph, so the
embedding exports like any other output.

| sentence-transformers module              | in the Keras graph                                                 |
|-------------------------------------------|--------------------------------------------------------------------|
| `Transformer` (`path`, `config.json`)     | the family's functional encoder, its `last_hidden_state`           |
| `Pooling` (`1_Pooling/config.json`)       | `keras_attn.layers.SentencePooling`: `cls`, `lasttoken`, `mean`, `mean_sqrt_len_tokens`, `max`, `weightedmean` over `attention_mask` (several modes: concatenated in the listed order) |
| `Dense` (`config.json`, `linear.weight`/`linear.bias`) | `keras.layers.Dense` named `dense_<i>`, the torch activation mapped |
| `Normalize`                               | L2 normalization of the last axis                                  |
| `truncate_dim` (`output_dim=`)            | the first `output_dim` features, after every module                |

Matryoshka truncation is the library's `truncate_dim`: it cuts the output of
the last module, after `Normalize`, and does not normalize again (a
truncated normalized embedding has a norm below 1; cosine similarity is
unaffected).

Prompts (`config_sentence_transformers.json`'s `prompts` and
`default_prompt_name`) are text prefixes the library adds before
tokenizing; the model takes token ids, so `encode` here does that text
step (prompt, tokenization padded and truncated to the tokenizer's
`model_max_length`, the prompt's token count for `include_prompt=False`)
and runs the model.
"""

import json
import os

import keras
import numpy as np

from keras_attn.convert import common
from keras_attn.layers import sentence_pooling

# The module classes converted, by class name: sentence-transformers writes
# `sentence_transformers.models.<Class>` (before v5) or the class's full
# module path (`sentence_transformers.base.modules.dense.Dense`).
_MODULES = ("Transformer", "Pooling", "Dense", "Normalize")
POOLING_MODES = sentence_pooling.MODES
# `Pooling`'s configs before v5 set one boolean per mode; the library reads
# them in this order (`_LEGACY_POOLING_MODE_KWARGS`), "mean" when none is set.
_LEGACY_POOLING = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}
# The torch activation classes a `Dense` module's config names, as Keras activations.
_ACTIVATIONS = {"Tanh": "tanh", "Identity": None, "ReLU": "relu", "GELU": "gelu", "Sigmoid": "sigmoid",
                "SiLU": "silu"}


def is_folder(path):
    """Whether `path` is a sentence-transformers folder (it has `modules.json`)."""
    return os.path.isfile(os.path.join(path, "modules.json"))


def read_modules(folder):
    """`[(class name, absolute path)]` of `modules.json`, in order; a module
    class that is not converted is a ValueError naming its type."""
    with open(os.path.join(folder, "modules.json")) as f:
        entries = sorted(json.load(f), key=lambda entry: entry.get("idx", 0))
    modules = []
    for entry in entries:
        module_type = entry["type"]
        name = module_type.rsplit(".", 1)[-1]
        if not module_type.startswith("sentence_transformers.") or name not in _MODULES:
            raise ValueError(
                f"Cannot convert the sentence-transformers folder {folder!r}: modules.json lists "
                f"type={module_type!r}, which keras_attn does not convert (supported: "
                f"{', '.join(_MODULES)})"
            )
        modules.append((name, os.path.join(folder, entry.get("path", ""))))
    if not modules or modules[0][0] != "Transformer" or [m for m, _ in modules[1:]].count("Transformer"):
        raise ValueError(
            f"Cannot convert the sentence-transformers folder {folder!r}: modules.json must list one "
            f"Transformer, first. Received: {[m for m, _ in modules]}"
        )
    return modules


def _config(path, name="config.json"):
    file = os.path.join(path, name)
    if not os.path.isfile(file):
        return {}
    with open(file) as f:
        return json.load(f)


def pooling_modes(config):
    """The modes of a `Pooling` config, as a tuple, in the library's order."""
    if "pooling_mode" in config:
        mode = config["pooling_mode"]
        modes = (mode,) if isinstance(mode, str) else tuple(mode)
    else:
        modes = tuple(mode for key, mode in _LEGACY_POOLING.items() if config.get(key)) or ("mean",)
    for mode in modes:
        if mode not in POOLING_MODES:
            common.refuse("pooling_mode", mode, f"is not a sentence-transformers pooling mode ({POOLING_MODES})")
    return modes


def _check_io_names(config, module):
    # Modules may read and write other feature keys (token embeddings of
    # multi-vector models); one sentence embedding flows through here.
    for key in ("module_input_name", "module_output_name"):
        if config.get(key, "sentence_embedding") not in (None, "sentence_embedding"):
            common.refuse(key, config[key], f"(a {module} module not on the sentence embedding) is not supported")


def convert(folder, convert_transformer, *, output_dim=None):
    """One functional model from a sentence-transformers folder.

    `convert_transformer(path)`: the Transformer module's folder converted
    (a functional encoder with a `last_hidden_state` output), inside the
    caller's dtype policy and `common.values_from_checkpoint` scope.
    `output_dim`: None, or the number of leading features kept (the
    library's `truncate_dim`).
    """
    modules = read_modules(folder)
    encoder = convert_transformer(modules[0][1])
    if "last_hidden_state" not in encoder.output_names:
        raise ValueError(
            f"Cannot convert the sentence-transformers folder {folder!r}: its Transformer module "
            f"converts to {type(encoder).__name__} with outputs {encoder.output_names}; keras_attn "
            "pools the hidden states of encoders (BERT, RoBERTa, XLM-RoBERTa, T5 encoders) only"
        )
    hidden = encoder.get_layer("last_hidden_state").output
    # A list, as the encoder's: the exporters sign a functional model's
    # inputs in this order, each by its name.
    inputs = list(encoder.inputs)
    attention_mask = next(tensor for tensor in inputs if tensor.name == "attention_mask")
    prompt_length = None
    x = hidden
    dense_layers = []
    pooled = False
    for index, (module, path) in enumerate(modules[1:], start=1):
        config = _config(path)
        # The library's Dense and Normalize read the pooled `sentence_embedding`.
        if pooled == (module == "Pooling"):
            raise ValueError(
                f"Cannot convert the sentence-transformers folder {folder!r}: modules.json must list "
                f"one Pooling, right after the Transformer. Received: {[m for m, _ in modules]}"
            )
        if module == "Pooling":
            pooled = True
            if not config.get("include_prompt", True) and prompt_length is None:
                prompt_length = keras.Input((), dtype="int32", name="prompt_length")
                inputs.append(prompt_length)
            x = sentence_pooling.SentencePooling(pooling_modes(config), name="pooling")(
                x, attention_mask, None if config.get("include_prompt", True) else prompt_length)
        elif module == "Dense":
            _check_io_names(config, "Dense")
            if config.get("use_residual", False):
                common.refuse("use_residual", True, "(a Dense module with a residual) is not supported")
            activation = config.get("activation_function", "torch.nn.modules.activation.Tanh")
            torch_class = activation.rsplit(".", 1)[-1]
            if not activation.startswith("torch.") or torch_class not in _ACTIVATIONS:
                common.refuse("activation_function", activation,
                              f"is not an activation keras_attn maps (supported: torch.nn {sorted(_ACTIVATIONS)})")
            layer = keras.layers.Dense(config["out_features"], activation=_ACTIVATIONS[torch_class],
                                       use_bias=config.get("bias", True), name=f"dense_{index}")
            x = layer(x)
            dense_layers.append((layer, path))
        else:  # Normalize (read_modules refuses a second Transformer)
            _check_io_names(config, "Normalize")
            x = keras.ops.normalize(x, axis=-1, order=2)
    if not pooled:
        raise ValueError(
            f"Cannot convert the sentence-transformers folder {folder!r}: its modules give no "
            "sentence embedding (no Pooling module)"
        )
    if output_dim is not None:
        if output_dim > x.shape[-1]:
            raise ValueError(
                "Received an invalid value for argument `output_dim`, expected at most the "
                f"embedding size {x.shape[-1]}. Received: output_dim={output_dim}"
            )
        x = x[:, :output_dim]
    model = keras.Model(inputs, {"sentence_embedding": keras.layers.Identity(name="sentence_embedding")(x)},
                        name=f"{encoder.name}_sentence_embedding")
    for layer, path in dense_layers:
        _load_dense(layer, path)
    return model


def _load_dense(layer, path):
    """A Dense module's `linear.weight` (`(out, in)`) and `linear.bias`, from
    `model.safetensors` or, in older folders, `pytorch_model.bin`."""
    if common.safetensors_files(path):
        tensors = common.SafetensorsTensors(path)
    else:
        import torch

        tensors = common.StateDictTensors(
            torch.load(os.path.join(path, "pytorch_model.bin"), map_location="cpu", weights_only=True))
    weights = common.Weights(tensors)
    common.set_dense(layer, *weights.linear("linear"))
    weights.check_all_used(f"the Dense module {path!r}")


def prompts(folder):
    """`(prompts, default_prompt_name)` of the folder's
    `config_sentence_transformers.json` (`{}`, None when it has none)."""
    config = _config(folder, "config_sentence_transformers.json")
    return dict(config.get("prompts") or {}), config.get("default_prompt_name")


def encode(model, folder, texts, *, prompt_name=None, prompt=None):
    """`SentenceTransformer(folder).encode(texts, prompt_name=..., prompt=...)`
    with the converted `model`: the library's text steps, then `model`.

    The prompt is `prompt`, else the folder's prompt named `prompt_name`,
    else its `default_prompt_name`'s, as the library resolves it; it is
    prepended to each text. The texts are tokenized with the folder's
    tokenizer (`transformers.AutoTokenizer`), padded to the longest and
    truncated to the tokenizer's `model_max_length` (the folder's
    `max_seq_length`), in one batch. A model with a `prompt_length` input
    gets the prompt's token count, its trailing special token excluded.

    Args:
        model: the model `from_huggingface(folder)` returned.
        folder: the sentence-transformers folder it was converted from.
        texts: a list of strings.
        prompt_name: None or a key of the folder's `prompts`.
        prompt: None or a prompt string (wins over `prompt_name`).

    Returns:
        The float32 embeddings, a NumPy array `(len(texts), D)`.
    """
    import transformers

    if isinstance(texts, str) or not all(isinstance(text, str) for text in texts):
        raise TypeError("Received an invalid value for argument `texts`, expected a list of strings. "
                        f"Received: texts={texts!r}")
    table, default = prompts(folder)
    if prompt is None:
        if prompt_name is not None:
            if prompt_name not in table:
                raise ValueError(
                    f"Received an invalid value for argument `prompt_name`, expected one of "
                    f"{sorted(table)}. Received: prompt_name={prompt_name!r}")
            prompt = table[prompt_name]
        elif default is not None:
            prompt = table.get(default)
    module = read_modules(folder)[0][1]
    settings = _config(module, "sentence_bert_config.json")
    if settings.get("do_lower_case"):
        common.refuse("do_lower_case", True, "is not applied by encode: lowercase the texts")
    kwargs = {}
    if settings.get("max_seq_length") is not None:  # folders before v5 keep it here
        kwargs["model_max_length"] = settings["max_seq_length"]
    tokenizer = transformers.AutoTokenizer.from_pretrained(module, local_files_only=True, **kwargs)
    if prompt:
        texts = [prompt + text for text in texts]
    batch = tokenizer(list(texts), padding=True, truncation="longest_first", return_tensors="np")
    names = [tensor.name for tensor in model.inputs]
    feed = {name: np.asarray(batch[name], "int32") for name in names if name in batch}
    if "prompt_length" in names:
        count = 0
        if prompt:
            ids = tokenizer([prompt], padding=True, truncation="longest_first")["input_ids"][0]
            count = len(ids) - (ids[-1] in tokenizer.all_special_ids)
        feed["prompt_length"] = np.full((len(texts),), count, "int32")
    # One eager call: `predict` would trace a function for this one batch.
    return np.asarray(keras.ops.convert_to_numpy(model(feed, training=False)["sentence_embedding"]), "float32")
