"""LoRA adapters as Hugging Face PEFT folders, both ways.

A PEFT LoRA folder holds `adapter_config.json` (`r`, `lora_alpha`,
`lora_dropout`, `target_modules`, ...) and `adapter_model.safetensors` with,
per adapted `nn.Linear` named `<module>` in the `transformers` model,
`base_model.model.<module>.lora_A.weight` `(r, in)` and
`base_model.model.<module>.lora_B.weight` `(out, r)`. keras_attn's
PEFT-style LoRA (`keras_attn.generation.lora`) keeps `A (in, r)` and
`B (r, out)` with the same flattening of heads, so the tensors are each
other's transposes. Which of our layers is `<module>` is the family's own
table (`common.Family.projections`, the converter's mapping read in
reverse); families without one (fused or rescaled projections: GPT-2,
Phi-3, Gemma 2/3/4) are refused.

`save_peft_adapter(model, folder)` writes our adapters so that
`peft.PeftModel.from_pretrained(hf_model, folder)` gives our logits;
`load_peft_adapter(model, family, folder)` (through
`from_huggingface(base, adapter=folder)`) puts a PEFT adapter on a converted
model, active and not merged.
"""

import json
import os

import numpy as np

from keras_attn.convert import common
from keras_attn.convert import registry
from keras_attn.generation import lora

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
_PREFIX = "base_model.model."
# Fields of PEFT's LoraConfig that change the network away from plain LoRA,
# with the value that keeps it plain.
_PLAIN = {
    "use_dora": False, "use_rslora": False, "bias": "none", "lora_bias": False,
    "fan_in_fan_out": False, "alpha_pattern": {}, "rank_pattern": {},
    "modules_to_save": None, "layer_replication": None, "trainable_token_indices": None,
    "target_parameters": None,
}


def _family_projections(model, model_type):
    """`{module name: layer}` of `model` under the family of `model_type`."""
    family = registry.CONVERTERS.get(model_type)
    if family is None:
        raise ValueError("Received an invalid value for argument `model_type`, expected one of "
                         f"{sorted(registry.CONVERTERS)}. Received: model_type={model_type!r}")
    return check_family(family).projections(model)


def check_family(family):
    """`family` when its LoRA adapters convert (its projections map one to
    one), else a ValueError naming it."""
    if family.projections is None:
        raise ValueError(f"LoRA adapters of {family.name} models do not convert: its projections "
                         "are fused or rescaled in keras_attn.")
    return family


def _model_type(model):
    # `from_huggingface` names a decoder "<model_type>_keras_attn".
    name = model.name
    if name.endswith("_keras_attn") and name[: -len("_keras_attn")] in registry.CONVERTERS:
        return name[: -len("_keras_attn")]
    return "llama"


def save_peft_adapter(model, folder, *, model_type=None, base_model_name_or_path=None):
    """Writes `model`'s LoRA adapters as a PEFT folder.

    `peft.PeftModel.from_pretrained(hf_model, folder)` then gives
    `hf_model` (the `transformers` model `model` was converted from) the
    logits of `model` with its adapters. The adapters must be PEFT-style
    (`enable_lora(..., style="peft")`, the default, or loaded with
    `from_huggingface(..., adapter=...)`), all of one rank, `lora_alpha` and
    dropout (one `LoraConfig`); merged or not, the adapter is written.

    Args:
        model: a `DecoderOnlyLM` with adapters.
        folder: the directory to write (created if needed);
            `adapter_config.json` and `adapter_model.safetensors` in it are
            replaced.
        model_type: the `transformers` `model_type` whose module names to
            use; None: the one `from_huggingface` named the model after
            (`"qwen2_keras_attn"`), else `"llama"` (the names of Llama,
            Mistral, Qwen2/3, SmolLM3 and Gemma).
        base_model_name_or_path: written into `adapter_config.json` (PEFT's
            field of the same name), or None.

    Returns:
        `folder`.

    Raises:
        ValueError: no PEFT-style adapters (Keras-style ones included),
            adapters of mixed rank, alpha or dropout, a family whose
            adapters do not convert, a layer with no `transformers` name.
    """
    adapted = lora.adapted_layers(model)
    if not adapted:
        keras_style = any(getattr(layer, "lora_enabled", False) for layer in model._flatten_layers())
        raise ValueError(
            "`model` has no PEFT-style LoRA adapters to save"
            + (" (its adapters are Keras's, style='keras', which PEFT cannot load)" if keras_style else "")
            + ": call `model.enable_lora(rank, ...)` (style='peft', the default) first."
        )
    settings = {(layer.lora_rank, layer.lora_alpha, layer.lora_dropout) for layer in adapted}
    if len(settings) != 1:
        raise ValueError(f"The adapters have different (rank, lora_alpha, dropout): {sorted(settings)}; "
                         "a PEFT folder holds one LoraConfig.")
    (rank, alpha, dropout), = settings
    names = _family_projections(model, model_type or _model_type(model))
    module_of = {id(layer): name for name, layer in names.items()}
    tensors = {}
    modules = []
    for layer in adapted:
        if id(layer) not in module_of:
            raise ValueError(f"The adapted layer `{layer.path}` has no `transformers` module name.")
        module = module_of[id(layer)]
        modules.append(module)
        a = np.asarray(layer.lora_kernel_a.numpy(), np.float32)
        b = np.asarray(layer.lora_kernel_b.numpy(), np.float32)
        tensors[f"{_PREFIX}{module}.lora_A.weight"] = np.ascontiguousarray(a.T)
        tensors[f"{_PREFIX}{module}.lora_B.weight"] = np.ascontiguousarray(b.T)
    # Short names ("q_proj") when every module of those kinds is adapted, as
    # PEFT users write them; else the full names, which PEFT matches exactly.
    short = sorted({m.rsplit(".", 1)[-1] for m in modules})
    if set(modules) != {n for n in names if n.rsplit(".", 1)[-1] in short}:
        short = sorted(modules)
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha,
        "lora_dropout": dropout, "target_modules": short,
        "base_model_name_or_path": base_model_name_or_path, "inference_mode": True,
        "init_lora_weights": True, **_PLAIN,
    }
    from safetensors.numpy import save_file

    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, CONFIG), "w") as f:
        json.dump(config, f, indent=2)
    save_file(tensors, os.path.join(folder, WEIGHTS), metadata={"format": "pt"})
    return folder


def read_config(folder):
    """`adapter_config.json` of a PEFT LoRA folder, checked to be plain LoRA."""
    path = os.path.join(folder, CONFIG)
    if not os.path.isfile(path) or not os.path.isfile(os.path.join(folder, WEIGHTS)):
        raise ValueError(f"`adapter` must be a PEFT adapter folder with {CONFIG} and {WEIGHTS}. "
                         f"Received: adapter={folder!r}")
    with open(path) as f:
        config = json.load(f)
    if config.get("peft_type") != "LORA":
        common.refuse("peft_type", config.get("peft_type"), "is not LoRA, the one adapter keras_attn loads")
    for field, plain in _PLAIN.items():
        value = config.get(field, plain)
        if value != plain and not (plain is None and not value):
            common.refuse(field, value, f"is not represented (plain LoRA has {plain!r})")
    return config


def load_peft_adapter(model, family, folder):
    """Puts the PEFT LoRA adapter in `folder` on `model` (converted by
    `family`), active and not merged; returns the adapted layers."""
    config = read_config(folder)
    names = check_family(family).projections(model)
    tensors = common.SafetensorsTensors(folder, files=[os.path.join(folder, WEIGHTS)])
    factors = {}
    for key in tensors:
        stem, _, kind = key.rpartition(".lora_")
        module = stem[len(_PREFIX):] if stem.startswith(_PREFIX) else None
        if kind not in ("A.weight", "B.weight") or module not in names:
            raise ValueError(f"The adapter tensor `{key}` has no keras_attn counterpart "
                             f"(expected {_PREFIX}<module>.lora_A.weight / lora_B.weight with a "
                             f"module such as {next(iter(names))!r}).")
        factors.setdefault(module, {})[kind[0]] = tensors[key]
    for module, pair in factors.items():
        if set(pair) != {"A", "B"}:
            raise ValueError(f"The adapter of `{module}` lacks its lora_{({'A', 'B'} - set(pair)).pop()}.weight.")
    layers = [names[module] for module in factors]
    lora.adapt(model, layers, int(config["r"]), config.get("lora_alpha", 8), config.get("lora_dropout", 0.0))
    for module, pair in factors.items():
        layer = names[module]
        common.assign(layer.lora_kernel_a, pair["A"].T, f"{_PREFIX}{module}.lora_A.weight")
        common.assign(layer.lora_kernel_b, pair["B"].T, f"{_PREFIX}{module}.lora_B.weight")
    return layers
