"""Tolerances that hold on every machine: bounds from float32 arithmetic.

Two float32 evaluations of the same math (another kernel, another summation
order, another oneDNN code path or thread count, a converter's graph) differ
by rounding, and rounding scales with the magnitude of the quantities that
were added, not with the result: a sum of large terms that cancel to ~0 (the
gradient of a key bias, which is exactly zero in exact arithmetic) carries an
error of the size of its terms. So every bound here is

    |got - want| <= ulps * eps32 * scale

with `scale` the magnitude of the terms of the computation (by default the
largest |value| of the compared tensors, or of a group of tensors computed
together, e.g. all weight gradients of one model), and `ulps` a budget of
float32 roundings for that computation (a few per reduction level; reductions
of `n` terms add ~sqrt(n) roundings in practice). The defaults leave a 4x
margin over the worst difference seen under oneDNN on/off, 1 and 2 threads.

Comparisons against a float64 NumPy reference use the same bound: the
reference's own error is negligible, so the budget is the float32 side's.
"""

import os

import numpy as np

# Set to a file path to log `error / bound` of every check (one line each),
# e.g. to see the margin under TF_ENABLE_ONEDNN_OPTS=0 or one thread.
REPORT = os.environ.get("KERAS_ATTN_TOLERANCE_REPORT")

EPS32 = float(np.finfo(np.float32).eps)  # 1.19e-7
EPS16 = float(np.finfo(np.float16).eps)  # 9.8e-4
# bfloat16 keeps 8 significant bits.
EPS_BF16 = 2.0**-7

EPS = {"float32": EPS32, "float16": EPS16, "bfloat16": EPS_BF16}

# The rounding budget of one attention layer or block on the test sizes: a
# projection, a dot product over the head size, a softmax and a weighted sum
# over the keys, an output projection (feature sizes and lengths up to ~64).
LAYER_TERMS = 64


def magnitude(*arrays):
    """Largest |value| over `arrays` (nested lists allowed), at least tiny."""
    flat = [np.abs(np.asarray(a, np.float64)).max() for a in _leaves(arrays) if np.size(a)]
    return max(flat + [np.finfo(np.float32).tiny])


def bound(scale, ulps=64, terms=1, dtype="float32"):
    """`ulps * eps * sqrt(terms) * scale`: the difference two evaluations may show."""
    return ulps * EPS[dtype] * np.sqrt(terms) * scale


def assert_close(got, want, *, scale=None, ulps=64, terms=1, dtype="float32", err_msg=""):
    """`|got - want| <= bound(scale, ulps, terms)` elementwise.

    `scale` defaults to the largest |value| of `got` and `want`; pass the
    magnitude of the inputs or of a group of tensors when the result can be
    much smaller than the terms it was summed from.
    """
    got = np.asarray(got, np.float64)
    want = np.asarray(want, np.float64)
    if want.ndim == 0 or want.shape != got.shape and np.ndim(want) < got.ndim:
        want = np.broadcast_to(want, got.shape)  # e.g. probabilities summing to 1.0
    assert got.shape == want.shape, f"{err_msg}: shapes {got.shape} != {want.shape}"
    if scale is None:
        scale = magnitude(got, want)
    tol = bound(scale, ulps, terms, dtype)
    err = np.abs(got - want)
    worst = float(err.max()) if err.size else 0.0
    assert np.all(np.isfinite(got) == np.isfinite(want)), f"{err_msg}: non-finite values differ"
    if REPORT:
        with open(REPORT, "a") as f:
            f.write(f"{worst / tol if tol else 0.0:.4f}\t{err_msg}\n")
    assert worst <= tol, (
        f"{err_msg}: max |got - want| = {worst:.3g} > {tol:.3g} "
        f"({ulps} ulps x sqrt({terms}) of scale {scale:.3g}, {dtype})"
    )


def assert_all_close(got_list, want_list, *, ulps=64, terms=1, dtype="float32", err_msg=""):
    """`assert_close` on each pair, all against one scale: the largest |value|
    of the whole group (e.g. every weight gradient of a model, which share the
    rounding of the activations and upstream gradients they are summed from)."""
    assert len(got_list) == len(want_list), err_msg
    scale = magnitude(got_list, want_list)
    for i, (g, w) in enumerate(zip(got_list, want_list)):
        assert_close(g, w, scale=scale, ulps=ulps, terms=terms, dtype=dtype, err_msg=f"{err_msg} #{i}")


def _leaves(x):
    if isinstance(x, (list, tuple)):
        for item in x:
            yield from _leaves(item)
    else:
        yield x


def assert_outputs_and_grads(got, want, *, n_out=1, ulps=64, terms=1, dtype="float32", err_msg=""):
    """The first `n_out` tensors (outputs) each against its own magnitude; the
    rest (gradients) against the largest magnitude among them (see
    `assert_all_close`)."""
    assert len(got) == len(want), f"{err_msg}: {len(got)} tensors vs {len(want)}"
    for i in range(n_out):
        assert_close(got[i], want[i], ulps=ulps, terms=terms, dtype=dtype, err_msg=f"{err_msg} output {i}")
    if len(got) > n_out:
        assert_all_close(got[n_out:], want[n_out:], ulps=ulps, terms=terms, dtype=dtype,
                         err_msg=f"{err_msg} gradient")


def export_bound(model, outputs):
    """The exporters' default parity bound (keras_attn/export/bounds.py),
    recomputed from its documented formula: `bound` with 64 ulps and 8
    roundings per weight matrix (variable of rank >= 2) of `model`, at the
    largest |value| of the Keras `outputs` (nested structures allowed)."""
    matrices = sum(1 for w in model.weights if len(w.shape) >= 2)
    flat = [np.asarray(o) for o in _flatten(outputs)]
    return bound(magnitude(*flat), ulps=64, terms=8 * matrices)


def _flatten(x):
    if isinstance(x, dict):
        for value in x.values():
            yield from _flatten(value)
    elif isinstance(x, (list, tuple)):
        for value in x:
            yield from _flatten(value)
    else:
        yield x
