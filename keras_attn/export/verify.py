"""Running an exported artifact against the Keras model.

`verify_artifact` runs the artifact on every sample set, compares each output
with Keras's (`compare`; for a quantized export, also each output's quality
measure, see `keras_attn.export.quality`) and raises `ParityError` when the
artifact is not close enough. Each exporter calls it inside
`staging.staged`, so a failed check never leaves the artifact behind.

The names this module held before the report, the quality measures, the staged
writes and the argument checks got their own modules still resolve here, with
a DeprecationWarning, for one release (`_MOVED`).
"""

import importlib
import warnings

import numpy as np

from keras_attn.export import bounds, report
from keras_attn.export import quality as quality_lib
from keras_attn.export.samples import keras_outputs, output_names, shapes_of


def compare(reference, got, names, where):
    """Max abs error between two lists of output arrays (shapes must agree)."""
    if len(reference) != len(got):
        raise report.ParityError(
            f"{where}: the artifact has {len(got)} outputs, the Keras model "
            f"{len(reference)} ({names})"
        )
    worst = 0.0
    for name, ref, out in zip(names, reference, got):
        out = np.asarray(out)
        if ref.shape != out.shape:
            raise report.ParityError(
                f"{where}: output '{name}' has shape {out.shape}, Keras gives {ref.shape}"
            )
        if ref.size:
            err = float(np.max(np.abs(out.astype("float64") - ref.astype("float64"))))
            if not np.isfinite(err):
                err = float("inf")
            worst = max(worst, err)
    return worst


def verify_artifact(fmt, model, samples, run, atol, path, measures=None, thresholds=None):
    """Runs the artifact (`run(sample) -> [outputs]`) on every sample set against Keras.

    Returns the checks: one `{"shapes", "max_abs_error", "argmax_matches"}`
    entry per sample set (what `report.make_report` reports). Raises
    ParityError beyond `atol`: a number (an absolute bound), a
    `bounds.Float32Bound` (the exporters' default: resolved from the
    magnitude of the Keras outputs and the model's size, and then recorded
    in every check as `"atol"` and `"atol_from"`), or None (not checked).

    Given `measures` (`{output name: measure}`, see `quality.MEASURES`) and
    their `thresholds`, each check also holds `"quality"` stats per output,
    and `quality_of(checks, measures, thresholds)` is checked by
    `check_quality`: ParityError when an output is worse than its threshold.
    """
    names = output_names(model)
    checks = []
    scale = float(np.finfo(np.float32).tiny)
    for sample in samples:
        reference, got = keras_outputs(model, sample), run(sample)
        scale = max([scale] + [float(np.max(np.abs(np.asarray(r, np.float64))))
                               for r in reference if np.size(r)])
        err = compare(reference, got, names, fmt)
        check = {"shapes": shapes_of(sample), "max_abs_error": err,
                 "argmax_matches": list(quality_lib.argmax_matches(reference, got))}
        if measures is not None:
            check["quality"] = {
                name: quality_lib.quality_stats(measures[name], ref, out,
                                                quality_lib.padding_rows(sample, ref))
                for name, ref, out in zip(names, reference, got) if name in measures}
            check["argmax_matches"] = [sum(check["quality"][n][k] for n in measures
                                           if measures[n] == "argmax")
                                       for k in ("matched", "total")]
        checks.append(check)
    how = None
    if isinstance(atol, bounds.Float32Bound):
        atol, how = atol.resolve(model, scale)
        for check in checks:
            check.update(atol=atol, atol_from=how)
    if atol is not None:
        check_parity(fmt, checks, atol, path, how)
    if measures is not None:
        worst = max(c["max_abs_error"] for c in checks)
        check_quality(fmt, quality_lib.quality_of(checks, measures, thresholds), worst, path)
    return checks


def check_unmeasured(fmt, checks, atol, measures, quantization, path):
    """A quantized export with no float output to measure (`measures == {}`)
    and no `atol` given is held to `quality.FALLBACK_ATOL[quantization]`;
    returns the `atol` that was checked (None: none)."""
    if measures == {} and atol is None:
        atol = quality_lib.FALLBACK_ATOL[quantization]
        check_parity(fmt, checks, atol, path)
    return atol


def check_parity(fmt, checks, atol, path, how=None):
    """ParityError when an output differs by more than `atol`; `how` says how
    a default bound was derived (None: `atol` was given)."""
    worst = max(c["max_abs_error"] for c in checks)
    if not worst <= atol:
        where = ("the default bound of " + how if how is not None
                 else "the absolute bound given")
        shown = [{k: v for k, v in c.items() if k not in ("atol", "atol_from")} for c in checks]
        raise report.ParityError(
            f"The {fmt} export does not match the Keras model: max |export - keras| "
            f"= {worst:.3g} > atol={atol:.3g} ({where}; {shown}). Nothing was written to "
            f"{path}. Pass `atol=` (an absolute bound) if this error is expected "
            "(quantisation, or float32 rounding in a model the default bound underrates)."
        )


# What a quantized export that fails its measure can do instead, by format.
LIGHTER = {
    "TFLite": "calibrate on real inputs, or use a lighter quantization "
              "(int16x8 / dynamic / float16 / none)",
    "ONNX": "or export in float32 (quantization=None)",
}


def check_quality(fmt, quality, worst, path):
    failed = {name: q for name, q in quality.items() if not quality_lib.quality_passes(q)}
    if failed:
        what = "; ".join(
            quality_lib.quality_text(name, q).replace(">=", "<").replace("<=", ">")
            for name, q in failed.items())
        raise report.ParityError(
            f"The {fmt} export does not give the Keras model's answers: {what} "
            f"(max |export - keras| = {worst:.3g}). Nothing was written to {path}. "
            "Pass a lower `threshold` (or `measure=` another measure) if this loss "
            f"is acceptable, {LIGHTER.get(fmt, LIGHTER['TFLite'])}."
        )


_MOVED = {
    **dict.fromkeys(("FORMATS", "ExportError", "ExportReport", "ParityError",
                     "UnsupportedOpsError"), "report"),
    **dict.fromkeys(("MEASURES", "agreement_of", "argmax_matches", "auto_measures",
                     "merge_quality", "padding_rows", "quality_of", "quality_passes",
                     "quality_stats", "quality_text"), "quality"),
    **dict.fromkeys(("size_of", "staged"), "staging"),
    **dict.fromkeys(("check_formats", "check_name", "resolve_atol", "resolve_measures",
                     "resolve_min_agreement", "resolve_thresholds"), "arguments"),
}


def __getattr__(name):
    module = _MOVED.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(
        f"keras_attn.export.verify.{name} is now keras_attn.export.{module}.{name}; "
        "the old path will be removed in the next release.",
        DeprecationWarning,
        stacklevel=2,
    )
    return getattr(importlib.import_module(f"keras_attn.export.{module}"), name)
