"""Recording attention probabilities as a model runs (for `keras_attn.visualize`).

`MultiHeadAttention` asks `active()` on every call; only inside
`with recording() as records:` does it compute its probabilities (even when
the caller did not ask for them) and append `(layer, scores, mask)` to
`records`. Outside a recording nothing changes: no extra work, the same
graphs, the same exports. Recording is per thread and nests (the inner one
gets the calls).
"""

import contextlib
import threading

_state = threading.local()


def active():
    """True inside `recording()` on this thread."""
    return getattr(_state, "records", None) is not None


def add(layer, scores, mask):
    """Appends one attention call's `(layer, scores, mask)` to the active recording."""
    _state.records.append((layer, scores, mask))


@contextlib.contextmanager
def recording():
    """Collects `(layer, scores, mask)` of every attention call in the block."""
    previous = getattr(_state, "records", None)
    _state.records = []
    try:
        yield _state.records
    finally:
        _state.records = previous
