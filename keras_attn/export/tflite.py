"""TFLite / LiteRT export with builtin ops only, verified in LiteRT."""

import os
import re
import tempfile

import numpy as np
import tensorflow as tf

from keras_attn.export import arguments
from keras_attn.export import bounds
from keras_attn.export import precision
from keras_attn.export import quality
from keras_attn.export import report
from keras_attn.export import samples as model_io
from keras_attn.export import saved_model as saved_model_lib
from keras_attn.export import staging
from keras_attn.export import tflite_encoder
from keras_attn.export import verify
from keras_attn.export import writers

QUANTIZATIONS = (None, "float16", "dynamic", "int8", "int16x8")
# The variants whose activations are integers, calibrated on representative inputs.
CALIBRATED = ("int8", "int16x8")
# Builtins-only TFLite has no assert op: an out-of-range id is clamped (and
# optionally flagged), see saved_model.ID_CHECKS.
TFLITE_ID_CHECKS = (None, "clamp", "flag")
# float32 must match Keras within float32 rounding (`bounds.Float32Bound`). A
# quantized model's outputs move with its weights' rounding, so it is checked by
# what each output means (`quality.MEASURES`), its max abs error only when `atol`
# is given; `min_agreement` predates the thresholds and overrides their "argmax".
DEFAULT_ATOL = {None: bounds.DEFAULT, "float16": None, "dynamic": None, "int8": None, "int16x8": None}
DEFAULT_THRESHOLDS = quality.DEFAULT_THRESHOLDS
# What int8 keeps in float with `float_ops="transformer"`: everything but the
# weight matmuls and lookups (FULLY_CONNECTED, GATHER): softmax, the
# normalizations (MEAN / SQUARED_DIFFERENCE / RSQRT ...), GELU, the residual
# adds and the attention matmuls, whose activations int8 clips or rounds away
# on a trained transformer (benchmarks/RESULTS.md, "Quantization").
TRANSFORMER_FLOAT_OPS = ("SOFTMAX", "MEAN", "SQUARED_DIFFERENCE", "RSQRT", "SUB", "ADD",
                         "MUL", "DIV", "GELU", "TANH", "LOGISTIC", "BATCH_MATMUL")


def _interpreter(model_content=None, model_path=None, delegates=True):
    from ai_edge_litert import interpreter as litert

    kwargs = {}
    if not delegates:
        kwargs["experimental_op_resolver_type"] = (
            litert.OpResolverType.BUILTIN_WITHOUT_DEFAULT_DELEGATES
        )
    return litert.Interpreter(model_content=model_content, model_path=model_path, **kwargs)


def tflite_op_names(model_content=None, model_path=None):
    """Sorted builtin op names in a .tflite flatbuffer (its bytes or its file)."""
    interpreter = _interpreter(model_content=model_content, model_path=model_path, delegates=False)
    return sorted({d["op_name"] for d in interpreter._get_ops_details()})


def _flex_error(error):
    """An UnsupportedOpsError naming the TF ops (and layers) that need Flex."""
    text = str(error)
    ops = re.findall(r"TF Select ops: ([^\n]+)", text)
    ops = sorted({o.strip() for line in ops for o in line.split(",") if o.strip()})
    where = sorted(set(re.findall(r'fused\["(\w+):", "([^"@]+)@', text)))
    layers = sorted({f"{path} ({op})" for op, path in where if op in ops or not ops})
    if "Lowering tensor list ops is failed" in text:
        lists = sorted(set(re.findall(r'fused\["TensorList\w+:", "([^"@]+)@', text)))
        return report.UnsupportedOpsError(
            "The model cannot be converted to TFLite with builtin ops only "
            "(TFLITE_BUILTINS): a TensorList (the while-loop of a Keras RNN such "
            "as GRU/LSTM, or a tf.TensorArray) has a dynamic element shape, "
            "usually the dynamic batch axis, and TFLite can lower TensorLists "
            f"to builtins only with static element shapes. At: {lists[:20]}. "
            "For Keras RNN layers use `unroll=True` with a fixed sequence length "
            "(same arithmetic, plain builtin ops); otherwise the model needs "
            "the Flex delegate (builtin_ops_only=False)."
        )
    if not ops and "neither a custom op nor a flex op" not in text:
        return None
    return report.UnsupportedOpsError(
        "The model cannot be converted to TFLite with builtin ops only "
        f"(TFLITE_BUILTINS). Ops that would need Flex (SELECT_TF_OPS): "
        f"{ops or 'see below'}; at: {layers[:20]}. Use layers built from "
        "keras.ops that lower to builtins, or run check_exportable(model)."
    )


def calibration_samples(model, representative_dataset):
    """The calibration inputs as a list of `{name: array}` sets (read once).

    `representative_dataset` is a `tf.data.Dataset`, a callable returning an
    iterable (a generator function), or an iterable; each element is one
    input set as `sample_inputs` takes it (array, list or dict by input name),
    with or without the batch axis; an `(inputs, targets)` pair of a training
    dataset is reduced to its inputs. None draws 32 random sets from the
    input specs (real data calibrates far better).
    """
    specs = model_io.input_specs(model)
    if representative_dataset is None:
        return [model_io.make_samples(model, shapes=[(1, 8)], seed=100 + i)[0] for i in range(32)]
    source = representative_dataset
    if isinstance(source, tf.data.Dataset):
        source = source.as_numpy_iterator()
    elif callable(source):
        source = source()
    if isinstance(source, (str, bytes, dict)) or not hasattr(source, "__iter__"):
        raise ValueError(
            "Received an invalid value for argument `representative_dataset`, expected a "
            "tf.data.Dataset, a generator function or an iterable of input sets. "
            f"Received: representative_dataset of type {type(representative_dataset).__name__}"
        )
    sets = []
    for item in source:
        if (isinstance(item, tuple) and len(item) == 2 and len(specs) != 2
                and (isinstance(item[0], dict) or len(specs) == 1)):
            item = item[0]  # (inputs, targets) of a training dataset
        item = _with_batch_axis(specs, item)
        sets.append(model_io.normalize_samples(model, item, "representative_dataset")[0])
    if not sets:
        raise ValueError(
            "Received an empty `representative_dataset`: calibration needs at least one input "
            f"set. Received: representative_dataset={representative_dataset!r}"
        )
    return sets


def _with_batch_axis(specs, item):
    """Adds a batch axis of 1 to inputs given one example at a time."""
    def fix(spec, x):
        x = np.asarray(x)
        return x[None] if x.ndim == len(spec.shape) - 1 else x

    if isinstance(item, dict):
        return {k: fix(next((s for s in specs if s.name == k), specs[0]), v)
                for k, v in item.items()}
    if isinstance(item, (list, tuple)) and len(item) == len(specs) and len(specs) > 1:
        return [fix(s, x) for s, x in zip(specs, item)]
    if len(specs) == 1:
        return fix(specs[0], item)
    return item


def convert(
    model,
    *,
    quantization=None,
    representative_dataset=None,
    builtin_ops_only=True,
    check_ids="clamp",
    float_ops=None,
):
    """Converts `model` to TFLite bytes (no file written, no verification).

    `check_ids`: "clamp", "flag" or None; `float_ops`: see `export_tflite`.

    Returns:
        `(bytes, details)`.
    """
    arguments.check_choice("quantization", quantization, QUANTIZATIONS)
    if representative_dataset is not None and quantization not in CALIBRATED:
        raise ValueError(
            "`representative_dataset` is only used with quantization='int8' or "
            f"'int16x8'. Received: quantization={quantization!r}"
        )
    float_ops = resolve_float_ops(float_ops, quantization)
    check_ids = saved_model_lib.resolve_check_ids(check_ids, TFLITE_ID_CHECKS)
    specs = model_io.input_specs(model)
    details = {"quantization": quantization or "none", "check_ids": check_ids}
    if quantization in CALIBRATED:
        input_names = [s.name for s in specs]
        calibration = [
            {name: sample[name] for name in input_names}
            for sample in calibration_samples(model, representative_dataset)
        ]
        details["calibration_sets"] = len(calibration)
    with tempfile.TemporaryDirectory(prefix="keras_attn_tflite_") as tmp:
        saved = os.path.join(tmp, "saved_model")
        saved_model_lib.write_saved_model(model, saved, check_ids)
        staging.release_memory()

        def make_converter(ops_sets):
            converter = tf.lite.TFLiteConverter.from_saved_model(
                saved, signature_keys=[saved_model_lib.SIGNATURE_KEY]
            )
            converter.target_spec.supported_ops = ops_sets
            if quantization is not None:
                converter.optimizations = [tf.lite.Optimize.DEFAULT]
            if quantization == "float16":
                converter.target_spec.supported_types = [tf.float16]
            if quantization in CALIBRATED:
                converter.representative_dataset = lambda: iter(calibration)
            return converter

        builtins = [tf.lite.OpsSet.TFLITE_BUILTINS]
        if not builtin_ops_only:
            builtins.append(tf.lite.OpsSet.SELECT_TF_OPS)
        try:
            if quantization == "int8" and float_ops:
                content = _int8_with_float_ops(
                    make_converter([tf.lite.OpsSet.TFLITE_BUILTINS_INT8] + builtins), float_ops)
                details["int8_ops"] = f"int8 except {list(float_ops)} (float)"
            elif quantization in CALIBRATED:
                ops_set, every = {
                    "int8": (tf.lite.OpsSet.TFLITE_BUILTINS_INT8, "all int8 (TFLITE_BUILTINS_INT8)"),
                    "int16x8": (tf.lite.OpsSet.EXPERIMENTAL_TFLITE_BUILTINS_ACTIVATIONS_INT16_WEIGHTS_INT8,
                                "all int16x8")}[quantization]
                try:
                    content = make_converter([ops_set]).convert()
                    details[f"{quantization}_ops"] = every
                except Exception:  # noqa: BLE001  some op has no kernel of that kind
                    content = make_converter([ops_set] + builtins).convert()
                    details[f"{quantization}_ops"] = f"{quantization} where a kernel exists, float elsewhere"
            else:
                content = make_converter(builtins).convert()
        except Exception as error:  # the converter raises ConverterError
            flex = _flex_error(error)
            if flex is not None:
                raise flex from error
            hint = ""
            if quantization == "int16x8" and "Max and min for dynamic tensors" in str(error):
                hint = (" (the int16x8 quantizer needs a calibrated range for every "
                        "tensor its ops read, and integer inputs such as an "
                        "attention mask that feed a comparison have none; use "
                        "quantization='int8', optionally float_ops='transformer')")
            raise report.ExportError(
                f"TFLite conversion failed{hint}: {error}") from error
    if quantization in CALIBRATED:
        _check_runs(content, calibration[0], quantization)
    return content, details


def _check_runs(content, sample, quantization):
    """Runs one calibration sample: the converter emits int16x8 ops that
    LiteRT has no kernel for (e.g. SQUARED_DIFFERENCE of a layer norm), which
    would otherwise fail only on the device."""
    try:
        _interpreter(model_content=content).get_signature_runner(
            saved_model_lib.SIGNATURE_KEY)(**sample)
    except (RuntimeError, ValueError) as error:
        raise report.ExportError(
            f"The {quantization} TFLite model was converted but LiteRT cannot run "
            f"it: {str(error).strip()}. This op has no {quantization} kernel in "
            "LiteRT; use quantization='int8' (optionally float_ops='transformer') "
            "or 'dynamic'."
        ) from error


def resolve_float_ops(float_ops, quantization):
    """`float_ops` as a tuple of TFLite op names (None: nothing kept float)."""
    if float_ops is None:
        return None
    if float_ops == "transformer":
        float_ops = TRANSFORMER_FLOAT_OPS
    if (isinstance(float_ops, str) or not isinstance(float_ops, (list, tuple))
            or not float_ops or not all(isinstance(op, str) and op.isupper() for op in float_ops)):
        raise ValueError(
            "Received an invalid value for argument `float_ops`, expected "
            "\"transformer\" or a non-empty list of TFLite builtin op names "
            f"(e.g. ['SOFTMAX', 'MEAN']). Received: float_ops={float_ops!r}"
        )
    if quantization != "int8":
        raise ValueError(
            "`float_ops` selects the ops an int8 export keeps in float; it needs "
            f"quantization='int8'. Received: quantization={quantization!r}, "
            f"float_ops={float_ops!r}"
        )
    return tuple(float_ops)


def _int8_with_float_ops(converter, float_ops):
    """Calibrates, then quantizes every op to int8 except the `float_ops` types."""
    # The public converter has no per-op selection; its MLIR quantizer does
    # (what tf.lite.experimental.QuantizationDebugger uses).
    from tensorflow.lite.python import convert as tflite_convert

    converter._experimental_calibrate_only = True
    calibrated = converter.convert()
    return tflite_convert.mlir_quantize(calibrated, denylisted_ops=list(float_ops))


def write_tflite(model, path, *, quantization=None, representative_dataset=None,
                 builtin_ops_only=True, check_ids="clamp", float_ops=None, writer="auto"):
    """Writes `model` as TFLite to `path` (no verification); returns the
    details (`convert`'s, plus "writer": "direct" or "converter", and
    "direct_writer_skipped": why "auto" did not use the direct writer, for a
    model `tflite_encoder.meant_for`). `writer`: as `export_tflite`'s.
    """
    writer = writers.check_writer(writer, ("converter",))
    arguments.check_choice("quantization", quantization, QUANTIZATIONS)

    # The converter's by design: no warning for these.
    by_design = (f"quantization={quantization!r} (it writes float32 and 'dynamic')"
                 if quantization not in tflite_encoder.QUANTIZATIONS else
                 "calibration arguments (it does not calibrate)"
                 if representative_dataset is not None or float_ops is not None else None)

    def direct():
        if by_design:
            raise tflite_encoder.NotFusableError(by_design)
        mode = saved_model_lib.resolve_check_ids(check_ids, TFLITE_ID_CHECKS)
        tflite_encoder.write_encoder_tflite(model, path, quantization=quantization, check_ids=mode)
        return {"quantization": quantization or "none", "check_ids": mode, "writer": "direct"}

    # A model the direct writer is not meant for going to the converter is no news.
    meant_for = tflite_encoder.meant_for(model)
    details, why = writers.direct_or_none(
        writer, direct, what=f"The TFLite export of `{model.name}`", direct_name="direct TFLite writer",
        traced_name="TensorFlow's TFLite converter", warn=meant_for and by_design is None)
    if details is not None:
        return details
    why = why if meant_for else None
    content, details = convert(
        model, quantization=quantization, representative_dataset=representative_dataset,
        builtin_ops_only=builtin_ops_only, check_ids=check_ids, float_ops=float_ops)
    with open(path, "wb") as f:
        f.write(content)
    details["writer"] = "converter"
    if why is not None:
        details["direct_writer_skipped"] = why
    return details


def _run(runner, sample, input_names, output_names):
    outputs = runner(**{name: sample[name] for name in input_names})
    return [np.asarray(outputs[name]) for name in output_names]


def export_tflite(
    model,
    path,
    *,
    quantization=None,
    representative_dataset=None,
    sample_inputs=None,
    atol=None,
    min_agreement=None,
    measure="auto",
    threshold=None,
    float_ops=None,
    builtin_ops_only=True,
    overwrite=True,
    check_ids="clamp",
    writer="auto",
):
    """Exports `model` to a `.tflite` file (LiteRT) and verifies it against Keras.

    The model is written with builtin ops only (no Flex / SELECT_TF_OPS),
    keeps a `serving_default` signature with the Keras input and output names
    and dynamic batch/sequence axes (use `resize_tensor_input`), and is run in
    `ai_edge_litert.interpreter.Interpreter` on the sample inputs. Transformer
    encoders (such as a BERT converted by `from_huggingface`) in float32 or
    "dynamic" are written straight from their weights
    (`keras_attn.export.tflite_encoder`, each weight held once); any other
    model or variant goes through TensorFlow's TFLite converter.

    Args:
        model: a built functional or Sequential Keras model, or a
            subclassed one that has been called (see `samples.as_functional`).
        path: the `.tflite` file to write.
        quantization: None (float32), "float16" (float16 weights),
            "dynamic" (int8 weights, float activations), "int8" (int8
            weights and activations, calibrated on `representative_dataset`)
            or "int16x8" (int8 weights, int16 activations where LiteRT has a
            kernel, calibrated likewise); the model's inputs and outputs
            stay float/int32.
        representative_dataset: for "int8" and "int16x8": a
            `tf.data.Dataset`, a generator function or an iterable of input
            sets (as `calibration_samples` reads them). None uses random
            inputs from the input specs: calibrate on real data, a
            pretrained model's activations on random ids are not its
            activations on text.
        sample_inputs: inputs to verify with (see `export_saved_model`).
        atol: max abs difference allowed; None derives float32's from
            float32 rounding (the magnitude of the Keras outputs and the
            model's size, `bounds.Float32Bound`; `details["atol_from"]` says
            how) and does not check the quantized variants' error (reported
            as `max_abs_error`; `measure` checks them).
        min_agreement: quantized variants only: the threshold of the
            outputs measured by argmax agreement (kept from before
            `threshold`; `threshold` wins when both are given). None uses
            0.99 for float16, 0.95 for dynamic and int16x8, 0.9 for int8.
        measure: quantized variants only: how each float output is compared
            with Keras (`keras_attn.export.quality.MEASURES`): "auto"
            (default) picks "argmax" (Keras's top-1 index) for logits and
            scores (by name, a softmax or a vocabulary-sized last axis,
            `quality.auto_measures`), "cosine" (per row) for other vectors,
            "relative_error" for one number per row; a measure name applies
            to every output, a dict `{output name: measure}` to some (the
            rest "auto").
        threshold: quantized variants only: the minimum argmax agreement or
            cosine, or the maximum relative error; a number (every output)
            or a dict by output name. None uses `min_agreement` for argmax
            outputs and `DEFAULT_THRESHOLDS[quantization]` otherwise.
            `report.quality` has each output's measure, worst value, mean
            and threshold.
        float_ops: "int8" only: op types kept in float (their inputs and
            outputs dequantized): "transformer" (`TRANSFORMER_FLOAT_OPS`:
            softmax, normalization, GELU, residual adds and attention
            matmuls; the weight matmuls and lookups stay int8) or a list of
            TFLite op names. None (default) quantizes every op that has an
            int8 kernel, what integer-only accelerators need.
        builtin_ops_only: False allows Flex ops (needs the Flex delegate on
            device); the default refuses them.
        overwrite: replace an existing file.
        check_ids: an integer input fed into an embedding layer, given an id
            outside `[0, vocabulary_size)`: "clamp" (default) clips it into
            range in the graph, before both the lookup and the padding mask,
            so the answer is the clamped id's; "flag" also adds a boolean
            output `valid` `(batch,)`, False for rows that held such an id;
            None leaves the ids as they are (the lookup then reads an
            unspecified row). Builtins-only TFLite cannot raise.
        writer: "auto" (default): the direct writer where it covers the
            model and the quantization (float32, "dynamic"), else
            TensorFlow's converter (with a warning naming why for a model
            with `TransformerEncoderBlock`s and 16.8M weights or more,
            `tflite_encoder.meant_for`); "direct": the direct writer or a
            `NotFusableError` naming what it does not cover; "traced": the
            converter ("converter" is its deprecated name).
            `details["writer"]` says which ("direct" or "converter").

    Returns:
        An `ExportReport` with the builtin ops used.

    Raises:
        UnsupportedOpsError: an op needs Flex.
        NotFusableError: `writer="direct"` and the direct writer does not
            cover the model or the quantization.
        ParityError: LiteRT's outputs differ from Keras beyond `atol`, or
            an output's measure is worse than its threshold (the message
            names the output, the measure, its value and the threshold).
    """
    model = model_io.as_functional(model, sample_inputs)
    specs = model_io.input_specs(model)
    names = model_io.output_names(model)
    arguments.check_choice("quantization", quantization, QUANTIZATIONS)
    writer = writers.check_writer(writer, ("converter",), stacklevel=3)
    atol = arguments.resolve_atol(atol, DEFAULT_ATOL[quantization])
    measures, thresholds = arguments.resolve_quality(
        model, quantization, measure, threshold, DEFAULT_THRESHOLDS[quantization], min_agreement)
    samples = model_io.normalize_samples(model, sample_inputs)
    model, float32_note = precision.model_for_export(model, samples)
    with staging.staged(path, "path", overwrite) as tmp:
        details = write_tflite(
            model, tmp, quantization=quantization, representative_dataset=representative_dataset,
            builtin_ops_only=builtin_ops_only, check_ids=check_ids, float_ops=float_ops,
            writer=writer)
        size = os.path.getsize(tmp)
        # LiteRT maps the file: the flatbuffer is not held in memory beside
        # the interpreter, and one interpreter (one packed copy of the
        # weights) runs every sample set.
        staging.release_memory()
        input_names = [s.name for s in specs]
        interpreter = _interpreter(model_path=tmp)
        runner = interpreter.get_signature_runner(saved_model_lib.SIGNATURE_KEY)
        checks = verify.verify_artifact(
            "TFLite", model, samples,
            lambda sample: _run(runner, sample, input_names, names),
            atol, os.path.abspath(path), measures=measures, thresholds=thresholds,
        )
        del runner, interpreter
        atol = verify.check_unmeasured("TFLite", checks, atol, measures, quantization,
                                       os.path.abspath(path))
        ops = tflite_op_names(model_path=tmp)
    details.update({"inputs": [s.name for s in specs], "outputs": names})
    return report.make_report(
        "tflite", path, checks, size_bytes=size, atol=atol, ops=ops, details=details,
        float32_note=float32_note, measures=measures, thresholds=thresholds,
    )
