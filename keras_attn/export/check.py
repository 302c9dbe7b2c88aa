"""`check_exportable`: find what would block an export, before exporting."""

import dataclasses

import keras

from keras_attn.export import arguments
from keras_attn.export import onnx as onnx_lib
from keras_attn.export import precision
from keras_attn.export import report
from keras_attn.export import samples as model_io
from keras_attn.export import saved_model as saved_model_lib
from keras_attn.export import tflite as tflite_lib
from keras_attn.export.report import FORMATS


@dataclasses.dataclass
class ExportabilityReport:
    """Per format: None when it converts, else the reason it does not.

    Attributes:
        problems: `{format: message}` for each format that would fail.
        tf_ops: the TF op types of the serving graph.
        warnings: things that convert but deserve attention (e.g. Lambda
            layers, which `keras.saving.load_model(safe_mode=True)` refuses).
    """

    problems: dict
    tf_ops: list
    warnings: list

    @property
    def ok(self):
        return not self.problems

    def __str__(self):
        lines = ["exportable" if self.ok else "NOT exportable"]
        lines += [f"  {fmt}: {msg}" for fmt, msg in self.problems.items()]
        lines += [f"  warning: {w}" for w in self.warnings]
        return "\n".join(lines)


def _first_line(error):
    return str(error).splitlines()[0][:2000]


def check_exportable(model, formats=FORMATS):
    """Converts `model` in memory to each format and reports what fails.

    TFLite is converted with builtin ops only, so any op that would need Flex
    (`SELECT_TF_OPS`) is reported with the layer it comes from; ONNX is
    converted with tf2onnx and any TF op it cannot map is reported. Nothing is
    written and nothing is verified numerically (the exporters do that).
    A model with float16/bfloat16 layers (mixed precision) is checked as the
    float32 copy the exporters would export, and a warning says so.

    Example:

    >>> import keras, keras_attn
    >>> x = keras.Input((None, 8), name="x")
    >>> m = keras.Model(x, keras_attn.MultiHeadAttention(2, 4)(x, x, use_causal_mask=True))
    >>> check_exportable(m, formats=("tflite",)).ok
    True
    """
    arguments.check_formats(formats)
    model = model_io.as_functional(model)
    model_io.input_specs(model)
    warnings = [
        f"Lambda layer '{layer.name}': keras.saving.load_model(safe_mode=True) "
        "(used by `keras-attn export`) refuses it; write a registered layer."
        for layer in model._flatten_layers(include_self=False)
        if isinstance(layer, keras.layers.Lambda)
    ]
    low = precision.low_precision_layers(model)
    if low:
        policies = "/".join(sorted(set(low.values())))
        try:
            model = precision.float32_copy(model)
        except report.ExportError as error:
            return ExportabilityReport({fmt: _first_line(error) for fmt in formats}, [], warnings)
        warnings.append(
            f"{len(low)} layers and sublayers compute in {policies}: the exporters export a float32 "
            "copy (same architecture and weights, float32 dtype policies) and verify "
            "against it; this report is about that copy."
        )
    import tensorflow as tf

    serve, signature = saved_model_lib.serving_function(model)
    concrete = tf.function(serve, input_signature=signature, autograph=False)
    try:
        tf_ops = saved_model_lib.graph_op_types(concrete.get_concrete_function())
    except Exception as error:  # tracing errors of user layers vary
        return ExportabilityReport({"saved_model": f"tracing failed: {error}"}, [], warnings)
    problems = {}
    for fmt, convert in (("tflite", tflite_lib.convert), ("onnx", onnx_lib.convert)):
        if fmt in formats:
            try:
                convert(model)
            except report.ExportError as error:
                problems[fmt] = _first_line(error)
    return ExportabilityReport(problems, tf_ops, warnings)
