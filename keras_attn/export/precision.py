"""Export of models whose layers compute in float16 / bfloat16 (mixed precision).

TFLite's builtin kernels and tf2onnx's graphs are float32 (a float16 TFLite
model is float32 with float16 *weights*, see `quantization="float16"`), and a
model that computes in float16 differs from any float32 runtime by ~1e-3, so
such a model can be neither converted with builtin ops nor verified at the
float32 tolerance. The exporters therefore export a float32 copy: the same
architecture rebuilt from the model's config with float32 dtype policies,
holding the model's weights cast to float32, and verify the artifact against
that copy. They say so with a warning, and the report's
`details["float32_copy"]` gives the policies replaced and the max abs
difference between the copy and the model on the sample inputs.
"""

import warnings

import keras
import numpy as np

from keras_attn.export import report
from keras_attn.export import samples as model_io
from keras_attn.export import verify

LOW_PRECISION = ("float16", "bfloat16")
_LOW_POLICY_NAMES = ("float16", "bfloat16", "mixed_float16", "mixed_bfloat16")
_POLICY_CLASSES = ("DTypePolicy", "FloatDTypePolicy")


def low_precision_layers(model):
    """`{layer path: policy name}` of the layers computing or storing weights in 16 bits.

    Includes the `InputLayer`s of nested models (a `Sequential` called under
    a mixed policy gets a 16-bit one, which casts its input); the model's own
    inputs are the exported signature and are not counted.
    """
    own_inputs = {id(t._keras_history[0]) for t in model.inputs}
    found = {}
    for layer in model._flatten_layers(include_self=True):
        if isinstance(layer, keras.layers.InputLayer):
            if id(layer) not in own_inputs and str(layer.dtype) in LOW_PRECISION:
                found[getattr(layer, "path", layer.name)] = str(layer.dtype)
            continue
        policy = layer.dtype_policy
        if policy.compute_dtype in LOW_PRECISION or policy.variable_dtype in LOW_PRECISION:
            found[getattr(layer, "path", layer.name)] = policy.name
    return found


def _float32_config(config):
    """`config` with every float16/bfloat16 dtype (policy) replaced by float32."""
    if isinstance(config, list):
        return [_float32_config(c) for c in config]
    if not isinstance(config, dict):
        return config
    out = {}
    for key, value in config.items():
        if key == "dtype" and isinstance(value, str) and value in _LOW_POLICY_NAMES:
            value = "float32"
        elif (key == "dtype" and isinstance(value, dict)
              and value.get("class_name") in _POLICY_CLASSES
              and value.get("config", {}).get("name") in _LOW_POLICY_NAMES):
            value = {**value, "config": {**value["config"], "name": "float32"}}
        else:
            value = _float32_config(value)
        out[key] = value
    return out


def _float32_model_config(serialized):
    """A serialized model with float32 policies; the root model's own `InputLayer`s
    (the exported signature) keep their dtype, those of nested models do not."""
    out = _float32_config(serialized)
    layers = serialized.get("config", {}).get("layers")
    if isinstance(layers, list):
        out["config"]["layers"] = [
            old if isinstance(old, dict) and old.get("class_name") == "InputLayer" else new
            for old, new in zip(layers, out["config"]["layers"])
        ]
    return out


def float32_copy(model):
    """The same architecture with float32 dtype policies, holding `model`'s weights as float32.

    Raises:
        ExportError: the model cannot be rebuilt from its config, or the copy
            still has 16-bit layers, or its weights do not line up with the
            model's.
    """
    advice = (
        "Build a float32 copy yourself (keras.mixed_precision.set_global_policy("
        "'float32'), build the same model, copy.set_weights([w.astype('float32') "
        "for w in model.get_weights()])) and export the copy."
    )
    config = _float32_model_config(keras.saving.serialize_keras_object(model))
    policy = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy("float32")
    try:
        copy = keras.saving.deserialize_keras_object(config)
    except Exception as error:  # noqa: BLE001  user layers fail in many ways
        cause = " ".join(str(error).split())[:1000]
        raise report.ExportError(
            f"The model `{model.name}` computes in float16/bfloat16 and must be "
            "exported as a float32 copy, but it could not be rebuilt from its "
            f"config with float32 dtype policies. {advice} Cause: "
            f"{type(error).__name__}: {cause}"
        ) from error
    finally:
        keras.mixed_precision.set_global_policy(policy)
    left = low_precision_layers(copy)
    if left:
        raise report.ExportError(
            f"The float32 copy of the model `{model.name}` still has 16-bit layers "
            f"{left} (their policy is not a plain dtype policy in the config, or a "
            "layer fixes it). " + advice
        )
    source, target = model.weights, copy.weights
    if len(source) != len(target) or any(
        tuple(s.shape) != tuple(t.shape) for s, t in zip(source, target)
    ):
        raise report.ExportError(
            f"The float32 copy of the model `{model.name}` rebuilt from its config "
            f"has different weights ({len(target)} vs {len(source)}, or other "
            "shapes). " + advice
        )
    copy.set_weights([np.asarray(keras.ops.convert_to_numpy(s)).astype(t.dtype)
                      for s, t in zip(source, target)])
    return copy


def model_for_export(model, samples=None):
    """`(model_to_export, note)`: `model` itself (note None) or its float32 copy.

    For a model with float16/bfloat16 layers, `note` is the dict stored in
    the reports' `details["float32_copy"]`: the 16-bit policies replaced and,
    given `samples`, the max abs difference between the copy and the model.
    """
    layers = low_precision_layers(model)
    if not layers:
        return model, None
    copy = float32_copy(model)
    note = {"replaced_policies": sorted(set(layers.values()))}
    gap_text = ""
    if samples:
        names = model_io.output_names(model)
        gap = max(verify.compare(model_io.keras_outputs(model, s), model_io.keras_outputs(copy, s),
                                 names, "float32 copy") for s in samples)
        note["max_abs_diff_vs_model"] = gap
        gap_text = f"; max |float32 copy - model| = {gap:.3g} on the sample inputs"
    warnings.warn(
        f"keras_attn.export: the model `{model.name}` has layers computing in "
        f"{'/'.join(note['replaced_policies'])} ({len(layers)} layers and sublayers, e.g. "
        f"{next(iter(layers))!r}); exporting a float32 copy (same architecture "
        "and weights, float32 dtype policies) and verifying the artifact "
        f"against that copy{gap_text}.",
        UserWarning,
        stacklevel=3,
    )
    return copy, note
