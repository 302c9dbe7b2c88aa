"""Export Keras models to SavedModel (TF Serving), TFLite (LiteRT) and ONNX.

Every exporter writes to a temporary path, runs the artifact on sample inputs,
compares with the Keras model and only then moves it into place. This
subpackage imports TensorFlow; `keras_attn.layers` do not.

A model whose layers compute in float16/bfloat16 (mixed precision) is exported
as a float32 copy, with a warning (see `keras_attn.export.precision`). Outputs
that share a name (several outputs of one layer) get unique signature names:
repeats take the suffix `_1`, `_2`, ... (see `samples.output_names`).
"""

from keras_attn.export.all_formats import export_all
from keras_attn.export.check import ExportabilityReport, check_exportable
from keras_attn.export.onnx import export_onnx
from keras_attn.export.report import (
    ExportError,
    ExportReport,
    ParityError,
    UnsupportedOpsError,
)
from keras_attn.export.samples import make_samples
from keras_attn.export.saved_model import export_saved_model
from keras_attn.export.serving import predict_request, rest_predict_body
from keras_attn.export.tflite import export_tflite

__all__ = [
    "ExportError",
    "ExportReport",
    "ExportabilityReport",
    "ParityError",
    "UnsupportedOpsError",
    "check_exportable",
    "export_all",
    "export_onnx",
    "export_saved_model",
    "export_tflite",
    "make_samples",
    "predict_request",
    "rest_predict_body",
]
