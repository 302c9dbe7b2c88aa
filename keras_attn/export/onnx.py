"""ONNX export via tf2onnx, verified in onnxruntime."""

import os

import numpy as np
import tensorflow as tf

from keras_attn.export import arguments
from keras_attn.export import onnx_fused
from keras_attn.export import precision
from keras_attn.export import report
from keras_attn.export import samples as model_io
from keras_attn.export import saved_model as saved_model_lib
from keras_attn.export import staging
from keras_attn.export import verify

OPSETS = (17, 18)


def rename_value(graph, old, new):
    """Renames a tensor everywhere in an ONNX graph (nodes, inputs, outputs, value infos)."""
    for node in graph.node:
        node.input[:] = [new if name == old else name for name in node.input]
        node.output[:] = [new if name == old else name for name in node.output]
    for value in list(graph.output) + list(graph.input) + list(graph.value_info):
        if value.name == old:
            value.name = new


def unsupported_onnx_ops(model_proto):
    """Op types in the graph that no ONNX opset defines (left over from TF)."""
    import onnx

    bad = set()
    for node in model_proto.graph.node:
        if not onnx.defs.has(node.op_type, node.domain or ""):
            bad.add(f"{node.op_type}" + (f" ({node.domain})" if node.domain else ""))
    return sorted(bad)


# onnxruntime has no assert op: an out-of-range id is clamped (and optionally
# flagged), as in TFLite (saved_model.ID_CHECKS).
ONNX_ID_CHECKS = (None, "clamp", "flag")


def convert(model, *, opset=17, check_ids="clamp"):
    """Converts `model` to an ONNX ModelProto named like the Keras model.

    Inputs keep the `keras.Input` names, outputs the model's output names
    (plus `valid` with `check_ids="flag"`, see `export_onnx`); dynamic axes
    are named `batch` (axis 0) and `<input>_dim<k>`.
    """
    arguments.check_choice("opset", opset, OPSETS)
    import tf2onnx

    check_ids = saved_model_lib.resolve_check_ids(check_ids, ONNX_ID_CHECKS)
    specs = model_io.input_specs(model)
    names = saved_model_lib.checked_output_names(model, check_ids)
    serve, _ = saved_model_lib.serving_function(model, check_ids)
    signature = [tf.TensorSpec(s.shape, s.dtype, name=s.name) for s in specs]

    @tf.function(input_signature=signature, autograph=False)
    def flat_serve(*args):
        outputs = serve({s.name: x for s, x in zip(specs, args)})
        return [outputs[n] for n in names]

    try:
        model_proto, _ = tf2onnx.convert.from_function(
            flat_serve, input_signature=signature, opset=opset
        )
    except Exception as error:  # tf2onnx raises many exception types
        raise report.ExportError(f"tf2onnx could not convert the model: {error}") from error
    bad = unsupported_onnx_ops(model_proto)
    if bad:
        raise report.UnsupportedOpsError(
            f"tf2onnx left TensorFlow ops it cannot convert to ONNX opset {opset}: "
            f"{bad}. Run check_exportable(model) to see which layers use them."
        )
    graph = model_proto.graph
    for output, name in zip(list(graph.output), names):
        if output.name != name:
            rename_value(graph, output.name, name)
    for graph_input, spec in zip(graph.input, specs):
        if graph_input.name != spec.name:
            rename_value(graph, graph_input.name, spec.name)
        dims = graph_input.type.tensor_type.shape.dim
        for axis, dim in enumerate(dims):
            if not dim.HasField("dim_value"):
                dim.dim_param = "batch" if axis == 0 else f"{spec.name}_dim{axis}"
    return model_proto


def run_onnx(model_bytes, sample, output_names):
    import onnxruntime as ort

    session = ort.InferenceSession(model_bytes, providers=["CPUExecutionProvider"])
    return [np.asarray(x) for x in session.run(output_names, sample)]


def export_onnx(
    model, path, *, opset=17, sample_inputs=None, atol=1e-4, overwrite=True, check_ids="clamp",
    fused=False,
):
    """Exports `model` to ONNX with tf2onnx and verifies it in onnxruntime.

    Args:
        model: a built functional or Sequential Keras model, or a
            subclassed one that has been called (see `samples.as_functional`).
        path: the `.onnx` file to write.
        opset: ONNX opset, 17 or 18.
        sample_inputs: inputs to verify with (see `export_saved_model`).
        atol: max abs difference allowed between onnxruntime and Keras.
        overwrite: replace an existing file.
        check_ids: an integer input fed into an embedding layer, given an id
            outside `[0, vocabulary_size)`: "clamp" (default) clips it into
            range before both the lookup and the padding mask (the answer is
            the clamped id's); "flag" also adds a boolean output `valid`
            `(batch,)`; None leaves the ids as they are (onnxruntime then
            fails or reads an unspecified row, depending on the provider).
        fused: write Transformer encoders with onnxruntime's fused kernels
            (`com.microsoft` Attention, SkipLayerNormalization, BiasGelu;
            see `keras_attn.export.onnx_fused`), verified like the plain
            graph; a model it does not cover falls back to tf2onnx with a
            warning. The file then runs only in onnxruntime.

    Returns:
        An `ExportReport` with the ONNX op types used.

    Raises:
        UnsupportedOpsError: tf2onnx cannot convert some TF op.
        ParityError: onnxruntime differs from Keras beyond `atol`.
    """
    model = model_io.as_functional(model, sample_inputs)
    specs = model_io.input_specs(model)
    names = model_io.output_names(model)
    atol = arguments.resolve_atol(atol, 1e-4)
    samples = model_io.normalize_samples(model, sample_inputs)
    model, float32_note = precision.model_for_export(model, samples)
    with staging.staged(path, "path", overwrite) as tmp:
        model_proto = onnx_fused.convert_or_fallback(model, opset, check_ids, fused, convert)
        content = model_proto.SerializeToString()
        with open(tmp, "wb") as f:
            f.write(content)
        checks = verify.verify_artifact(
            "ONNX", model, samples, lambda sample: run_onnx(content, sample, names),
            atol, os.path.abspath(path),
        )
        ops = sorted({node.op_type for node in model_proto.graph.node})
    details = {
        "opset": opset,
        "check_ids": check_ids,
        "fused": onnx_fused.fused_op_counts(model_proto) if fused else None,
        "inputs": [i.name for i in model_proto.graph.input],
        "outputs": [o.name for o in model_proto.graph.output],
    }
    return report.make_report(
        "onnx", path, checks, size_bytes=len(content), atol=atol, ops=ops, details=details,
        float32_note=float32_note,
    )
