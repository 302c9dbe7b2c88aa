"""keras_attn decoders back to `transformers` folders (`save_huggingface`).

Every decoder family that converts: Llama, Mistral, Qwen2, Qwen3, Gemma,
Gemma 2, Gemma 3 (text), SmolLM3 and Phi-3. Each family module has a writer
(`llama.LlamaWriter` and its subclasses, the inverse of the family's
converter) whose `config` says which config fields the model has (refusing,
by option, what the model type cannot express) and whose `tensors` gives
the tensors through the conversion's own tables, read back. Kernels are read
as the layers serve them, so LoRA adapters are written merged.
"""

import json
import os

from keras_attn.convert import gemma
from keras_attn.convert import gemma2
from keras_attn.convert import llama
from keras_attn.convert import phi3
from keras_attn.convert import qwen3
from keras_attn.convert import smollm3

# model_type -> the writer of a `DecoderOnlyLM` as that model type.
WRITERS = {model_type: writer
           for writer in (llama.LlamaWriter, qwen3.Qwen3Writer, gemma.GemmaWriter, gemma2.Gemma2Writer,
                          smollm3.SmolLM3Writer, phi3.Phi3Writer)
           for model_type in writer.architectures}


def save_huggingface(model, folder, *, model_type=None):
    """Writes `model` as a `transformers` folder (`config.json` and
    `model.safetensors`, float32) that `AutoModelForCausalLM.from_pretrained`
    loads with the same logits; LoRA adapters are merged into the kernels.

    Args:
        model: a `DecoderOnlyLM` with the layout of a model type below
            (RMSNorm, gated feed-forward, rotary positions, the model type's
            biases, norms, scales and windows), as `from_huggingface` makes.
        folder: the directory to write (created if needed).
        model_type: `"llama"`, `"mistral"`, `"qwen2"`, `"qwen3"`, `"gemma"`,
            `"gemma2"`, `"gemma3_text"`, `"smollm3"` or `"phi3"`; None: the
            one `from_huggingface` named the model after
            (`"qwen2_keras_attn"`), else `"llama"`.

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
    writer = WRITERS[model_type](model, model_type)
    config = writer.config()
    from safetensors.numpy import save_file

    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump({**config, "torch_dtype": "float32"}, f, indent=2)
    save_file(dict(writer.tensors()), os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    return folder
