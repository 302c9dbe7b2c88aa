"""SavedModel export laid out for TF Serving: `<dir>/<model_name>/<version>/`."""

import os
import shutil

import keras
import numpy as np
import tensorflow as tf

from keras_attn.export import arguments
from keras_attn.export import bounds
from keras_attn.export import precision
from keras_attn.export import report
from keras_attn.export import samples as model_io
from keras_attn.export import staging
from keras_attn.export import verify

SIGNATURE_KEY = "serving_default"

# Serving needs no gradients. Custom gradients that capture loop-body tensors
# (the blocked attention path, the attention and LayerNorm gradients inside a
# decoding loop) cannot be serialised by `tf.saved_model.save` ("Found invalid
# capture ... when saving custom gradients"), so gradients are not saved.
SERVING_SAVE_OPTIONS = tf.saved_model.SaveOptions(experimental_custom_gradients=False)


# What an exported graph does with an integer id outside `[0, vocabulary_size)`
# of an input that feeds an embedding: `export_saved_model`'s `check_ids`
# (docs/guides/serving_validation.md). "assert" is SavedModel's alone: builtins-only
# TFLite and onnxruntime have no such op. "clamp" clips the id before the model
# sees it, so the lookup and the padding mask read the same id.
ID_CHECKS = (None, "assert", "clamp", "flag")
VALID_OUTPUT = "valid"


def resolve_check_ids(check_ids, allowed=ID_CHECKS):
    """`check_ids` as one of `allowed` (True means "assert", False None)."""
    if check_ids is True:
        check_ids = "assert"
    elif check_ids is False:
        check_ids = None
    return arguments.check_choice("check_ids", check_ids, allowed)


def _checked_ids(inputs, vocabularies, mode):
    """`(inputs, valid)`: the embedded inputs checked, clamped or left as they are
    (see ID_CHECKS), and the `(batch,)` row validity for "flag" (else None)."""
    out = dict(inputs)
    valid = None
    for name, vocab in vocabularies.items():
        ids = inputs[name]
        if mode == "assert":
            low, high = tf.reduce_min(ids), tf.reduce_max(ids)
            ok = tf.logical_or(tf.equal(tf.size(ids), 0), tf.logical_and(low >= 0, high < vocab))
            check = tf.debugging.Assert(ok, [
                f"serving_default: `{name}` must hold token ids in [0, vocabulary_size={vocab}). "
                f"Received min, max of `{name}`:", low, high])
            with tf.control_dependencies([check]):
                out[name] = tf.identity(ids)
            continue
        out[name] = tf.clip_by_value(ids, tf.zeros([], ids.dtype), tf.cast(vocab - 1, ids.dtype))
        if mode == "flag":
            in_range = tf.cast(tf.equal(out[name], ids), "int32")
            # Reduced as int32 (REDUCE_MIN): builtins-only TFLite and every
            # onnxruntime run it; an empty row reduces to INT32_MAX, i.e. valid.
            row = tf.reduce_min(tf.reshape(in_range, [tf.shape(ids)[0], -1]), axis=1)
            valid = row if valid is None else tf.minimum(valid, row)
    if valid is not None:
        valid = tf.greater(valid, 0)
    return out, valid


def serving_function(model, check_ids=False):
    """A `serve(inputs: dict) -> dict` function and its input signature.

    Inputs and outputs are keyed by the names of the model's `keras.Input`s
    and outputs; the batch axis (and every axis the model leaves as None, e.g.
    the sequence) is dynamic. `check_ids` says what happens to an integer
    input fed into an embedding that holds an id outside its vocabulary
    (ID_CHECKS; True is "assert"); "flag" adds the output `valid`.
    """
    mode = resolve_check_ids(check_ids)
    specs = model_io.input_specs(model)
    names = model_io.output_names(model)
    signature = {s.name: tf.TensorSpec(s.shape, s.dtype, name=s.name) for s in specs}
    vocabularies = model_io.embedded_inputs(model) if mode else {}
    if mode == "flag" and VALID_OUTPUT in names:
        raise ValueError(
            f"check_ids='flag' adds an output named '{VALID_OUTPUT}', and the model "
            f"already has one. Rename the model's output. Received outputs: {names}"
        )

    def serve(inputs):
        valid = None
        if vocabularies:
            inputs, valid = _checked_ids(inputs, vocabularies, mode)
        args = [inputs[s.name] for s in specs]
        outputs = model(args if len(args) > 1 else args[0], training=False)
        result = dict(zip(names, keras.tree.flatten(outputs)))
        if mode == "flag":
            if valid is None:  # no embedded input: every row is valid
                valid = tf.fill(tf.shape(args[0])[:1], True)
            result[VALID_OUTPUT] = valid
        return result

    return serve, [signature]


def checked_output_names(model, check_ids):
    """The exported signature's output names: the model's, plus `valid` for "flag"."""
    names = model_io.output_names(model)
    return names + [VALID_OUTPUT] if resolve_check_ids(check_ids) == "flag" else names


# A model's SavedModel is also reloaded to fine-tune or to take gradients
# (tf.GradientTape through the signature), which needs the custom gradients;
# without them TensorFlow finds no gradient for the IdentityN ops they leave.
MODEL_SAVE_OPTIONS = tf.saved_model.SaveOptions(experimental_custom_gradients=True)


def _write_archive(model, path, options, check_ids=False):
    serve, input_signature = serving_function(model, check_ids)
    archive = keras.export.ExportArchive()
    archive.track(model)
    # `track` lists the Keras variables, and the endpoint's own tf.Variables
    # are saved beside them: every weight twice in the checkpoint, and in
    # whatever loads it (TF Serving, the verification, TFLite's converter).
    # The same lists made of those tf.Variables save each weight once; the
    # loaded object keeps `variables` / `trainable_variables` (fine-tuning
    # under a GradientTape).
    for collection in ("variables", "trainable_variables", "non_trainable_variables"):
        archive.add_variable_collection(
            collection, [_tf_variable(v) for v in getattr(model, collection)])
    archive.add_endpoint(SIGNATURE_KEY, serve, input_signature=input_signature)
    archive.write_out(path, verbose=False, options=options)


def _tf_variable(variable):
    """The `tf.Variable` a Keras variable (TensorFlow backend) holds."""
    value = variable.value if isinstance(variable, keras.Variable) else variable
    return value if isinstance(value, tf.Variable) else variable


def write_saved_model(model, path, check_ids=False):
    """Writes the serving SavedModel of `model` at `path` (no verification).

    Custom gradients are saved (the SavedModel works under tf.GradientTape);
    a model whose custom gradients cannot be serialised is written without
    them, for serving only.
    """
    try:
        _write_archive(model, path, MODEL_SAVE_OPTIONS, check_ids)
    except Exception as error:  # noqa: BLE001 - TF raises several types for this
        if "custom gradient" not in str(error).lower():
            raise
        shutil.rmtree(path, ignore_errors=True)
        _write_archive(model, path, SERVING_SAVE_OPTIONS, check_ids)


def graph_op_types(concrete_function):
    """Sorted TF op types of a concrete function, nested functions included."""
    graph_def = concrete_function.graph.as_graph_def()
    ops = {node.op for node in graph_def.node}
    for function in graph_def.library.function:
        ops.update(node.op for node in function.node_def)
    return sorted(ops)


def signature_description(signature_fn):
    inputs = signature_fn.structured_input_signature[1]
    outputs = signature_fn.structured_outputs
    describe = lambda spec: {"dtype": spec.dtype.name, "shape": list(spec.shape)}  # noqa: E731
    return {
        "inputs": {k: describe(v) for k, v in inputs.items()},
        "outputs": {k: describe(v) for k, v in outputs.items()},
    }


def export_saved_model(
    model,
    export_dir,
    *,
    model_name=None,
    version=1,
    sample_inputs=None,
    atol=None,
    overwrite=True,
    check_ids=True,
):
    """Exports `model` as a TF Serving SavedModel and verifies it against Keras.

    Writes `<export_dir>/<model_name>/<version>/` with one `serving_default`
    signature whose inputs and outputs carry the names of the model's
    `keras.Input`s and outputs, with dynamic batch (and sequence) axes. The
    SavedModel needs no keras_attn code to load or serve.

    Args:
        model: a built functional or Sequential Keras model, or a
            subclassed one that has been called (see `samples.as_functional`).
        export_dir: the TF Serving model base directory's parent.
        model_name: the model's name for TF Serving; defaults to `model.name`.
        version: positive integer version directory.
        sample_inputs: inputs to verify with (array, list, dict by input name,
            or a list of dicts); None generates two sets with different batch
            sizes and sequence lengths from the model's input specs.
        atol: max abs difference allowed between SavedModel and Keras (an absolute
            bound); None (default) derives it from float32 rounding: the
            magnitude of the Keras outputs and the model's size
            (`bounds.Float32Bound`; the report's `details["atol_from"]`
            says how).
        overwrite: replace an existing version directory.
        check_ids: what an integer input fed straight into an embedding
            layer does with an id outside `[0, vocabulary_size)`. True (or
            "assert", the default): a request with a negative id (which the
            embedding would wrap around, Python-style, to a valid one) or an
            id past the vocabulary raises InvalidArgumentError naming the
            input (TF Serving answers INVALID_ARGUMENT). "clamp": the id is
            clipped into range (the answer is the clamped id's); "flag":
            clamped, plus a boolean output `valid` per row. The inputs
            checked are `details["checked_ids"]`. False leaves the check out
            (benchmarks/bench_serving.py measures its cost).

    Returns:
        An `ExportReport` (path, size, max abs error, TF ops, signature).

    Raises:
        ValueError: bad arguments, an unbuilt model, an unwritable path.
        ParityError: the loaded SavedModel differs from Keras beyond `atol`.
    """
    model = model_io.as_functional(model, sample_inputs)
    specs = model_io.input_specs(model)
    if isinstance(version, bool) or not isinstance(version, int) or version <= 0:
        raise ValueError(
            "Received an invalid value for argument `version`, expected a "
            f"positive integer. Received: version={version!r}"
        )
    model_name = arguments.check_name(
        "model_name", model.name if model_name is None else model_name, "name"
    )
    atol = arguments.resolve_atol(atol, bounds.DEFAULT)
    samples = model_io.normalize_samples(model, sample_inputs)
    model, float32_note = precision.model_for_export(model, samples)
    path = os.path.join(os.fspath(export_dir), model_name, str(version))
    check_ids = resolve_check_ids(check_ids)
    names = model_io.output_names(model)

    with staging.staged(path, "export_dir", overwrite) as tmp:
        write_saved_model(model, tmp, check_ids)
        loaded = tf.saved_model.load(tmp)
        signature = loaded.signatures[SIGNATURE_KEY]

        def run(sample):
            got = signature(**{k: tf.constant(v) for k, v in sample.items()})
            return [np.asarray(got[n]) for n in names]

        checks = verify.verify_artifact("SavedModel", model, samples, run, atol, path)
        ops = graph_op_types(signature)
        description = signature_description(signature)
        size = staging.size_of(tmp)
    details = {
        "model_name": model_name,
        "version": version,
        "signature": description,
        "inputs": [s.name for s in specs],
        "outputs": names,
        "checked_ids": model_io.embedded_inputs(model) if check_ids else {},
        "check_ids": check_ids,
    }
    return report.make_report(
        "saved_model", path, checks, size_bytes=size, atol=atol, ops=ops, details=details,
        float32_note=float32_note,
    )
