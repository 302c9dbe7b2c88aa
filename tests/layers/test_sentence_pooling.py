"""`SentencePooling` against NumPy written here: each mode over right and left
padding, a row without tokens, prompt exclusion, and bad arguments. (The
converter's tests check it against sentence-transformers itself.)"""

import numpy as np
import pytest

from keras_attn import layers as kal
from tests import tolerance


def numpy_pool(hidden, mask, mode, prompt_length=None):
    """One row at a time, as sentence-transformers' `Pooling.forward` reads it."""
    out = []
    for h, m, p in zip(hidden.astype(np.float64), mask, prompt_length if prompt_length is not None
                       else [0] * len(mask)):
        kept = np.flatnonzero(m)
        first = kept[0] if len(kept) else 0
        if prompt_length is not None:
            kept = kept[kept >= first + p]
        if mode == "cls":
            out.append(h[kept[0]] if len(kept) else h[0])
        elif mode == "lasttoken":
            out.append(h[kept[-1]] if len(kept) else np.zeros(h.shape[1]))
        elif mode == "max":
            out.append(h[kept].max(0))
        elif mode == "weightedmean":
            weights = (np.arange(len(m)) + 1 - first)[kept]
            out.append((h[kept] * weights[:, None]).sum(0) / max(weights.sum(), 1e-9))
        else:
            count = max(len(kept), 1e-9)
            out.append(h[kept].sum(0) / (count if mode == "mean" else np.sqrt(count)))
    return np.stack(out)


HIDDEN = np.random.default_rng(0).normal(size=(4, 6, 5)).astype("float32")
MASK = np.array([[1, 1, 1, 0, 0, 0], [0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0]], "int32")


@pytest.mark.parametrize("mode", ["cls", "lasttoken", "mean", "mean_sqrt_len_tokens", "weightedmean"])
def test_modes_equal_numpy(mode):
    got = np.asarray(kal.SentencePooling(mode)(HIDDEN, MASK))
    tolerance.assert_close(got, numpy_pool(HIDDEN, MASK, mode), terms=6)


def test_max_and_concatenation():
    mask = MASK[:3]  # max over no token is -inf, as the library's
    got = np.asarray(kal.SentencePooling(("max", "mean"))(HIDDEN[:3], mask))
    want = np.concatenate([numpy_pool(HIDDEN[:3], mask, "max"), numpy_pool(HIDDEN[:3], mask, "mean")], -1)
    assert got.shape == (3, 10)
    tolerance.assert_close(got, want, terms=6)


@pytest.mark.parametrize("mode", ["cls", "lasttoken", "mean"])
def test_prompt_length(mode):
    prompt = np.array([1, 2, 0, 0], "int32")
    got = np.asarray(kal.SentencePooling(mode)(HIDDEN, MASK, prompt))
    tolerance.assert_close(got, numpy_pool(HIDDEN, MASK, mode, prompt), terms=6)


def test_bad_modes():
    with pytest.raises(ValueError, match=r"`modes`.*Received: modes='median'"):
        kal.SentencePooling("median")
    with pytest.raises(ValueError, match=r"`modes`.*Received: modes=\(\)"):
        kal.SentencePooling(())
