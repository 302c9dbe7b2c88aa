"""What every exporter returns or raises: `ExportReport` and the export errors.

Every format's report is made by `make_report`, from the checks of
`verify.verify_artifact` and the format's own facts (`details`).
"""

import dataclasses
import os

from keras_attn.export import quality as quality_lib

FORMATS = ("saved_model", "tflite", "onnx")
"""The export formats, in the order they are written and checked."""


class ExportError(RuntimeError):
    """An export could not be produced or verified."""


class ParityError(ExportError):
    """The exported artifact disagrees with the Keras model beyond `atol`."""


class UnsupportedOpsError(ExportError, ValueError):
    """The model uses ops the target format cannot run natively."""


@dataclasses.dataclass
class ExportReport:
    """What an exporter wrote and how closely it matches Keras.

    Attributes:
        format: "saved_model", "tflite" or "onnx".
        path: where the artifact is (a directory for SavedModel).
        size_bytes: total size of the artifact on disk.
        max_abs_error: largest |artifact - keras| over every sample and output.
        atol: the tolerance it was checked against (None: reported, not
            checked; quantized exports are checked by `agreement`). The
            default is derived from float32 rounding per export
            (`bounds.Float32Bound`); `details["atol_from"]` then says how.
        ops: the op types in the artifact (TFLite builtins, ONNX ops, TF ops).
        checks: one entry per sample set: input shapes and max abs error.
        details: format-specific facts (signature, quantization, opset ...).
        agreement: for quantized exports, the fraction of positions (over
            every sample and every float output with a last axis > 1) whose
            argmax equals Keras's: the task-level check (top-1 class, next
            token). None when not computed.
        min_agreement: the threshold `agreement` was checked against.
        quality: for quantized exports, one entry per checked output:
            `{"measure", "value", "mean", "threshold"}` (see `quality.MEASURES`):
            `value` is the worst figure (the smallest argmax agreement or
            per-row cosine, the largest relative error), `mean` the average
            over rows (sample sets for relative error), `threshold` what
            `value` was checked against (None: reported, not checked).
    """

    format: str
    path: str
    size_bytes: int
    max_abs_error: float
    atol: float
    ops: list
    checks: list = dataclasses.field(default_factory=list)
    details: dict = dataclasses.field(default_factory=dict)
    agreement: float = None
    min_agreement: float = None
    quality: dict = dataclasses.field(default_factory=dict)

    def to_dict(self):
        return dataclasses.asdict(self)

    def __str__(self):
        shapes = "; ".join(
            ", ".join(f"{k}{tuple(v)}" for k, v in c["shapes"].items()) for c in self.checks
        )
        extra = "".join(f" {k}={v}" for k, v in self.details.items() if k != "signature")
        return (
            f"[{self.format}] {self.path} ({self.size_bytes / 1024:.1f} KiB){extra}\n"
            f"  max |export - keras| = {self.max_abs_error:.3g} ({self.tolerance_text()}) "
            f"on {shapes}\n  {len(self.ops)} op types: {', '.join(self.ops)}"
        )

    def tolerance_text(self):
        """`atol 0.0001`, or for a quantized export `argmax agreement 1.000 >= 0.95`."""
        parts = []
        if self.atol is not None:
            parts.append(f"atol {self.atol:g}")
        if self.quality:
            parts.extend(quality_lib.quality_text(name, q) for name, q in self.quality.items())
        elif self.agreement is not None:
            parts.append(f"argmax agreement {self.agreement:.3f} >= {self.min_agreement:g}")
        return ", ".join(parts) or "not checked"


def make_report(fmt, path, checks, *, size_bytes, atol, ops, details, float32_note=None,
                measures=None, thresholds=None):
    """The `ExportReport` of one verified artifact.

    Args:
        fmt: one of `FORMATS`.
        path: where the artifact was written (made absolute).
        checks: what `verify.verify_artifact` returned for it; the report's
            `max_abs_error` is the largest of theirs.
        size_bytes, atol, ops: as in `ExportReport`; `atol` may be the
            `bounds.Float32Bound` given to `verify_artifact`: the report
            holds the value it resolved to, and how (`details["atol_from"]`).
        details: the format's facts; `float32_note` (from
            `precision.model_for_export`), when not None, is added as
            `details["float32_copy"]`.
        measures, thresholds: for a quantized export, each output's measure
            and threshold (as given to `verify_artifact`): the report then
            holds each output's `quality`, the overall argmax `agreement`,
            and as `min_agreement` the smallest threshold of the argmax
            outputs. None for an export checked by `atol` alone.
    """
    details = dict(details)
    if any("atol" in c for c in checks):
        atol, details["atol_from"] = checks[0]["atol"], checks[0]["atol_from"]
        checks = [{k: v for k, v in c.items() if k not in ("atol", "atol_from")} for c in checks]
    if float32_note is not None:
        details["float32_copy"] = float32_note
    quality, agreement, min_agreement = {}, None, None
    if measures is not None:
        quality = quality_lib.quality_of(checks, measures, thresholds)
        agreement = quality_lib.agreement_of(checks)
        argmax = [q["threshold"] for q in quality.values() if q["measure"] == "argmax"]
        min_agreement = min(argmax) if argmax else None
    return ExportReport(
        format=fmt, path=os.path.abspath(path), size_bytes=size_bytes,
        max_abs_error=max(c["max_abs_error"] for c in checks), atol=atol, ops=ops, checks=checks,
        details=details, agreement=agreement, min_agreement=min_agreement, quality=quality,
    )
