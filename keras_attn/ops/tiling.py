"""Block geometry of the blocked attention path (`keras_attn.ops.chunked`).

A `Tiling` splits queries into `q_chunk` blocks and keys into `k_chunk`
blocks (padding the lengths up to multiples), says which key blocks a query
block can see (causal, sliding window) so that the others are skipped, and
builds each block's visibility from positions, so causal and window masks
never exist as `(T_q, T_k)` tensors.
"""

from keras import ops

from keras_attn.ops import masking
from keras_attn.ops.shapes import dim as _dim

_NEG_INF = float("-inf")


def _ceil_div(a, b):
    if isinstance(a, int):
        return -(-a // b)
    return (a + (b - 1)) // b


def _chunk_axis(x, axis, chunk, num_chunks):
    """Splits `axis` of `x` into `(num_chunks, chunk)` and moves `num_chunks` first."""
    shape = [_dim(x, a) for a in range(len(x.shape))]
    new_shape = shape[:axis] + [num_chunks, chunk] + shape[axis + 1 :]
    x = ops.reshape(x, new_shape)
    perm = [axis] + [a for a in range(len(new_shape)) if a != axis]
    return ops.transpose(x, perm)


def to_5d(x, num_heads, num_kv_heads):
    """`(B|1, H|1, T_q|1, T_k|1)` -> `(B|1, H_kv|1, G|1, T_q|1, T_k|1)`."""
    h = x.shape[1]
    if h == 1:
        return x[:, :, None]
    if h != num_heads:
        raise ValueError(
            "A mask or bias must have 1 or num_heads entries on its head axis. "
            f"Received shape {tuple(x.shape)} with num_heads={num_heads}"
        )
    shape = [_dim(x, 0), num_kv_heads, num_heads // num_kv_heads, _dim(x, 2), _dim(x, 3)]
    return ops.reshape(x, shape)


class _Blocked:
    """A rank-5 mask or bias, pre-split into query and key blocks.

    Axes of length 1 stay broadcast (and are never tiled); `block(i, j)`
    returns the `(B|1, H_kv|1, G|1, q_chunk|1, k_chunk|1)` block.
    """

    def __init__(self, x, nq, nk, q_chunk, k_chunk, fill):
        t_q_pad, t_k_pad = nq * q_chunk, nk * k_chunk
        self.q_full = x.shape[3] != 1
        self.k_full = x.shape[4] != 1
        self.full_shape = x.shape
        if self.q_full:
            x = _pad_axis_fill(x, 3, t_q_pad, fill)
            x = _chunk_axis(x, 3, q_chunk, nq)
        else:
            x = x[None]
        if self.k_full:
            # Key axis is now 5 (after the leading query-block axis).
            x = _pad_axis_fill(x, 5, t_k_pad, fill)
            x = _chunk_axis(x, 5, k_chunk, nk)
            x = ops.transpose(x, (1, 0, 2, 3, 4, 5, 6))
        else:
            x = x[:, None]
        # (nq|1, nk|1, B|1, H_kv|1, G|1, q_chunk|1, k_chunk|1)
        self.blocks = x

    def block(self, i, j):
        x = ops.take(self.blocks, i if self.q_full else 0, axis=0)
        return ops.take(x, j if self.k_full else 0, axis=0)


def _pad_axis_fill(x, axis, target, fill):
    length = _dim(x, axis)
    if isinstance(length, int) and isinstance(target, int) and length == target:
        return x
    shape = [_dim(x, a) for a in range(len(x.shape))]
    shape[axis] = target - length
    pad = ops.full(shape, fill, dtype=x.dtype)
    return ops.concatenate([x, pad], axis=axis)


class Tiling:
    """The block geometry of one pass: block sizes, splitting and visibility.

    The forward and backward passes each have one (see `BACKWARD_MAX_CHUNK`);
    they share nothing but the unblocked tensors `q`, `k`, `v`, the output
    and the row log-sum-exp, so their block sizes may differ.
    """

    def __init__(self, chunks, *, batch, t_q, t_k, num_heads, num_kv_heads,
                 is_causal, window, start, mask5):
        q_chunk, k_chunk = chunks
        # Small inputs: never use blocks bigger than the (rounded-up) sequence.
        if isinstance(t_q, int):
            q_chunk = min(q_chunk, max(t_q, 1))
        if isinstance(t_k, int):
            k_chunk = min(k_chunk, max(t_k, 1))
        self.q_chunk, self.k_chunk = q_chunk, k_chunk
        self.batch, self.t_q, self.t_k = batch, t_q, t_k
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.groups = num_heads // num_kv_heads
        self.is_causal, self.window, self.start = is_causal, window, start
        self.nq, self.nk = _ceil_div(t_q, q_chunk), _ceil_div(t_k, k_chunk)
        self.t_q_pad, self.t_k_pad = self.nq * q_chunk, self.nk * k_chunk
        self.needs_key_bound = not (isinstance(t_k, int) and t_k == self.t_k_pad)
        self.q_offsets = ops.arange(q_chunk, dtype="int32")
        self.k_offsets = ops.arange(k_chunk, dtype="int32")
        self.mask_blocks = None
        if mask5 is not None:
            self.mask_blocks = _Blocked(mask5, self.nq, self.nk, q_chunk, k_chunk, False)

    @property
    def chunks(self):
        """`(q_chunk, k_chunk)` after clamping to the sequence lengths."""
        return (self.q_chunk, self.k_chunk)

    def blocked_bias(self, bias5):
        if bias5 is None:
            return None
        return _Blocked(bias5, self.nq, self.nk, self.q_chunk, self.k_chunk, 0.0)

    def split_q(self, x, fill=0.0):
        """`(B, T_q, H, X)` -> `(nq, B, H_kv, G, q_chunk, X)`, padded with `fill`."""
        x = _pad_axis_fill(x, 1, self.t_q_pad, fill)
        x = ops.reshape(
            x, (self.batch, self.nq, self.q_chunk, self.num_kv_heads, self.groups, x.shape[-1])
        )
        return ops.transpose(x, (1, 0, 3, 4, 2, 5))

    def merge_q(self, x):
        """`(nq, B, H_kv, G, q_chunk, X)` -> `(B, T_q, H, X)`."""
        x = ops.transpose(x, (1, 0, 4, 2, 3, 5))
        x = ops.reshape(x, (self.batch, self.t_q_pad, self.num_heads, x.shape[-1]))
        return x[:, : self.t_q]

    def split_k(self, x):
        """`(B, T_k, H_kv, X)` -> `(nk, B, H_kv, k_chunk, X)`, zero-padded."""
        x = _pad_axis_fill(x, 1, self.t_k_pad, 0.0)
        x = ops.reshape(x, (self.batch, self.nk, self.k_chunk, self.num_kv_heads, x.shape[-1]))
        return ops.transpose(x, (1, 0, 3, 2, 4))

    def merge_k(self, x):
        """`(nk, B, H_kv, k_chunk, X)` -> `(B, T_k, H_kv, X)`."""
        x = ops.transpose(x, (1, 0, 3, 2, 4))
        x = ops.reshape(x, (self.batch, self.t_k_pad, self.num_kv_heads, x.shape[-1]))
        return x[:, : self.t_k]

    def key_range(self, i):
        """Key blocks `[lo, hi)` that query block `i` can see."""
        lo = ops.convert_to_tensor(0, "int32")
        hi = ops.convert_to_tensor(self.nk, "int32")
        last_q = i * self.q_chunk + (self.q_chunk - 1) + self.start
        if self.is_causal:
            hi = ops.clip(last_q // self.k_chunk + 1, 0, self.nk)
        elif self.window is not None:
            hi = ops.clip((last_q + self.window - 1) // self.k_chunk + 1, 0, self.nk)
        if self.window is not None:
            first_q = i * self.q_chunk + self.start
            lo = ops.clip((first_q - self.window + 1) // self.k_chunk, 0, self.nk)
        return lo, ops.maximum(lo, hi)

    def query_range(self, j):
        """Query blocks `[lo, hi)` that can see key block `j`."""
        lo = ops.convert_to_tensor(0, "int32")
        hi = ops.convert_to_tensor(self.nq, "int32")
        first_k = j * self.k_chunk
        if self.is_causal:
            lo = ops.clip((first_k - self.start) // self.q_chunk, 0, self.nq)
        elif self.window is not None:
            lo = ops.clip((first_k - self.window + 1 - self.start) // self.q_chunk, 0, self.nq)
        if self.window is not None:
            last_k = first_k + self.k_chunk - 1
            hi = ops.clip((last_k + self.window - 1 - self.start) // self.q_chunk + 1, 0, self.nq)
        return lo, ops.maximum(lo, hi)

    def visible(self, i, j):
        """Boolean `(B|1, H_kv|1, G|1, q_chunk, k_chunk)` block mask, or None."""
        result = None
        positional = self.is_causal or self.window is not None
        if positional or self.needs_key_bound:
            k_pos = j * self.k_chunk + self.k_offsets
            if self.needs_key_bound:
                result = masking.expand_bool(ops.less(k_pos, self.t_k), 0)
            if positional:
                q_pos = i * self.q_chunk + self.q_offsets + self.start
                near = masking.band(q_pos, k_pos, is_causal=self.is_causal,
                                    sliding_window=self.window)
                result = near if result is None else ops.logical_and(result, near)
            result = masking.expand_bool(result, (0, 1, 2))
        if self.mask_blocks is not None:
            blk = self.mask_blocks.block(i, j)
            result = blk if result is None else ops.logical_and(result, blk)
        return result

    def logits(self, q_i, k_j, i, j, bias_blocks):
        """Masked logits block `(B, H_kv, G, q_chunk, k_chunk)`; q is already scaled."""
        s = ops.einsum("bngqd,bnkd->bngqk", q_i, k_j)
        if bias_blocks is not None:
            s = s + bias_blocks.block(i, j)
        vis = self.visible(i, j)
        if vis is not None:
            s = ops.where(vis, s, _NEG_INF)
        return s
