"""Several `tf.function`s into one TFLite flatbuffer, one signature each.

Shared by the prefill/decode signatures (`keras_attn.runtimes.signatures`) and
the LiteRT-LM bundle (`keras_attn.runtimes.litertlm`).
"""

import tempfile

import tensorflow as tf

from keras_attn.export.saved_model import SERVING_SAVE_OPTIONS


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
    # The weights go to the converter once, as the SavedModel's variables:
    # every signature reads the same ones, the converter freezes them (they
    # are read-only) into constants shared by all signatures. Freezing each
    # signature first would hold one constant copy of the model per
    # signature in the graphs, the SavedModel and the converter.
    concrete = {name: fn.get_concrete_function() for name, fn in functions.items()}
    module = tf.Module()
    module.weights = list({id(v): v for c in concrete.values() for v in c.variables}.values())
    for name, fn in functions.items():
        setattr(module, name, fn)
    with tempfile.TemporaryDirectory(prefix="keras_attn_gen_tflite_") as tmp:
        tf.saved_model.save(module, tmp, signatures=concrete, options=SERVING_SAVE_OPTIONS)
        del module, concrete
        converter = tf.lite.TFLiteConverter.from_saved_model(
            tmp, signature_keys=list(functions)
        )
        converter.target_spec.supported_ops = [tf.lite.OpsSet.TFLITE_BUILTINS]
        if quantization in ("float16", "dynamic"):
            converter.optimizations = [tf.lite.Optimize.DEFAULT]
        if quantization == "float16":
            converter.target_spec.supported_types = [tf.float16]
        # Constant buffers after the flatbuffer, addressed by offset (as
        # LiteRT reads them): no 2 GB flatbuffer limit, and the converter's
        # Python passes over the whole model (buffer deduplication, metadata:
        # each a full copy as Python objects) are skipped; the MLIR exporter
        # already writes a constant shared by several signatures once.
        converter._experimental_use_buffer_offset = True
        converter.exclude_conversion_metadata = True
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
