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
        quality: for quantized exports, one entry per checked output:
            `{"measure", "value", "mean", "threshold"}` (see `MEASURES`):
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
            parts.extend(quality_text(name, q) for name, q in self.quality.items())
        elif self.agreement is not None:
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
        m, t = _argmax_counts(ref, out)
        matched, total = matched + m, total + t
    return matched, total


def _argmax_counts(ref, out):
    ref, out = np.asarray(ref), np.asarray(out)
    if ref.ndim < 1 or ref.shape[-1] < 2 or not np.issubdtype(ref.dtype, np.floating):
        return 0, 0
    same = np.argmax(ref, axis=-1) == np.argmax(out, axis=-1)
    return int(same.sum()), int(same.size)


# --------------------------------------------------------------------------
# Quality measures of a quantized export, one per output

MEASURES = ("argmax", "cosine", "relative_error")
"""How a quantized export's output is compared with Keras's.

- "argmax": the fraction of rows (every position of the last axis' leading
  axes) whose argmax equals Keras's: top-1 class, next token. Higher is
  better; checked as a minimum.
- "cosine": the cosine similarity of each row (a vector along the last
  axis: one token's hidden state, one sentence embedding) to Keras's;
  `value` is the smallest row's, `mean` the average. Higher is better;
  checked as a minimum. Rows that are zero in both are skipped.
- "relative_error": `||export - keras|| / ||keras||` over each sample set;
  `value` is the largest. Lower is better; checked as a maximum.

Rows at padded positions (zeros of an input named like "attention_mask",
see `padding_rows`) are left out of every measure.
"""

# Output names that say the last axis indexes classes or tokens.
_SCORE_NAME_PARTS = ("logit", "score", "prob", "class", "label")


def _output_layers(model):
    """The layer producing each model output, seen through pass-through layers."""
    layers = []
    for tensor in model.outputs:
        layer = tensor._keras_history.operation
        while type(layer).__name__ in ("Identity", "Dropout"):
            nodes = getattr(layer, "_inbound_nodes", None) or []
            inbound = nodes[0].input_tensors if nodes else []
            if len(inbound) != 1:
                break
            layer = inbound[0]._keras_history.operation
        layers.append(layer)
    return layers


def _is_softmax(layer):
    if type(layer).__name__ == "Softmax":
        return True
    activation = getattr(layer, "activation", None)
    return getattr(activation, "__name__", None) in ("softmax", "log_softmax")


def _vocabulary_sizes(model):
    """Vocabulary sizes of the model's embeddings, less any embedding width
    (a hidden state as wide as a vocabulary is still a hidden state)."""
    layers = list(model._flatten_layers(include_self=False))
    sizes = {getattr(layer, attr) for layer in layers
             for attr in ("input_dim", "vocabulary_size")
             if isinstance(getattr(layer, attr, None), int)
             and (attr == "vocabulary_size" or "Embedding" in type(layer).__name__)}
    widths = {getattr(layer, attr) for layer in layers
              for attr in ("output_dim", "embedding_dim")
              if "Embedding" in type(layer).__name__
              and isinstance(getattr(layer, attr, None), int)}
    return sizes - widths


def auto_measures(model):
    """The measure "auto" picks for each float output: `{name: measure}`.

    "argmax" when the last axis indexes classes or tokens: the output's name
    contains logit/score/prob/class/label, it comes out of a softmax, or its
    last axis is the size of one of the model's vocabularies (an LM head);
    "cosine" for other vectors (last axis > 1: embeddings, hidden states);
    "relative_error" for the rest (one number per row, scalars).
    """
    names = output_names(model)
    vocab = _vocabulary_sizes(model)
    measures = {}
    for name, tensor, layer in zip(names, model.outputs, _output_layers(model)):
        if "float" not in str(tensor.dtype):
            continue
        last = tensor.shape[-1] if len(tensor.shape) else None
        if last is not None and last > 1 and (
                any(part in name.lower() for part in _SCORE_NAME_PARTS)
                or _is_softmax(layer) or last in vocab):
            measures[name] = "argmax"
        elif last is None or last > 1:
            measures[name] = "cosine"
        else:
            measures[name] = "relative_error"
    return measures


def resolve_measures(model, measure):
    """`measure` ("auto", one of MEASURES, or a dict by output name) as `{name: measure}`."""
    auto = auto_measures(model)
    expected = f'"auto", one of {list(MEASURES)}, or a dict {{output name: measure}}'
    if isinstance(measure, dict):
        unknown = sorted(set(measure) - set(auto))
        bad = {k: v for k, v in measure.items() if v not in MEASURES + ("auto",)}
        if unknown or bad:
            raise ValueError(
                f"Received an invalid value for argument `measure`, expected {expected}; "
                f"the float outputs are {sorted(auto)}. Received: measure={measure!r}"
            )
        return {name: auto[name] if measure.get(name, "auto") == "auto" else measure[name]
                for name in auto}
    if measure == "auto":
        return auto
    if measure not in MEASURES:
        raise ValueError(
            f"Received an invalid value for argument `measure`, expected {expected}. "
            f"Received: measure={measure!r}"
        )
    return {name: measure for name in auto}


def resolve_thresholds(measures, threshold, defaults, min_agreement=None):
    """The threshold of each output: `threshold` (a number, or a dict by output
    name), else `min_agreement` for argmax outputs, else `defaults[measure]`."""
    def check(value, where):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
            raise ValueError(
                f"Received an invalid value for argument `threshold`{where}, expected "
                f"a non-negative number (a minimum for argmax/cosine, a maximum for "
                f"relative_error) or None. Received: threshold={threshold!r}"
            )
        return float(value)

    if isinstance(threshold, dict):
        unknown = sorted(set(threshold) - set(measures))
        if unknown:
            raise ValueError(
                f"Received an invalid value for argument `threshold`: unknown outputs "
                f"{unknown}; expected some of {sorted(measures)}. Received: "
                f"threshold={threshold!r}"
            )
        given = {k: None if v is None else check(v, f" for output '{k}'")
                 for k, v in threshold.items()}
    elif threshold is not None:
        given = {name: check(threshold, "") for name in measures}
    else:
        given = {}
    out = {}
    for name, measure in measures.items():
        if given.get(name) is not None:
            out[name] = given[name]
        elif measure == "argmax" and min_agreement is not None:
            out[name] = min_agreement
        else:
            out[name] = defaults.get(measure)
        if measure in ("argmax", "cosine") and out[name] is not None and out[name] > 1:
            raise ValueError(
                f"Received an invalid value for argument `threshold` for output '{name}': "
                f"a {measure} threshold is a minimum in [0, 1]. Received: "
                f"threshold={threshold!r}"
            )
    return out


def padding_rows(sample, ref):
    """Which rows of a `(batch, length, d)` output are real tokens, or None.

    Taken from an input whose name contains "mask" with shape `(batch,
    length)` (a Hugging Face `attention_mask`): its zeros are padding, whose
    hidden states nothing reads, so no measure counts them.
    """
    ref = np.asarray(ref)
    if ref.ndim != 3:
        return None
    for name, x in sample.items():
        x = np.asarray(x)
        if "mask" in name.lower() and x.shape == ref.shape[:2]:
            return x != 0
    return None


def _cosine_rows(ref, out, keep_rows=None):
    ref = np.asarray(ref, np.float64).reshape(-1, max(np.shape(ref)[-1:] or [1]))
    out = np.asarray(out, np.float64).reshape(ref.shape)
    nr, no = np.linalg.norm(ref, axis=-1), np.linalg.norm(out, axis=-1)
    keep = (nr > 0) | (no > 0)
    if keep_rows is not None:
        keep &= np.asarray(keep_rows).reshape(-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        cos = np.sum(ref * out, axis=-1) / (nr * no)
    cos = np.where(np.isfinite(cos), cos, 0.0)  # one side zero (or nan): no agreement
    return cos[keep]


def quality_stats(measure, ref, out, keep_rows=None):
    """One sample set's figures for one output: a dict merged by `merge_quality`.

    `keep_rows`: a boolean `(batch, length)` array of the rows to count (see
    `padding_rows`), or None for all.
    """
    if keep_rows is not None:
        keep = np.asarray(keep_rows)[..., None]
        ref, out = np.where(keep, ref, 0), np.where(keep, out, 0)
    if measure == "argmax":
        if keep_rows is not None:
            ref, out = np.asarray(ref)[keep_rows], np.asarray(out)[keep_rows]
        matched, total = _argmax_counts(ref, out)
        return {"matched": matched, "total": total}
    if measure == "cosine":
        cos = _cosine_rows(ref, out, keep_rows)
        return {"min": float(cos.min()) if cos.size else 1.0,
                "sum": float(cos.sum()), "rows": int(cos.size)}
    ref = np.asarray(ref, np.float64)
    diff = np.linalg.norm(np.asarray(out, np.float64) - ref)
    norm = np.linalg.norm(ref)
    err = float(diff / norm) if norm > 0 else (0.0 if diff == 0 else float("inf"))
    return {"max": err if np.isfinite(err) else float("inf"), "sum": err, "sets": 1}


def merge_quality(measure, stats, threshold):
    """`{"measure", "value", "mean", "threshold"}` of one output over every sample set."""
    if measure == "argmax":
        matched = sum(s["matched"] for s in stats)
        total = sum(s["total"] for s in stats)
        value = matched / total if total else None
        mean = value
    elif measure == "cosine":
        rows = sum(s["rows"] for s in stats)
        value = min(s["min"] for s in stats)
        mean = sum(s["sum"] for s in stats) / rows if rows else 1.0
    else:
        value = max(s["max"] for s in stats)
        mean = sum(s["sum"] for s in stats) / len(stats)
    return {"measure": measure, "value": value, "mean": mean, "threshold": threshold}


def quality_passes(q):
    if q["threshold"] is None or q["value"] is None:
        return True
    if q["measure"] == "relative_error":
        return q["value"] <= q["threshold"]
    return q["value"] >= q["threshold"]


def quality_text(name, q):
    """`last_hidden_state: cosine min 0.9968 (mean 0.9986) >= 0.99`."""
    if q["value"] is None:
        return f"{name}: {q['measure']} (no rows)"
    label = {"argmax": "argmax agreement", "cosine": "cosine min",
             "relative_error": "relative error"}[q["measure"]]
    text = f"{name}: {label} {q['value']:.4f}"
    if q["measure"] == "cosine":
        text += f" (mean {q['mean']:.4f})"
    if q["threshold"] is not None:
        text += f" {'<=' if q['measure'] == 'relative_error' else '>='} {q['threshold']:g}"
    return text


def verify_artifact(fmt, model, samples, run, atol, path, min_agreement=None,
                    measures=None, thresholds=None):
    """Runs the artifact (`run(sample) -> [outputs]`) on every sample set against Keras.

    Returns `(checks, worst)`: one `{"shapes", "max_abs_error", "argmax_matches"}`
    entry per sample set and the largest error. Raises ParityError beyond
    `atol` (None: not checked) or, given `min_agreement`, when the fraction of
    argmax positions equal to Keras's is below it (see `agreement_of`).

    Given `measures` (`{output name: measure}`, see `MEASURES`) and their
    `thresholds`, each check also holds `"quality"` stats per output, and
    `quality_of(checks, measures, thresholds)` is checked by `check_quality`
    (instead of `min_agreement`).
    """
    names = output_names(model)
    checks = []
    for sample in samples:
        reference, got = keras_outputs(model, sample), run(sample)
        err = compare(reference, got, names, fmt)
        check = {"shapes": shapes_of(sample), "max_abs_error": err,
                 "argmax_matches": list(argmax_matches(reference, got))}
        if measures is not None:
            check["quality"] = {
                name: quality_stats(measures[name], ref, out, padding_rows(sample, ref))
                for name, ref, out in zip(names, reference, got) if name in measures}
            check["argmax_matches"] = [sum(check["quality"][n][k] for n in measures
                                           if measures[n] == "argmax")
                                       for k in ("matched", "total")]
        checks.append(check)
    worst = max(c["max_abs_error"] for c in checks)
    if atol is not None:
        check_parity(fmt, checks, atol, path)
    if measures is not None:
        check_quality(fmt, quality_of(checks, measures, thresholds), worst, path)
    elif min_agreement is not None:
        check_agreement(fmt, checks, worst, min_agreement, path)
    return checks, worst


def quality_of(checks, measures, thresholds):
    """`{output name: {"measure", "value", "mean", "threshold"}}` over `checks`."""
    return {name: merge_quality(measure, [c["quality"][name] for c in checks],
                                thresholds.get(name))
            for name, measure in measures.items()}


def check_quality(fmt, quality, worst, path):
    failed = {name: q for name, q in quality.items() if not quality_passes(q)}
    if failed:
        what = "; ".join(quality_text(name, q).replace(">=", "<").replace("<=", ">")
                         for name, q in failed.items())
        raise ParityError(
            f"The {fmt} export does not give the Keras model's answers: {what} "
            f"(max |export - keras| = {worst:.3g}). Nothing was written to {path}. "
            "Pass a lower `threshold` (or `measure=` another measure) if this loss "
            "is acceptable, calibrate on real inputs, or use a lighter "
            "quantization (int16x8 / dynamic / float16 / none)."
        )
    return quality


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
