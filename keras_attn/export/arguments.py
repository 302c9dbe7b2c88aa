"""The exporters' arguments, checked and resolved before anything is written.

Each check raises a ValueError naming the argument and the value received
("Received an invalid value for argument `atol`, ..."). `check_keys` is the
one check of a dict argument's keys (`measure`, `threshold`, and
`export_all`'s `atol` and `min_agreement`); it and `check_choice`,
`check_members` live with every other argument check in `keras_attn.checks`.
"""

import os

from keras_attn.checks import check_choice, check_keys, check_members
from keras_attn.export.quality import MEASURES, auto_measures
from keras_attn.export.report import FORMATS

__all__ = [
    "by_key",
    "check_choice",
    "check_formats",
    "check_keys",
    "check_members",
    "check_name",
    "resolve_atol",
    "resolve_measures",
    "resolve_min_agreement",
    "resolve_quality",
    "resolve_thresholds",
]


def _is_number(value):
    return not isinstance(value, bool) and isinstance(value, (int, float))


def by_key(arg_name, value, keys):
    """`{key: value}` for each of `keys`: `value` itself, or, given a dict by
    key (checked by `check_keys`), its entry (None where it has none)."""
    if isinstance(value, dict):
        check_keys(arg_name, value, keys)
        return {k: value.get(k) for k in keys}
    return {k: value for k in keys}


def check_formats(formats):
    """`formats` must be a non-empty collection of `FORMATS` (not a string)."""
    return check_members("formats", formats, FORMATS)


def check_name(arg_name, value, what):
    """`value` must be a non-empty string usable as one path component."""
    if not isinstance(value, str) or not value or os.sep in value:
        raise ValueError(
            f"Received an invalid value for argument `{arg_name}`, expected a "
            f"non-empty {what} without '{os.sep}'. Received: {arg_name}={value!r}"
        )
    return value


def _resolve_number(arg_name, value, default, in_range, expected):
    if value is None:
        return default
    if not _is_number(value) or not in_range(value):
        raise ValueError(
            f"Received an invalid value for argument `{arg_name}`, expected "
            f"{expected} or None. Received: {arg_name}={value!r}"
        )
    return float(value)


def resolve_atol(atol, default):
    return _resolve_number("atol", atol, default, lambda v: v >= 0, "a non-negative number")


def resolve_min_agreement(min_agreement, default):
    return _resolve_number("min_agreement", min_agreement, default, lambda v: 0 <= v <= 1,
                           "a number in [0, 1]")


def resolve_measures(model, measure):
    """`measure` ("auto", one of MEASURES, or a dict by output name) as `{name: measure}`."""
    auto = auto_measures(model)
    expected = f'"auto", one of {list(MEASURES)}, or a dict {{output name: measure}}'
    if isinstance(measure, dict):
        check_keys("measure", measure, sorted(auto), what="outputs")
        if any(v not in MEASURES + ("auto",) for v in measure.values()):
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
        if not _is_number(value) or not value >= 0:
            raise ValueError(
                f"Received an invalid value for argument `threshold`{where}, expected "
                f"a non-negative number (a minimum for argmax/cosine, a maximum for "
                f"relative_error) or None. Received: threshold={threshold!r}"
            )
        return float(value)

    if isinstance(threshold, dict):
        check_keys("threshold", threshold, sorted(measures), what="outputs")
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


def resolve_quality(model, quantization, measure, threshold, defaults, min_agreement=None):
    """`(measures, thresholds)` that check a quantized export (see
    `quality.MEASURES`), or `(None, None)` for a float32 one, which is
    checked with `atol` and refuses `measure`, `threshold` and
    `min_agreement`. `defaults`: the thresholds by measure."""
    if quantization is None:
        for arg, value, default in (("min_agreement", min_agreement, None),
                                    ("measure", measure, "auto"),
                                    ("threshold", threshold, None)):
            if value != default:
                raise ValueError(
                    f"`{arg}` checks quantized exports; a float32 export is checked "
                    f"with `atol`. Received: quantization=None, {arg}={value!r}"
                )
        return None, None
    min_agreement = resolve_min_agreement(min_agreement, None)
    measures = resolve_measures(model, measure)
    return measures, resolve_thresholds(measures, threshold, defaults, min_agreement)
