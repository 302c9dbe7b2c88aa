"""The default parity bound of float32 exports: rounding, not a constant.

An exported float32 artifact computes the Keras model's math in another
order (other kernels, fused ops, another summation order), so the two differ
by float32 rounding. Rounding grows with the magnitude of the values and with
the number of roundings the outputs went through: a constant `atol` is too
tight for a deep model whose outputs reach ~10 (EmbeddingGemma-300m's shape:
24 layers, float32 Keras itself 1.7e-4 from a float64 reference) and too
loose for a small model whose outputs are ~1e-3. The default bound is
therefore the one tests/tolerance.py uses between two float32 evaluations:

    ulps * eps32 * sqrt(roundings_per_matmul * weight matrices) * scale

`scale` is the largest |value| of the Keras model's outputs over the sample
sets, `weight matrices` the model's variables of rank >= 2 (each matmul with
its bias, activation and normalization: ~`roundings_per_matmul` sequential
roundings, which add up like a random walk). The defaults leave a margin of
~8x over the largest difference measured at real size (EmbeddingGemma-300m's
and ModernBERT-base's shapes, benchmarks/RESULTS.md) while an export with one
weight off by a relative 1e-3 still fails (tests/export/test_export_bounds.py).
An explicit `atol=` is an absolute bound instead.
"""

import dataclasses
import math

import numpy as np

EPS32 = float(np.finfo(np.float32).eps)


@dataclasses.dataclass(frozen=True)
class Float32Bound:
    """The exporters' default `atol`: resolved per export by `resolve`."""

    ulps: float = 64
    roundings_per_matmul: float = 8

    def resolve(self, model, scale):
        """`(atol, how)`: the bound for `model` whose outputs reach `scale`,
        and how it was derived (for the report and the error message)."""
        matrices = sum(1 for w in model.weights if len(w.shape) >= 2)
        terms = max(1.0, self.roundings_per_matmul * matrices)
        atol = self.ulps * EPS32 * math.sqrt(terms) * scale
        how = (f"float32 rounding: {self.ulps:g} ulps x sqrt({self.roundings_per_matmul:g} "
               f"roundings x {matrices} weight matrices) x the largest |Keras output| "
               f"{scale:.3g}")
        return atol, how


DEFAULT = Float32Bound()
