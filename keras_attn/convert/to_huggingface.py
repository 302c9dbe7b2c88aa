"""keras_attn decoders back to `transformers` folders (`save_huggingface`).

The Llama family (`llama`, `mistral`, `qwen2`) so far: `llama.huggingface_config`
says which config fields the model has (refusing, by option, what the model
type cannot express) and `llama.huggingface_tensors` gives the tensors
through the conversion's own projection table, read back. Kernels are read
as the layers serve them, so LoRA adapters are written merged.
"""

import json
import os

from keras_attn.convert import llama

# model_type -> (config fields, tensors) of a `DecoderOnlyLM`.
WRITERS = {model_type: (llama.huggingface_config, llama.huggingface_tensors)
           for model_type in llama.ARCHITECTURES}


def save_huggingface(model, folder, *, model_type=None):
    """Writes `model` as a `transformers` folder (`config.json` and
    `model.safetensors`, float32) that `AutoModelForCausalLM.from_pretrained`
    loads with the same logits; LoRA adapters are merged into the kernels.

    Args:
        model: a `DecoderOnlyLM` with a Llama, Mistral or Qwen2 layout
            (RMSNorm, gated feed-forward, rotary positions, the model type's
            biases).
        folder: the directory to write (created if needed).
        model_type: `"llama"`, `"mistral"` or `"qwen2"`; None: the one
            `from_huggingface` named the model after (`"qwen2_keras_attn"`),
            else `"llama"`.

    Returns:
        `folder`.

    Raises:
        ValueError: a `model_type` not written yet, or a model option that
            the model type's config cannot express (named).
    """
    if model_type is None:
        prefix = model.name[: -len("_keras_attn")] if model.name.endswith("_keras_attn") else "llama"
        model_type = prefix if prefix in WRITERS else "llama"
    if model_type not in WRITERS:
        raise ValueError("Received an invalid value for argument `model_type`, expected one of "
                         f"{sorted(WRITERS)}. Received: model_type={model_type!r}")
    config_of, tensors_of = WRITERS[model_type]
    config = config_of(model, model_type)
    from safetensors.numpy import save_file

    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump({**config, "torch_dtype": "float32"}, f, indent=2)
    save_file(dict(tensors_of(model)), os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    return folder
