"""Shared pieces of the exporters: parity checks, reports, staged output paths.

Every exporter writes its artifact to a temporary path next to the target,
runs the artifact on sample inputs, compares with the Keras model and only
then moves it into place, so a failed export never leaves a half-written
artifact behind.
"""

import contextlib
import dataclasses
import os
import shutil
import tempfile

import numpy as np

from keras_attn.export.samples import keras_outputs, output_names, shapes_of


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
            checked; quantized exports are checked by `agreement`).
        ops: the op types in the artifact (TFLite builtins, ONNX ops, TF ops).
        checks: one entry per sample set: input shapes and max abs error.
        details: format-specific facts (signature, quantization, opset ...).
        agreement: for quantized exports, the fraction of positions (over
            every sample and every float output with a last axis > 1) whose
            argmax equals Keras's: the task-level check (top-1 class, next
            token). None when not computed.
        min_agreement: the threshold `agreement` was checked against.
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
        if self.agreement is not None:
            parts.append(f"argmax agreement {self.agreement:.3f} >= {self.min_agreement:g}")
        return ", ".join(parts) or "not checked"


def compare(reference, got, names, where):
    """Max abs error between two lists of output arrays (shapes must agree)."""
    if len(reference) != len(got):
        raise ParityError(
            f"{where}: the artifact has {len(got)} outputs, the Keras model "
            f"{len(reference)} ({names})"
        )
    worst = 0.0
    for name, ref, out in zip(names, reference, got):
        out = np.asarray(out)
        if ref.shape != out.shape:
            raise ParityError(
                f"{where}: output '{name}' has shape {out.shape}, Keras gives {ref.shape}"
            )
        if ref.size:
            err = float(np.max(np.abs(out.astype("float64") - ref.astype("float64"))))
            if not np.isfinite(err):
                err = float("inf")
            worst = max(worst, err)
    return worst


def argmax_matches(reference, got):
    """`(matched, total)` argmax positions over the float outputs with a last axis > 1.

    `(0, 0)` when no output is a score vector (nothing to agree on).
    """
    matched = total = 0
    for ref, out in zip(reference, got):
        ref, out = np.asarray(ref), np.asarray(out)
        if ref.ndim < 1 or ref.shape[-1] < 2 or not np.issubdtype(ref.dtype, np.floating):
            continue
        same = np.argmax(ref, axis=-1) == np.argmax(out, axis=-1)
        matched += int(same.sum())
        total += int(same.size)
    return matched, total


def verify_artifact(fmt, model, samples, run, atol, path, min_agreement=None):
    """Runs the artifact (`run(sample) -> [outputs]`) on every sample set against Keras.

    Returns `(checks, worst)`: one `{"shapes", "max_abs_error", "argmax_matches"}`
    entry per sample set and the largest error. Raises ParityError beyond
    `atol` (None: not checked) or, given `min_agreement`, when the fraction of
    argmax positions equal to Keras's is below it (see `agreement_of`).
    """
    names = output_names(model)
    checks = []
    for sample in samples:
        reference, got = keras_outputs(model, sample), run(sample)
        err = compare(reference, got, names, fmt)
        checks.append({"shapes": shapes_of(sample), "max_abs_error": err,
                       "argmax_matches": list(argmax_matches(reference, got))})
    worst = max(c["max_abs_error"] for c in checks)
    if atol is not None:
        check_parity(fmt, checks, atol, path)
    if min_agreement is not None:
        check_agreement(fmt, checks, worst, min_agreement, path)
    return checks, worst


def agreement_of(checks):
    """Fraction of argmax positions equal to Keras's over `checks`; None if there were none."""
    matched = sum(c["argmax_matches"][0] for c in checks)
    total = sum(c["argmax_matches"][1] for c in checks)
    return matched / total if total else None


def check_agreement(fmt, checks, worst, min_agreement, path):
    agreement = agreement_of(checks)
    if agreement is not None and not agreement >= min_agreement:
        matched = sum(c["argmax_matches"][0] for c in checks)
        total = sum(c["argmax_matches"][1] for c in checks)
        raise ParityError(
            f"The {fmt} export does not give the Keras model's answers: argmax "
            f"agreement {agreement:.4f} ({matched}/{total} positions) < "
            f"min_agreement={min_agreement:g} (max |export - keras| = {worst:.3g}). "
            f"Nothing was written to {path}. Lower `min_agreement` if this loss "
            "is acceptable, or use a lighter quantization (float16 / none)."
        )
    return agreement


def check_parity(fmt, checks, atol, path):
    worst = max(c["max_abs_error"] for c in checks)
    if not worst <= atol:
        raise ParityError(
            f"The {fmt} export does not match the Keras model: max |export - keras| "
            f"= {worst:.3g} > atol={atol:g} ({checks}). Nothing was written to "
            f"{path}. Raise `atol` if this error is expected (quantisation)."
        )
    return worst


# --------------------------------------------------------------------------
# Writing without leaving half-written artifacts


def size_of(path):
    if os.path.isdir(path):
        return sum(
            os.path.getsize(os.path.join(root, f))
            for root, _, files in os.walk(path)
            for f in files
        )
    return os.path.getsize(path)


def _check_target(path, arg_name, overwrite):
    path = os.fspath(path)
    if not path:
        raise ValueError(f"Received an empty `{arg_name}`.")
    path = os.path.abspath(path)
    if os.path.exists(path) and not overwrite:
        raise FileExistsError(
            f"Received `{arg_name}`={path!r}, which already exists. Pass "
            "overwrite=True to replace it."
        )
    parent = os.path.dirname(path)
    try:
        _makedirs(parent)
    except OSError as error:
        raise ValueError(
            f"Received an unwritable `{arg_name}`={path!r}: cannot create its "
            f"parent directory ({error})"
        ) from error
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(
            f"Received an unwritable `{arg_name}`={path!r}: no write permission "
            f"on {parent!r}"
        )
    return path


_CREATED_DIRS = []


def _makedirs(parent):
    """`os.makedirs`, remembering the directories it created (for cleanup)."""
    missing = []
    head = parent
    while head and not os.path.exists(head):
        missing.append(head)
        head = os.path.dirname(head)
    os.makedirs(parent, exist_ok=True)
    _CREATED_DIRS[:] = missing


def _remove_created_dirs(created):
    for directory in created:  # deepest first
        try:
            os.rmdir(directory)
        except OSError:
            break


@contextlib.contextmanager
def staged(path, arg_name, overwrite=True):
    """Yields a temporary path beside `path`; moves it into place on success.

    On any exception the temporary artifact is removed and `path` is left as
    it was.
    """
    path = _check_target(path, arg_name, overwrite)
    created = list(_CREATED_DIRS)
    parent, base = os.path.split(path)
    tmp_root = tempfile.mkdtemp(prefix=f".{base}.partial-", dir=parent)
    tmp = os.path.join(tmp_root, base)
    try:
        yield tmp
        if not os.path.exists(tmp):
            raise ExportError(f"The exporter wrote nothing at {tmp}")
        old = None
        if os.path.exists(path):
            old = os.path.join(tmp_root, base + ".old")
            os.replace(path, old)
        os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp_root, ignore_errors=True)
        _remove_created_dirs(created)
        raise
    shutil.rmtree(tmp_root, ignore_errors=True)


def resolve_min_agreement(min_agreement, default):
    if min_agreement is None:
        return default
    if (isinstance(min_agreement, bool) or not isinstance(min_agreement, (int, float))
            or not 0 <= min_agreement <= 1):
        raise ValueError(
            "Received an invalid value for argument `min_agreement`, expected a "
            f"number in [0, 1] or None. Received: min_agreement={min_agreement!r}"
        )
    return float(min_agreement)


def resolve_atol(atol, default):
    if atol is None:
        return default
    if isinstance(atol, bool) or not isinstance(atol, (int, float)) or not atol >= 0:
        raise ValueError(
            f"Received an invalid value for argument `atol`, expected a "
            f"non-negative number or None. Received: atol={atol!r}"
        )
    return float(atol)


def check_formats(formats):
    """`formats` must be a non-empty collection of `FORMATS` (not a string)."""
    if isinstance(formats, str) or not formats or any(f not in FORMATS for f in formats):
        raise ValueError(
            f"Received an invalid value for argument `formats`, expected a "
            f"non-empty subset of {list(FORMATS)}. Received: formats={formats!r}"
        )


def check_name(arg_name, value, what):
    """`value` must be a non-empty string usable as one path component."""
    if not isinstance(value, str) or not value or os.sep in value:
        raise ValueError(
            f"Received an invalid value for argument `{arg_name}`, expected a "
            f"non-empty {what} without '{os.sep}'. Received: {arg_name}={value!r}"
        )
    return value
