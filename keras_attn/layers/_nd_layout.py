"""N-D inputs of `MultiHeadAttention`: an adapter at the edges.

Inputs of rank > 3 (Keras's `attention_axes`, e.g. the `(H, W)` of images)
are folded to the `(batch, seq, heads, size)` case and back, so that the
attention itself is the one of `(batch, seq, features)` inputs. Scores and
masks use Keras's layout `(B, *other, heads, *q_axes, *k_axes)`.
"""

from keras import ops

from keras_attn import checks
from keras_attn.ops import masking


def normalize_attention_axes(attention_axes, input_rank):
    """Keras's rule: None is every axis between batch and features; negative
    axes count from the input's rank."""
    if attention_axes is None:
        return tuple(range(1, input_rank - 1))
    axes = tuple(a if a >= 0 else input_rank + a for a in attention_axes)
    bad = [a for a in axes if not 1 <= a < input_rank - 1]
    if bad or len(set(axes)) != len(axes):
        raise ValueError(
            "Received an invalid value for argument `attention_axes`, expected "
            f"distinct axes between the batch axis and the feature axis of inputs "
            f"of rank {input_rank}. Received: attention_axes={attention_axes!r}"
        )
    return tuple(sorted(axes))


def scores_shape(query_shape, value_shape, attention_axes, num_heads, cache_length=None):
    """Keras's scores layout `(B, *other, heads, *q_axes, *k_axes)`; with a
    cache, `(B, heads, T_q, cache_length)`."""
    rank = len(query_shape)
    axes = normalize_attention_axes(attention_axes, rank)
    other = tuple(query_shape[a] for a in range(1, rank - 1) if a not in axes)
    q_seq = tuple(query_shape[a] for a in axes)
    k_seq = (cache_length,) if value_shape is None else tuple(value_shape[a] for a in axes)
    return (query_shape[0],) + other + (num_heads,) + q_seq + k_seq


def nd_mask(query, value, query_mask, value_mask, key_mask, attention_mask,
            use_causal_mask, sliding_window):
    """Keras's mask for inputs of rank > 3 (or None): padding masks as
    `[..., None]` / `[..., None, :]`, the causal and window masks as
    `(1, T, S)` over the first axis after the batch, ANDed with
    `attention_mask`. `NDLayout.fold_mask` gives it the scores' layout."""
    parts = []
    if query_mask is not None:
        parts.append(ops.expand_dims(masking.as_bool(query_mask), -1))
    for m in (value_mask, key_mask):
        if m is not None:
            parts.append(ops.expand_dims(masking.as_bool(m), -2))
    positional = masking.band(
        ops.arange(ops.shape(query)[1], dtype="int32"),
        ops.arange(ops.shape(value)[1], dtype="int32"),
        is_causal=use_causal_mask, sliding_window=sliding_window,
    )
    if positional is not None:
        parts.append(ops.expand_dims(positional, 0))
    if attention_mask is not None:
        checks.check_mask_dtype("attention_mask", attention_mask)
        parts.append(masking.as_bool(attention_mask))
    return masking.combine_masks(*parts)


def _dims(x, axes):
    shape = ops.shape(x)
    return [x.shape[a] if x.shape[a] is not None else shape[a] for a in axes]


def _product(dims):
    out = 1
    for d in dims:
        out = out * d
    return out


class NDLayout:
    """Folds projected `(B, *spatial, heads, size)` tensors with attention over
    `attention_axes` into `(B', T, heads, size)`: the other spatial axes join
    the batch, the attention axes are flattened into one sequence axis. The
    attention itself is then the one of `(batch, seq, features)` inputs.

    Scores and masks use Keras's layout `(B, *other, heads, *q_axes, *k_axes)`.
    """

    def __init__(self, rank, attention_axes):
        # rank: of the projected tensors; attention_axes: normalized, sorted.
        self.axes = tuple(attention_axes)
        self.other = tuple(a for a in range(1, rank - 2) if a not in self.axes)
        self.perm = (0,) + self.other + self.axes + (rank - 2, rank - 1)
        self.inverse = tuple(self.perm.index(a) for a in range(rank))
        self.scores_rank = 2 + len(self.other) + 2 * len(self.axes)

    def fold(self, x):
        batch = _dims(x, (0,) + self.other)
        seq = _dims(x, self.axes)
        tail = _dims(x, (len(x.shape) - 2, len(x.shape) - 1))
        folded = ops.reshape(ops.transpose(x, self.perm), [_product(batch), _product(seq)] + tail)
        return folded, batch, seq

    def unfold_output(self, y, batch, seq):
        tail = _dims(y, (2, 3))
        return ops.transpose(ops.reshape(y, batch + seq + tail), self.inverse)

    def unfold_scores(self, scores, batch, q_seq, k_seq):
        return ops.reshape(scores, batch + [scores.shape[1]] + q_seq + k_seq)

    def fold_mask(self, mask, batch, q_seq, k_seq):
        """A mask broadcastable to Keras's scores layout, as `(B', H|1, T_q, T_k)`."""
        while len(mask.shape) < self.scores_rank:
            mask = ops.expand_dims(mask, -2 * len(self.axes) - 1)
        heads = mask.shape[len(batch)]
        heads = 1 if heads is None else heads
        mask = ops.broadcast_to(mask, batch + [heads] + q_seq + k_seq)
        return ops.reshape(mask, [_product(batch), heads, _product(q_seq), _product(k_seq)])
