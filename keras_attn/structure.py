"""What a function traced over a model depends on besides its weights' values.

A `tf.function` traced over a Keras model holds the graph of the model as it
was then: the layers it called, the variables it read and the Python
settings it baked in (a LoRA scale, a quantized kernel's dtype policy).
Training changes variables' values in place, which that graph sees;
`enable_lora`, `quantize`, merging adapters, flipping `trainable` or
replacing a layer it does not. A cache of traced functions keyed on a model
is therefore also keyed on the model's `Structure`.
"""

import keras


class Structure:
    """The structure of `model` now, compared by value.

    For the model and every layer it holds: the layer and its class,
    `trainable`, the dtype policy (quantization included) and the LoRA
    settings (merged or not included); every variable and
    its `trainable`. Variable values are not part of it: training in place
    keeps the structure equal. Layers and variables are compared by identity;
    holding them keeps a replaced one from handing its identity to a new one.
    """

    def __init__(self, model):
        layers, self._variables = _held(model)
        self._layers = layers[1:]  # not the model: a cache keyed weakly on it may hold this
        self._key = (
            tuple(_settings(layer) for layer in layers),
            tuple((id(v), v.trainable) for v in self._variables),
        )

    def __eq__(self, other):
        return isinstance(other, Structure) and self._key == other._key

    def __hash__(self):
        return hash(self._key)


def _held(model):
    """The layers and variables reachable from `model`'s attributes, in order.

    Read from the attributes themselves rather than Keras's own lists of
    sublayers and weights, which do not see a layer put into a list the model
    already built (`model.blocks[i] = block`).
    """
    layers, variables, seen, stack = [], [], set(), [model]
    while stack:
        item = stack.pop()
        if id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, keras.Variable):
            variables.append(item)
        elif isinstance(item, keras.layers.Layer):
            layers.append(item)
            stack.extend(reversed(list(vars(item).values())))
        elif isinstance(item, (list, tuple)):
            stack.extend(reversed(item))
        elif isinstance(item, dict):
            stack.extend(reversed(list(item.values())))
    return layers, variables


def _settings(layer):
    return (
        id(layer),
        type(layer),  # enable_lora's PEFT style switches the class
        layer.trainable,
        getattr(layer.dtype_policy, "name", None),
        getattr(layer, "lora_enabled", False),
        getattr(layer, "lora_rank", None),
        getattr(layer, "lora_alpha", None),
        getattr(layer, "lora_dropout", None),
        getattr(layer, "lora_merged", None),
    )
