"""ONNX export, verified in onnxruntime.

Two writers: the direct one (`onnx_fused.direct_model_proto`: the graph
written from the Keras layers and weights, each weight once) for the layers
it covers (Transformer encoders such as a converted BERT), and tf2onnx for
any other model. tf2onnx holds many copies of the weights while it converts
(`TF2ONNX_MEMORY_FACTOR`); a model it would not fit in the memory available
is refused before it starts.

`quantization="dynamic"` writes int8 weights, the activations quantized at
run time (`keras_attn.export.onnx_quantize.quantize_matmul_weights` on
either writer's float32 graph), checked like a quantized TFLite export: by
each output's quality measure against Keras (`keras_attn.export.quality`).
"""

import os

import numpy as np
import tensorflow as tf

from keras_attn.export import arguments
from keras_attn.export import bounds
from keras_attn.export import onnx_fused
from keras_attn.export import onnx_graph
from keras_attn.export import precision
from keras_attn.export import quality
from keras_attn.export import report
from keras_attn.export import samples as model_io
from keras_attn.export import saved_model as saved_model_lib
from keras_attn.export import staging
from keras_attn.export import verify
from keras_attn.export import writers

OPSETS = (17, 18)
QUANTIZATIONS = (None, "dynamic")
# `quantize_dynamic` reads and writes the quantized graph as one protobuf,
# which cannot pass 2 GB.
QUANTIZABLE_WEIGHT_BYTES = 2**31 - 1
# tf2onnx's peak memory over the model's weight bytes, beyond what the
# process held before: it freezes the variables into a GraphDef, optimizes
# it with grappler, then rewrites it op by op in Python. Measured on 2-layer
# BERT-shaped encoders (without its per-pass graph copies, see
# `tf2onnx_from_function`): 38x for 9 MB of weights, 37x for 35 MB, and
# past 26x for 85 MB when it was stopped at 3.5 GB; rounded up.
TF2ONNX_MEMORY_FACTOR = 50


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

    return sorted({node.op_type + (f" ({node.domain})" if node.domain else "")
                   for node in model_proto.graph.node if not onnx.defs.has(node.op_type, node.domain or "")})


# onnxruntime has no assert op: an out-of-range id is clamped (and optionally
# flagged), as in TFLite (saved_model.ID_CHECKS).
ONNX_ID_CHECKS = (None, "clamp", "flag")


def tf2onnx_from_function(function, signature, opset):
    """tf2onnx's `from_function`, first without its per-optimizer graph copies.

    By default tf2onnx deep-copies its whole graph, constants included, before
    each optimizer pass of each iteration (to restore it if the pass fails),
    which left several GB of copies on a BERT (benchmarks/RESULTS.md, "Real
    sizes: encoder exports"). Its switch is an environment variable read at
    each conversion; a conversion that fails without the copies is retried
    with them, as tf2onnx would have run it. Returns the ModelProto.
    """
    import tf2onnx

    variable = tf2onnx.constants.ENV_TF2ONNX_CATCH_ERRORS
    old = os.environ.get(variable)
    os.environ[variable] = "FALSE"
    try:
        return tf2onnx.convert.from_function(function, input_signature=signature, opset=opset)[0]
    except Exception:  # noqa: BLE001  tf2onnx raises many types; retried as tf2onnx runs by default
        os.environ[variable] = "TRUE"
        return tf2onnx.convert.from_function(function, input_signature=signature, opset=opset)[0]
    finally:
        if old is None:
            os.environ.pop(variable, None)
        else:
            os.environ[variable] = old


def convert(model, *, opset=17, check_ids="clamp"):
    """Converts `model` to an ONNX ModelProto named like the Keras model.

    Inputs keep the `keras.Input` names, outputs the model's output names
    (plus `valid` with `check_ids="flag"`, see `export_onnx`); dynamic axes
    are named `batch` (axis 0) and `<input>_dim<k>`.
    """
    arguments.check_choice("opset", opset, OPSETS)
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
        model_proto = tf2onnx_from_function(flat_serve, signature, opset)
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


def weight_bytes(model):
    return int(sum(np.prod(w.shape) * np.dtype(w.dtype).itemsize for w in model.weights))


def available_memory():
    """Bytes the system can still give without swapping (Linux `MemAvailable`);
    None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _check_tf2onnx_memory(model, why):
    needed = TF2ONNX_MEMORY_FACTOR * weight_bytes(model)
    available = available_memory()
    if available is not None and needed > available:
        raise report.ExportError(
            f"The ONNX export of `{model.name}` needs tf2onnx (the direct writer does not "
            f"cover it: {why}), which holds about {TF2ONNX_MEMORY_FACTOR}x the weights while "
            f"converting: ~{needed / 1e9:.1f} GB for {weight_bytes(model) / 1e9:.2f} GB of "
            f"weights, and {available / 1e9:.1f} GB is available. Refused before starting "
            "rather than risk the out-of-memory killer. Export on a machine with more memory, "
            "use layers the direct writer covers (keras_attn.export.onnx_fused), or pass "
            "writer='traced' to try anyway."
        )


def _check_writer(fused, writer):
    writer = writers.check_writer(writer, ("tf2onnx",))
    if not isinstance(fused, bool):
        raise ValueError(
            f"Received an invalid value for argument `fused`, expected True or False. Received: fused={fused!r}"
        )
    if fused and writer == "traced":
        raise ValueError(
            "`fused=True` selects the direct writer's onnxruntime contrib ops; tf2onnx writes "
            "none. Received: fused=True, writer='traced'"
        )
    return writer


def model_proto_of(model, *, opset=17, check_ids="clamp", fused=False, writer="auto",
                   weights_file=None):
    """`(ModelProto, details)`: the model written by `writer` ("auto": the
    direct writer where it covers the model, else tf2onnx; see `export_onnx`).

    `details` has `"writer"` ("direct" or "tf2onnx") and, when "auto" fell
    back to tf2onnx, `"direct_writer_skipped"` (why). `weights_file`: see
    `onnx_fused.direct_model_proto` (the direct writer streams its
    initializers there; after tf2onnx the file is empty): the model file is
    what the file holds followed by the returned proto's serialization.
    """
    arguments.check_choice("opset", opset, OPSETS)
    writer = _check_writer(fused, writer)

    def direct():  # refuses (NotFusableError) before it writes anything to `weights_file`
        return onnx_fused.direct_model_proto(
            model, opset=opset, check_ids=check_ids, fused=fused, weights_file=weights_file)

    # Only fused=True asked for the direct writer's kind of graph: a plain
    # model that tf2onnx writes is no news.
    proto, why = writers.direct_or_none(
        writer, direct, what=f"The ONNX export (fused=True) of `{model.name}`",
        direct_name="direct ONNX writer", traced_name="tf2onnx", warn=fused)
    if proto is not None:
        return proto, {"writer": "direct"}
    details = {"writer": "tf2onnx"}
    if why is not None:
        _check_tf2onnx_memory(model, why)
        details["direct_writer_skipped"] = why
    return convert(model, opset=opset, check_ids=check_ids), details


def _check_quantizable(model, quantization):
    if quantization is not None and weight_bytes(model) > QUANTIZABLE_WEIGHT_BYTES:
        raise report.ExportError(
            f"quantization={quantization!r} rewrites the ONNX graph as one protobuf, which "
            f"holds at most 2 GB: `{model.name}` has {weight_bytes(model) / 1e9:.2f} GB of "
            "float32 weights. Export it in float32 (quantization=None), or write int8 weights "
            "with keras_attn.export.onnx_quantize.matmul_nbits on a graph saved with external data."
        )


def quantized_proto(model_proto, quantization):
    """`model_proto` (float32) quantized as `export_onnx(quantization=...)`
    writes it, rewritten in place: "dynamic" is
    `onnx_quantize.quantize_matmul_weights` with its defaults (int8 MatMul
    weights per output channel in a 7-bit range, so the integer arithmetic
    is the same on every CPU; activations quantized per tensor at run time,
    the first token's row with its own scale)."""
    from keras_attn.export import onnx_quantize

    arguments.check_choice("quantization", quantization, QUANTIZATIONS)
    if quantization is None:
        return model_proto
    return onnx_quantize.quantize_matmul_weights(model_proto, inplace=True)


def export_onnx(
    model, path, *, opset=17, sample_inputs=None, atol=None, overwrite=True, check_ids="clamp",
    fused=False, writer="auto", quantization=None, measure="auto", threshold=None,
):
    """Exports `model` to ONNX and verifies it in onnxruntime.

    The graph is written by the direct writer wherever it covers the model
    (`keras_attn.export.onnx_fused`: Transformer encoders built from
    `TokenAndPositionEmbedding`, `TransformerEncoderBlock` and `Dense`
    layers, such as a BERT converted by `from_huggingface`, and a
    sentence-transformers model's pooling, normalization and truncation), each weight
    held once; any other model goes through tf2onnx, refused up front when
    its estimated memory (`TF2ONNX_MEMORY_FACTOR` x the weights) exceeds what
    the system has available.

    Args:
        model: a built functional or Sequential Keras model, or a
            subclassed one that has been called (see `samples.as_functional`).
        path: the `.onnx` file to write.
        opset: ONNX opset, 17 or 18.
        sample_inputs: inputs to verify with (see `export_saved_model`).
        atol: max abs difference allowed between onnxruntime and Keras (an absolute
            bound); None (default) derives it from float32 rounding: the
            magnitude of the Keras outputs and the model's size
            (`bounds.Float32Bound`; the report's `details["atol_from"]`
            says how).
        overwrite: replace an existing file.
        check_ids: an integer input fed into an embedding layer, given an id
            outside `[0, vocabulary_size)`: "clamp" (default) clips it into
            range before both the lookup and the padding mask (the answer is
            the clamped id's); "flag" also adds a boolean output `valid`
            `(batch,)`; None leaves the ids as they are (onnxruntime then
            fails or reads an unspecified row, depending on the provider).
        fused: the direct writer uses onnxruntime's fused kernels
            (`com.microsoft` Attention, SkipLayerNormalization, BiasGelu;
            the file then runs only in onnxruntime) instead of standard
            ONNX ops (the kind of graph, not a choice of writer: tf2onnx
            writes none).
        writer: "auto" (default): the direct writer where it covers the
            model, else tf2onnx with a warning naming why; "direct": the
            direct writer or a `NotFusableError` naming what it does not
            cover; "traced": always tf2onnx, without the memory check
            ("tf2onnx", deprecated, is "traced"). The report's
            `details["writer"]` says which wrote the file ("direct" or
            "tf2onnx").
        quantization: None (float32) or "dynamic": int8 weights (a quarter
            of their float32 bytes) for every MatMul with a constant weight,
            the activations quantized to uint8 at run time
            (`quantized_proto`), from either writer's float32 graph (with
            `fused=True` the fused Attention ops' weights and, always, the
            embedding tables stay float32). Checked like a quantized TFLite
            export: by `measure` and `threshold`, not by the float32 bound;
            `atol` is then checked only when given. The report's
            `details["quantization"]` names it and `details["float32_bytes"]`
            is the float32 graph's size.
        measure: "dynamic" only: how each float output is compared with
            Keras (`keras_attn.export.quality.MEASURES`, see
            `export_tflite`): "auto" (default) picks argmax agreement for
            logits/scores, per-row cosine for embeddings and hidden
            states, relative error for one number per row.
        threshold: "dynamic" only: the minimum argmax agreement or cosine,
            or the maximum relative error; a number or a dict by output
            name. None uses `quality.DEFAULT_THRESHOLDS["dynamic"]`
            (argmax 0.95, cosine 0.98, relative error 0.2). Each output's
            measure, value, mean and threshold are in `report.quality`.

    Returns:
        An `ExportReport` with the ONNX op types used.

    Raises:
        UnsupportedOpsError: tf2onnx cannot convert some TF op.
        ParityError: onnxruntime differs from Keras beyond `atol`, or (a
            quantized export) an output's measure is worse than its
            threshold.
        ExportError: tf2onnx would need more memory than is available, or
            `quantization` is given for a model of more than 2 GB of
            weights.
        NotFusableError: `writer="direct"` and the direct writer does not
            cover the model.
    """
    model = model_io.as_functional(model, sample_inputs)
    model_io.input_specs(model)
    names = model_io.output_names(model)
    writer = _check_writer(fused, writer)
    arguments.check_choice("quantization", quantization, QUANTIZATIONS)
    atol = arguments.resolve_atol(atol, bounds.DEFAULT if quantization is None else None)
    measures, thresholds = arguments.resolve_quality(
        model, quantization, measure, threshold, quality.DEFAULT_THRESHOLDS[quantization])
    _check_quantizable(model, quantization)
    samples = model_io.normalize_samples(model, sample_inputs)
    model, float32_note = precision.model_for_export(model, samples)
    with staging.staged(path, "path", overwrite) as tmp:
        with open(tmp, "wb") as f:
            # float32: the direct writer streams its weights to the file; the
            # quantizer rewrites the whole graph in memory, in place.
            model_proto, details = model_proto_of(
                model, opset=opset, check_ids=check_ids, fused=fused, writer=writer,
                weights_file=f if quantization is None else None)
            if quantization is not None:
                details["float32_bytes"] = model_proto.ByteSize()
                model_proto = quantized_proto(model_proto, quantization)
            f.write(model_proto.SerializeToString())
        ops = sorted({node.op_type for node in model_proto.graph.node})
        details.update({
            "quantization": quantization or "none",
            "opset": opset,
            "check_ids": check_ids,
            "fused": onnx_fused.fused_op_counts(model_proto) if fused else None,
            "inputs": [i.name for i in model_proto.graph.input],
            "outputs": [o.name for o in model_proto.graph.output],
        })
        # tf2onnx's proto holds the weights: not kept beside onnxruntime's copy.
        del model_proto
        # Without prepacking: the MatMul weights as the file has them, not a
        # second copy repacked for the CPU kernels (same results).
        runner = onnx_graph.inference_session(tmp, prepack=False)
        checks = verify.verify_artifact(
            "ONNX", model, samples,
            lambda sample: [np.asarray(x) for x in runner.run(names, sample)],
            atol, os.path.abspath(path), measures=measures, thresholds=thresholds,
        )
        del runner
        atol = verify.check_unmeasured("ONNX", checks, atol, measures, quantization,
                                       os.path.abspath(path))
        size = os.path.getsize(tmp)
    return report.make_report(
        "onnx", path, checks, size_bytes=size, atol=atol, ops=ops, details=details,
        float32_note=float32_note, measures=measures, thresholds=thresholds,
    )
