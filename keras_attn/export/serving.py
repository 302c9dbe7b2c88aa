"""Requests for a model served by TF Serving: REST `:predict` and gRPC `Predict`.

`tensorflow-serving-api` depends on the `tensorflow` distribution (a second
TensorFlow next to `tensorflow-cpu`), so it is not a dependency. When it is
installed, `predict_request` returns its `PredictRequest`; otherwise it
returns a message built from the same schema (`tensorflow.serving.
PredictRequest`, fields `model_spec = 1`, `inputs = 2`, `output_filter = 3`,
with TensorFlow's own `TensorProto`), whose bytes are identical on the wire.
"""

import functools

import numpy as np

SIGNATURE_KEY = "serving_default"


def _check_inputs(inputs):
    if not isinstance(inputs, dict) or not inputs:
        raise TypeError(
            "Expected `inputs` to be a non-empty dict {input name: array} keyed "
            f"by the signature's input names. Received: {type(inputs).__name__}"
        )
    return {name: np.asarray(value) for name, value in inputs.items()}


def rest_predict_body(inputs, *, signature_name=SIGNATURE_KEY, layout="columnar"):
    """The JSON body of `POST /v1/models/<name>[/versions/<v>]:predict`.

    Args:
        inputs: `{input name: array}`, batch axis first.
        signature_name: the SavedModel signature to call.
        layout: "columnar" (`{"inputs": {name: batch}}`) or "row"
            (`{"instances": [{name: example}, ...]}`).

    Returns:
        A JSON-serialisable dict.
    """
    inputs = _check_inputs(inputs)
    if layout == "columnar":
        return {
            "signature_name": signature_name,
            "inputs": {name: value.tolist() for name, value in inputs.items()},
        }
    if layout == "row":
        batch = {v.shape[0] for v in inputs.values()}
        if len(batch) != 1:
            raise ValueError(f"The row layout needs one batch size. Received: {batch}")
        instances = [
            {name: value[i].tolist() for name, value in inputs.items()}
            for i in range(batch.pop())
        ]
        return {"signature_name": signature_name, "instances": instances}
    raise ValueError(
        "Received an invalid value for argument `layout`, expected 'columnar' "
        f"or 'row'. Received: layout={layout!r}"
    )


@functools.lru_cache(maxsize=1)
def _predict_request_class():
    try:
        from tensorflow_serving.apis import predict_pb2

        return predict_pb2.PredictRequest
    except ImportError:
        pass
    from google.protobuf import descriptor_pb2
    from google.protobuf import descriptor_pool
    from google.protobuf import message_factory
    from google.protobuf import wrappers_pb2
    from tensorflow.core.framework import tensor_pb2

    pool = descriptor_pool.DescriptorPool()

    def add(file_descriptor):
        try:
            pool.FindFileByName(file_descriptor.name)
        except KeyError:
            for dep in file_descriptor.dependencies:
                add(dep)
            proto = descriptor_pb2.FileDescriptorProto()
            file_descriptor.CopyToProto(proto)
            pool.Add(proto)

    add(tensor_pb2.DESCRIPTOR)
    add(wrappers_pb2.DESCRIPTOR)
    F = descriptor_pb2.FieldDescriptorProto
    f = descriptor_pb2.FileDescriptorProto(
        name="keras_attn/tensorflow_serving_predict.proto",
        package="tensorflow.serving",
        syntax="proto3",
        dependency=[tensor_pb2.DESCRIPTOR.name, wrappers_pb2.DESCRIPTOR.name],
    )

    def field(message, name, number, type_name=None, label=F.LABEL_OPTIONAL, **kwargs):
        kind = F.TYPE_MESSAGE if type_name else F.TYPE_STRING
        message.field.add(name=name, number=number, type=kind, label=label,
                          type_name=type_name, **kwargs)

    spec = f.message_type.add(name="ModelSpec")
    field(spec, "name", 1)
    spec.oneof_decl.add(name="version_choice")
    field(spec, "version", 2, ".google.protobuf.Int64Value", oneof_index=0)
    field(spec, "version_label", 4, oneof_index=0)
    field(spec, "signature_name", 3)
    request = f.message_type.add(name="PredictRequest")
    entry = request.nested_type.add(name="InputsEntry")
    entry.options.map_entry = True
    field(entry, "key", 1)
    field(entry, "value", 2, ".tensorflow.TensorProto")
    field(request, "model_spec", 1, ".tensorflow.serving.ModelSpec")
    field(request, "inputs", 2, ".tensorflow.serving.PredictRequest.InputsEntry",
          F.LABEL_REPEATED)
    field(request, "output_filter", 3, label=F.LABEL_REPEATED)
    pool.Add(f)
    return message_factory.GetMessageClass(
        pool.FindMessageTypeByName("tensorflow.serving.PredictRequest")
    )


def predict_request(model_name, inputs, *, signature_name=SIGNATURE_KEY, version=None):
    """A gRPC `PredictionService/Predict` request for TF Serving.

    Args:
        model_name: the name in `models.config` (the directory name).
        inputs: `{input name: array}`; each becomes a `TensorProto`
            (`tf.make_tensor_proto`).
        signature_name: the SavedModel signature to call.
        version: an int to pin a version, or None for the latest.

    Returns:
        A `tensorflow.serving.PredictRequest` message (see module docstring).
    """
    import tensorflow as tf

    inputs = _check_inputs(inputs)
    request = _predict_request_class()()
    request.model_spec.name = model_name
    request.model_spec.signature_name = signature_name
    if version is not None:
        request.model_spec.version.value = int(version)
    for name, value in inputs.items():
        # Through bytes: the fallback class lives in a private descriptor pool.
        request.inputs[name].ParseFromString(tf.make_tensor_proto(value).SerializeToString())
    return request
