"""The one rule every export with a direct writer follows.

`writer="auto"` (the default) writes from the Keras weights where the direct
writer covers the model and falls back to the traced writer (tf2onnx, or
TensorFlow's TFLite converter) with a UserWarning naming why; `"direct"`
raises the writer's `NotFusableError` instead; `"traced"` skips the direct
writer. The reports keep naming the tool that wrote the file ("direct",
"tf2onnx", "converter").
"""

import warnings

from keras_attn.checks import check_choice
from keras_attn.export.capabilities import NotFusableError

WRITERS = ("auto", "direct", "traced")
# The previous release's values, accepted for one more with a DeprecationWarning.
OLD_WRITERS = {"tf2onnx": "traced", "converter": "traced", "fused": "direct"}


def check_writer(writer, old=(), stacklevel=4):
    """`writer`, one of `WRITERS`; an `old` value (a key of `OLD_WRITERS`)
    warns and is translated. `stacklevel` names the caller's caller."""
    if writer in old:
        new = OLD_WRITERS[writer]
        warnings.warn(f"writer={writer!r} is deprecated and will be removed in the next release; "
                      f"pass writer={new!r}.", DeprecationWarning, stacklevel=stacklevel)
        return new
    return check_choice("writer", writer, WRITERS)


def direct_or_none(writer, direct, *, what, direct_name, traced_name, warn=True):
    """`(direct(), None)` where the direct writer writes it, else
    `(None, why)`: `why` is None for `writer="traced"` and the
    `NotFusableError`'s text where "auto" falls back (warning, unless
    `warn` is False). For "direct" that error is raised, saying what to pass.

    `what` names the export (the warning's subject), `direct_name` the
    direct writer, `traced_name` the traced one.
    """
    if writer == "traced":
        return None, None
    try:
        return direct(), None
    except NotFusableError as error:
        if writer == "direct":
            raise NotFusableError(
                f"writer='direct': the {direct_name} does not cover this model: {error}. "
                f"Pass writer='auto' to use {traced_name} for it.") from error
        if warn:
            warnings.warn(f"{what} falls back to {traced_name}: the {direct_name} does not cover "
                          f"this model ({error}).", UserWarning, stacklevel=4)
        return None, str(error)
