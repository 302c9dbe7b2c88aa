"""The one rule of `writer=` (keras_attn/export/writers.py): "auto" falls back
with a warning naming why, "direct" raises it, "traced" skips the direct
writer; the previous values warn and are translated."""

import warnings

import pytest

from keras_attn.export import writers
from keras_attn.export.capabilities import NotFusableError

NAMES = dict(what="The export of `m`", direct_name="direct writer", traced_name="the converter")


def _uncovered():
    raise NotFusableError("activation='silu'")


def test_covered_models_take_the_direct_writer_quietly():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for writer in ("auto", "direct"):
            assert writers.direct_or_none(writer, lambda: "written", **NAMES) == ("written", None)
        assert writers.direct_or_none("traced", _uncovered, **NAMES) == (None, None)


def test_auto_falls_back_naming_why_and_direct_raises_it():
    with pytest.warns(UserWarning, match=r"The export of `m` falls back to the converter: the "
                                         r"direct writer does not cover this model \(activation='silu'\)"):
        assert writers.direct_or_none("auto", _uncovered, **NAMES) == (None, "activation='silu'")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert writers.direct_or_none("auto", _uncovered, warn=False, **NAMES) == (None, "activation='silu'")
    with pytest.raises(NotFusableError, match=r"writer='direct'.*activation='silu'.*writer='auto'"):
        writers.direct_or_none("direct", _uncovered, **NAMES)


@pytest.mark.parametrize("old, new", [("tf2onnx", "traced"), ("converter", "traced"), ("fused", "direct")])
def test_previous_values_warn_and_name_the_new_one(old, new):
    with pytest.warns(DeprecationWarning, match=f"writer='{old}' is deprecated.*writer='{new}'") as caught:
        assert writers.check_writer(old, (old,), stacklevel=2) == new
    assert caught[0].filename == __file__


def test_bad_values_are_refused_naming_the_argument_and_the_choices():
    with pytest.raises(ValueError, match=r"`writer`.*\['auto', 'direct', 'traced'\].*writer='onnx'"):
        writers.check_writer("onnx", ("tf2onnx",))
    with pytest.raises(ValueError, match=r"writer='converter'"):  # another export's old value
        writers.check_writer("converter", ("tf2onnx",))
