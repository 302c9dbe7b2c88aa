"""Shared pieces of the exporters: input specs, sample inputs, parity, reports.

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

import keras
import numpy as np


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


# --------------------------------------------------------------------------
# Inputs and outputs of the model


@dataclasses.dataclass(frozen=True)
class InputSpec:
    name: str
    shape: tuple  # batch axis first, None = dynamic
    dtype: str


def input_specs(model):
    """The named inputs of a built functional/Sequential model.

    Raises:
        ValueError: the model has no known inputs (never built or called, or
            a subclassed model), or two inputs share a name.
    """
    if not isinstance(model, keras.Model):
        raise TypeError(
            "Expected `model` to be a keras.Model. Received: "
            f"model={model!r} of type {type(model).__name__}"
        )
    try:
        inputs = model.inputs
    except (AttributeError, ValueError):
        inputs = None
    if not model.built or not inputs:
        raise ValueError(
            f"Received an unbuilt model `{model.name}` (no known inputs): "
            "export needs a functional or Sequential model with `keras.Input`s "
            "so the exported signature has names, dtypes and shapes. Build it "
            "with `keras.Input(shape=(None, ...), name=...)`. Received: "
            f"model.built={model.built}"
        )
    specs = []
    for tensor in inputs:
        shape = (None,) + tuple(tensor.shape[1:])
        specs.append(InputSpec(tensor.name, shape, str(tensor.dtype)))
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"The model's inputs must have unique names. Received: {names}")
    return specs


def output_names(model):
    """Signature names of the model's outputs, in the order of `model.outputs`.

    These are `model.output_names`, made unique: several outputs of one layer
    (e.g. `MultiHeadAttention(..., return_attention_scores=True)` giving the
    output and the scores) share the layer's name, so every repeat after the
    first gets the suffix `_1`, `_2`, ... (skipping names already taken):
    `["mha", "mha"]` -> `["mha", "mha_1"]`.
    """
    names = [str(n) for n in model.output_names]
    taken = set(names)
    unique, seen = [], set()
    for name in names:
        if name in seen:
            k = 1
            while f"{name}_{k}" in taken:
                k += 1
            name = f"{name}_{k}"
            taken.add(name)
        seen.add(name)
        unique.append(name)
    return unique


def keras_outputs(model, sample):
    """Runs the Keras model on a `{name: array}` sample; a list of arrays."""
    specs = input_specs(model)
    args = [sample[s.name] for s in specs]
    result = model(args if len(args) > 1 else args[0], training=False)
    return [np.asarray(keras.ops.convert_to_numpy(y)) for y in keras.tree.flatten(result)]


# --------------------------------------------------------------------------
# Sample inputs


def _token_range(model):
    """Smallest vocabulary of the embedding layers in `model` (ids < it)."""
    sizes = []
    for layer in model._flatten_layers(include_self=False):
        for attr in ("vocabulary_size", "input_dim"):
            value = getattr(layer, attr, None)
            if isinstance(value, int) and value > 1:
                sizes.append(value)
    return min(sizes) if sizes else 2


def _max_length(model):
    lengths = [
        layer.sequence_length
        for layer in model._flatten_layers(include_self=False)
        if isinstance(getattr(layer, "sequence_length", None), int)
    ]
    return min(lengths) if lengths else None


DEFAULT_SHAPES = ((2, 7), (3, 4))


def make_samples(model, shapes=DEFAULT_SHAPES, seed=0):
    """Random sample inputs from the model's input specs.

    Each `(batch, length)` in `shapes` gives one `{name: array}` set; dynamic
    non-batch axes get `length` (capped by any learned position table).
    Integer inputs get token ids in `[1, vocab)` with trailing zeros (padding)
    in every other row, so `mask_zero=True` paths are exercised.
    """
    specs = input_specs(model)
    rng = np.random.default_rng(seed)
    vocab = _token_range(model)
    cap = _max_length(model)
    samples = []
    for batch, length in shapes:
        if cap is not None:
            length = min(length, cap)
        sample = {}
        for spec in specs:
            shape = [batch] + [length if d is None else d for d in spec.shape[1:]]
            if "int" in spec.dtype:
                x = rng.integers(1, max(vocab, 2), size=shape)
                if len(shape) >= 2 and shape[1] > 1:
                    for row in range(1, batch, 2):
                        x[row, max(1, shape[1] // 2 + row % 3) :] = 0
                sample[spec.name] = x.astype(spec.dtype)
            elif spec.dtype == "bool":
                sample[spec.name] = rng.random(shape) > 0.3
            else:
                sample[spec.name] = rng.standard_normal(shape).astype(spec.dtype)
        samples.append(sample)
    return samples


def _as_sample_dict(specs, sample, arg_name):
    if isinstance(sample, dict):
        unknown = sorted(set(sample) - {s.name for s in specs})
        missing = [s.name for s in specs if s.name not in sample]
        if unknown or missing:
            raise ValueError(
                f"Received an invalid `{arg_name}`: its keys must be the model's "
                f"input names {[s.name for s in specs]}. Received keys: "
                f"{sorted(sample)} (missing {missing}, unknown {unknown})"
            )
        return {s.name: np.asarray(sample[s.name]) for s in specs}
    if len(specs) == 1 and not isinstance(sample, (list, tuple)):
        return {specs[0].name: np.asarray(sample)}
    if isinstance(sample, (list, tuple)) and len(sample) == len(specs):
        return {s.name: np.asarray(x) for s, x in zip(specs, sample)}
    raise ValueError(
        f"Received an invalid `{arg_name}`: expected an array (single-input "
        f"model), a list of {len(specs)} arrays or a dict keyed by "
        f"{[s.name for s in specs]}. Received: {type(sample).__name__}"
    )


def normalize_samples(model, sample_inputs, arg_name="sample_inputs"):
    """Validates user sample inputs; returns a list of `{name: array}` sets.

    `sample_inputs` is one set (array, list of arrays or dict) or a list of
    dicts (several sets, e.g. two batch sizes). None generates two sets.
    """
    specs = input_specs(model)
    if sample_inputs is None:
        return make_samples(model)
    if (
        isinstance(sample_inputs, (list, tuple))
        and sample_inputs
        and all(isinstance(s, dict) for s in sample_inputs)
    ):
        sets = [_as_sample_dict(specs, s, arg_name) for s in sample_inputs]
    else:
        sets = [_as_sample_dict(specs, sample_inputs, arg_name)]
    for sample in sets:
        for spec in specs:
            x = sample[spec.name]
            ok_rank = x.ndim == len(spec.shape)
            ok_dims = ok_rank and all(
                want is None or got == want for got, want in zip(x.shape, spec.shape)
            )
            if not ok_dims:
                raise ValueError(
                    f"Received an invalid `{arg_name}` for input '{spec.name}': "
                    f"expected shape {spec.shape} (None = any). Received: shape "
                    f"{x.shape}"
                )
            want_int = "int" in spec.dtype
            if want_int != np.issubdtype(x.dtype, np.integer) and spec.dtype != "bool":
                raise ValueError(
                    f"Received an invalid `{arg_name}` for input '{spec.name}': "
                    f"expected dtype {spec.dtype}. Received: dtype {x.dtype}"
                )
            sample[spec.name] = x.astype(spec.dtype)
    return sets


def shapes_of(sample):
    return {k: list(v.shape) for k, v in sample.items()}


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
