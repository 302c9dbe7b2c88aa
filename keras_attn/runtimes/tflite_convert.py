"""Several `tf.function`s into one TFLite flatbuffer, one signature each.

Shared by the prefill/decode signatures (`keras_attn.runtimes.signatures`) and
the LiteRT-LM bundle (`keras_attn.runtimes.litertlm`).
"""

import tempfile

import tensorflow as tf

from keras_attn.export.saved_model import SERVING_SAVE_OPTIONS


def _frozen_call(frozen, concrete):
    names = sorted(concrete.structured_outputs)

    def call(*args):
        outputs = frozen(*args)
        if isinstance(outputs, dict):
            return outputs
        return dict(zip(names, outputs))

    return call


GENERATION_QUANTIZATIONS = (None, "float16", "dynamic", "int4")


def signatures_to_tflite(functions, quantization=None):
    """One TFLite flatbuffer (builtin ops only) with a signature per `tf.function`.

    `quantization`: None (float32), "float16" (float16 weights), "dynamic"
    (int8 weights, per channel; fully connected layers run LiteRT's hybrid
    int8 kernels, activations stay float) or "int4" (int4 weights in blocks
    of 32 for the fully connected layers, with ai-edge-quantizer's
    `dynamic_wi4b32_afp32` recipe on the float32 model; needs
    `ai-edge-quantizer`).
    """
    if quantization not in GENERATION_QUANTIZATIONS:
        raise ValueError(
            "Received an invalid value for argument `quantization`, expected one of "
            f"{list(GENERATION_QUANTIZATIONS)}. Received: quantization={quantization!r}"
        )
    # With several signatures the converter keeps the weights as resource
    # variables (VAR_HANDLE/READ_VARIABLE) that the interpreter never
    # initialises, so each signature is frozen to constants first.
    from tensorflow.python.framework import convert_to_constants

    module = tf.Module()
    for name, fn in functions.items():
        concrete = fn.get_concrete_function()
        frozen = convert_to_constants.convert_variables_to_constants_v2(concrete)
        setattr(module, name, tf.function(_frozen_call(frozen, concrete),
                                          input_signature=fn.input_signature))
    with tempfile.TemporaryDirectory(prefix="keras_attn_gen_tflite_") as tmp:
        signatures = {name: getattr(module, name).get_concrete_function() for name in functions}
        tf.saved_model.save(module, tmp, signatures=signatures, options=SERVING_SAVE_OPTIONS)
        converter = tf.lite.TFLiteConverter.from_saved_model(
            tmp, signature_keys=list(functions)
        )
        converter.target_spec.supported_ops = [tf.lite.OpsSet.TFLITE_BUILTINS]
        if quantization in ("float16", "dynamic"):
            converter.optimizations = [tf.lite.Optimize.DEFAULT]
        if quantization == "float16":
            converter.target_spec.supported_types = [tf.float16]
        content = converter.convert()
    if quantization == "int4":
        content = _int4_weights(content)
    return content


def _int4_weights(content):
    try:
        from ai_edge_quantizer import quantizer, recipe
    except ImportError as error:
        raise ImportError(
            "quantization='int4' uses ai-edge-quantizer: pip install "
            "'keras-attn[llm-runtimes]' (or ai-edge-quantizer).") from error
    engine = quantizer.Quantizer(content)
    engine.load_quantization_recipe(recipe.dynamic_wi4b32_afp32())
    return bytes(engine.quantize().quantized_model)
