"""`export_all`: one call that writes and verifies every format for a model."""

import os

from keras_attn.export import arguments
from keras_attn.export import onnx as onnx_lib
from keras_attn.export import precision
from keras_attn.export import report
from keras_attn.export import samples as model_io
from keras_attn.export import saved_model as saved_model_lib
from keras_attn.export import staging
from keras_attn.export import tflite as tflite_lib
from keras_attn.export.report import FORMATS

LABELS = {"saved_model": "SavedModel", "tflite": "TFLite", "onnx": "ONNX"}


def _suffixed(base, quantization):
    """A report key (`base` a format) or a file stem (`base` the name)."""
    return base if quantization is None else f"{base}_{quantization}"


def _label(fmt, quantization):
    return LABELS[fmt] + ("" if quantization is None else f" ({quantization})")


def export_all(
    model,
    output_dir,
    *,
    sample_inputs=None,
    name=None,
    formats=FORMATS,
    tflite_quantizations=(None,),
    onnx_quantizations=(None,),
    atol=None,
    min_agreement=None,
    measure="auto",
    threshold=None,
    representative_dataset=None,
    version=1,
    opset=17,
    on_error="raise",
    verbose=True,
    check_ids=None,
):
    """Exports `model` to SavedModel, TFLite and ONNX, each verified against Keras.

    Writes, under `output_dir`:
    `saved_model/<name>/<version>/` (TF Serving layout), `<name>.tflite`
    (float32) and `<name>_<quantization>.tflite` for each quantized variant,
    `<name>.onnx` (float32) and `<name>_<quantization>.onnx` likewise.
    Each exporter runs its artifact on the same sample inputs and compares
    with the Keras model (see `export_saved_model`, `export_tflite`,
    `export_onnx`).

    A model whose layers compute in float16/bfloat16 is exported as a float32
    copy (one warning; each report's `details["float32_copy"]` says how far
    the copy is from the model; see `keras_attn.export.precision`). Outputs
    sharing a name get unique names (`name`, `name_1`, ...).

    Args:
        model: a built functional or Sequential Keras model, or a
            subclassed one that has been called (see `samples.as_functional`).
        output_dir: directory for every artifact (created if needed).
        sample_inputs: inputs to verify with (array, list, dict by input name,
            or a list of dicts, e.g. two batch sizes); None generates two sets
            from the model's input specs.
        name: file stem and TF Serving model name; defaults to `model.name`.
        formats: a non-empty subset of ("saved_model", "tflite", "onnx").
        tflite_quantizations: TFLite variants, each None (float32),
            "float16", "dynamic", "int8" or "int16x8".
        onnx_quantizations: ONNX variants, each None (float32) or "dynamic"
            (int8 weights, activations quantized at run time; see
            `export_onnx`).
        atol: None (each exporter's default: for float32, float32 rounding
            at the magnitude of the outputs, `bounds.Float32Bound`; quantized
            TFLite variants report their max logit error and are checked by
            argmax agreement instead), a number for every export, or a dict
            keyed by report key ("saved_model", "tflite", "tflite_dynamic",
            "onnx", "onnx_dynamic", ...) whose missing keys use the
            defaults. A number is an absolute bound.
        min_agreement: for the quantized TFLite variants, the smallest
            fraction of argmax positions equal to Keras's (see
            `export_tflite`): None (defaults per quantization), a number, or
            a dict keyed by report key ("tflite_dynamic", ...).
        measure, threshold: for the quantized TFLite and ONNX variants, how
            each output is compared with Keras and the threshold (see
            `export_tflite`); the same for every variant, and refused when
            no variant is quantized.
        representative_dataset: calibration inputs of the "int8" and
            "int16x8" variants (see `export_tflite`); a generator is read
            once per variant, so pass a `tf.data.Dataset`, a list or a
            generator function.
        version: TF Serving version directory.
        opset: ONNX opset (17 or 18).
        on_error: "raise" stops at the first failing export; "continue"
            prints the error and goes on with the other formats (the failed
            key is then missing from the result).
        verbose: print one line per export (path, size, max abs error).
        check_ids: what every format does with an out-of-range id of an
            input that feeds an embedding (docs/guides/serving_validation.md):
            None uses each format's default ("assert" for SavedModel, "clamp"
            for TFLite and ONNX, which cannot raise); "clamp" or "flag" (a
            boolean `valid` output per row) applies to every format.

    Returns:
        `{key: ExportReport}` in export order, keys as for `atol`.

    Raises:
        ValueError: bad arguments (checked before anything is written).
        ExportError: an export failed (UnsupportedOpsError, ParityError) and
            `on_error="raise"`.
    """
    model = model_io.as_functional(model, sample_inputs)
    model_io.input_specs(model)
    arguments.check_formats(formats)
    if check_ids is not None:
        saved_model_lib.resolve_check_ids(check_ids, (None, "clamp", "flag"))
    arguments.check_members("tflite_quantizations", tflite_quantizations,
                            tflite_lib.QUANTIZATIONS, kind="sequence")
    arguments.check_members("onnx_quantizations", onnx_quantizations,
                            onnx_lib.QUANTIZATIONS, kind="sequence")
    arguments.check_choice("on_error", on_error, ("raise", "continue"))
    name = arguments.check_name("name", model.name if name is None else name, "file name")
    variants = {"tflite": tflite_quantizations, "onnx": onnx_quantizations}
    jobs = [(fmt, quantization) for fmt in FORMATS if fmt in formats
            for quantization in variants.get(fmt, (None,))]
    keys = [_suffixed(f, q) for f, q in jobs]
    atols = {k: arguments.resolve_atol(v, None)
             for k, v in arguments.by_key("atol", atol, keys).items()}
    quantized_keys = [_suffixed(f, q) for f, q in jobs if f == "tflite" and q is not None]
    agreements = {k: arguments.resolve_min_agreement(v, None)
                  for k, v in arguments.by_key("min_agreement", min_agreement, quantized_keys).items()}
    # Every quantized variant checks its outputs with the same measures and
    # thresholds: refused here, not after the formats before it are written.
    quantized = next((q for _, q in jobs if q is not None), None)
    arguments.resolve_quality(model, quantized, measure, threshold, {})
    samples = model_io.normalize_samples(model, sample_inputs)
    # Once for every format (one warning); the exporters then get a float32 model.
    try:
        model, float32_note = precision.model_for_export(model, samples)
    except report.ExportError as error:
        if on_error == "raise":
            raise
        if verbose:
            print(f"every format: export failed: {type(error).__name__}: {error}", flush=True)
        return {}
    output_dir = os.fspath(output_dir)

    reports = {}
    for (fmt, quantization), key in zip(jobs, keys):
        # Each format's graphs, converter buffers and runtime copies are gone
        # before the next starts: the peak is the largest format's, not a sum.
        staging.release_memory()
        label = _label(fmt, quantization)
        stem = _suffixed(name, quantization)
        kwargs = {"sample_inputs": samples}
        if check_ids is not None:
            kwargs["check_ids"] = check_ids
        if atols[key] is not None:
            kwargs["atol"] = atols[key]
        if agreements.get(key) is not None:
            kwargs["min_agreement"] = agreements[key]
        if quantization is not None:
            kwargs.update(measure=measure, threshold=threshold)
        try:
            if fmt == "saved_model":
                written = saved_model_lib.export_saved_model(
                    model, os.path.join(output_dir, "saved_model"), model_name=name,
                    version=version, **kwargs,
                )
            elif fmt == "tflite":
                if quantization in tflite_lib.CALIBRATED:
                    kwargs["representative_dataset"] = representative_dataset
                written = tflite_lib.export_tflite(
                    model, os.path.join(output_dir, f"{stem}.tflite"), quantization=quantization,
                    **kwargs,
                )
            else:
                written = onnx_lib.export_onnx(
                    model, os.path.join(output_dir, f"{stem}.onnx"), opset=opset,
                    quantization=quantization, **kwargs,
                )
        except Exception as error:  # noqa: BLE001  re-raised unless on_error="continue"
            if on_error == "raise":
                raise
            if verbose:
                print(f"{label}: export failed: {type(error).__name__}: {error}", flush=True)
            continue
        if float32_note is not None:
            written.details["float32_copy"] = float32_note
        reports[key] = written
        if verbose:
            print(
                f"{label}: {written.path} ({written.size_bytes / 1e6:.2f} MB), "
                f"max |{label} - Keras| = {written.max_abs_error:.2e} "
                f"({written.tolerance_text()})",
                flush=True,
            )
    return reports

