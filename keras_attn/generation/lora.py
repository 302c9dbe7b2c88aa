"""Low-rank adapters (LoRA) on a keras_attn language model's projections.

`DecoderOnlyLM.enable_lora` / `Seq2SeqLM.enable_lora` call `enable_lora`;
Keras's own LoRA (`Dense.enable_lora`, `EinsumDense.enable_lora`) does the
math, so exports see the merged kernel.
"""

from keras_attn import checks


def enable_lora(model, rank, target_names=("query", "value"), lora_alpha=None):
    """LoRA of `rank` on `model`'s sublayers named in `target_names`, every
    other weight frozen (KerasHub's `Backbone.enable_lora` recipe); returns
    the adapted layers. See `DecoderOnlyLM.enable_lora`.
    """
    rank = checks.check_positive_int("rank", rank)
    if isinstance(target_names, str):
        target_names = (target_names,)
    targets = [
        layer for layer in model._flatten_layers(include_self=False)
        if layer.name in target_names and hasattr(layer, "enable_lora")
    ]
    known = sorted({layer.name for layer in model._flatten_layers(include_self=False)
                    if hasattr(layer, "enable_lora")})
    missing = sorted(set(target_names) - {layer.name for layer in targets})
    if missing:
        raise ValueError(
            f"`target_names` has names of no projection of this model: {missing}. "
            f"Expected some of {known}."
        )
    if not model.built:
        raise ValueError("Call the model once (or build it) before `enable_lora`.")
    # Top-down: the model trainable, every sublayer frozen, then Keras's
    # LoRA variables (created trainable) on the targets.
    model.trainable = True
    for layer in model._flatten_layers(include_self=False):
        layer.trainable = False
    for layer in targets:
        layer.trainable = True
        layer.enable_lora(rank, lora_alpha=lora_alpha)
    # Keras's own traced `fit`/`evaluate`/`predict` steps read the model
    # without the adapters (Keras resets them after `quantize`, not here).
    model.train_function = model.test_function = model.predict_function = None
    return targets
