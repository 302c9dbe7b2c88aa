"""Memory-efficient exact attention, blocked over queries and keys.

The softmax is computed block by block with a running maximum and a running
sum (Rabe & Staats, 2021, "Self-attention does not need O(n^2) memory";
Dao et al., 2022, FlashAttention), so no `(T_q, T_k)` tensor is ever
materialised: the largest temporaries are `(B, H, q_chunk, k_chunk)` score
blocks. The backward pass is a custom gradient that recomputes the score
blocks from `q`, `k`, `v`, the output and the per-row log-sum-exp (the
FlashAttention backward), so training does not store `T^2` activations
either.

Everything here is `keras.ops` (`custom_gradient`, `map`, `fori_loop`,
`take`, `slice_update`), so it runs on the TensorFlow and JAX backends; the
PyTorch backend has no `keras.ops.custom_gradient` and is not supported. On
TensorFlow the loops run one iteration at a time
(`keras_attn.ops.tf_kernels.loop` / `sequential_map`), which bounds the memory.

Causal and sliding-window masks are built per block from positions, and key
blocks that no query of a block can see are skipped, so a sliding window
costs `O(T W)` time and `O(T)` memory.

Layout inside this module: queries `(nq, B, H_kv, G, q_chunk, D)` with `G`
query heads per key/value head (grouped-query attention without repeating
keys or values), keys and values `(nk, B, H_kv, k_chunk, D)`.
"""

import math

from keras import ops

from keras_attn.ops import dispatch
from keras_attn.ops import masking
from keras_attn.ops.shapes import dim as _dim
from keras_attn.ops.tf_kernels import loop as _loop
from keras_attn.ops.tf_kernels import sequential_map as _map

DEFAULT_CHUNK_SIZE = dispatch.DEFAULT_CHUNK_SIZE

BACKWARD_MAX_CHUNK = 512
"""Largest block the backward pass uses on either axis. Its blocks are
independent of the forward's (it recomputes them from q, k, v, the output and
the row log-sum-exp), and it is fastest with smaller blocks than the forward
(benchmarks/README.md)."""

_NEG_INF = float("-inf")
_POS_INF = float("inf")
_LOWEST = -3.4028234663852886e38  # the lowest finite float32


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


def _to_5d(x, num_heads, num_kv_heads):
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


class _Tiling:
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
                result = ops.less(k_pos, self.t_k)[None, :]
            if positional:
                q_pos = i * self.q_chunk + self.q_offsets + self.start
                diff = q_pos[:, None] - k_pos[None, :]
                if self.is_causal:
                    near = ops.greater_equal(diff, 0)
                    if self.window is not None:
                        near = ops.logical_and(near, ops.less(diff, self.window))
                else:
                    near = ops.less(ops.abs(diff), self.window)
                result = near if result is None else ops.logical_and(result, near)
            result = result[None, None, None]
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


def _forward(tiling, q_s, k, v, bias5):
    """Blocked forward: `(B, T_q, H, D_v)` output and `(B, T_q, H, 1)` row log-sum-exp."""
    q_c, k_c, v_c = tiling.split_q(q_s), tiling.split_k(k), tiling.split_k(v)
    bias_blocks = tiling.blocked_bias(bias5)
    row_shape = (tiling.batch, tiling.num_kv_heads, tiling.groups, tiling.q_chunk)
    d_v = v.shape[-1]

    def one_query_block(i):
        q_i = ops.take(q_c, i, axis=0)
        m0 = ops.full(row_shape, _NEG_INF, dtype="float32")
        l0 = ops.zeros(row_shape, dtype="float32")
        acc0 = ops.zeros(row_shape + (d_v,), dtype="float32")

        def body(j, carry):
            m, l, acc = carry
            s = tiling.logits(q_i, ops.take(k_c, j, axis=0), i, j, bias_blocks)
            # (`initial`: Keras' eager `max` refuses empty tensors, e.g. batch 0.)
            m_new = ops.maximum(m, ops.max(s, axis=-1, initial=_NEG_INF))
            # Rows with nothing visible yet keep m = -inf: shift by 0.
            # (`greater` rather than `isfinite`, which TFLite has no builtin
            # for.) Both branches are finite: tf2onnx turns a float `where`
            # into `c * a + (1 - c) * b`, and 0 * -inf would be NaN. (A
            # plain `maximum(m_new, lowest float)` is not the same in TFLite:
            # its fully masked rows then came out as uniform weights.)
            m_safe = ops.where(ops.greater(m_new, _NEG_INF), ops.maximum(m_new, _LOWEST), 0.0)
            p = ops.exp(s - m_safe[..., None])
            alpha = ops.exp(m - m_safe)
            l = l * alpha + ops.sum(p, axis=-1)
            acc = acc * alpha[..., None] + ops.einsum(
                "bngqk,bnkd->bngqd", p, ops.take(v_c, j, axis=0)
            )
            return m_new, l, acc

        lo, hi = tiling.key_range(i)
        m, l, acc = _loop(lo, hi, body, (m0, l0, acc0))
        seen = ops.greater(l, 0.0)
        out = acc / ops.where(seen, l, 1.0)[..., None]
        lse = ops.where(seen, m + ops.log(ops.where(seen, l, 1.0)), _POS_INF)
        return out, lse

    out_c, lse_c = _map(one_query_block, tiling.nq, tiling.batch)
    return tiling.merge_q(out_c), tiling.merge_q(lse_c[..., None])


def _backward(tiling, q_s, k, v, out, lse, d_out, bias5):
    """Blocked FlashAttention backward from the unblocked `q_s, k, v, out, lse, d_out`.

    Returns `dq` (w.r.t. the scaled queries), `dk`, `dv` unblocked and the
    bias gradient as a padded rank-5 tensor (or None).
    """
    q_c, k_c, v_c = tiling.split_q(q_s), tiling.split_k(k), tiling.split_k(v)
    bias_blocks = tiling.blocked_bias(bias5)
    do_c = tiling.split_q(d_out)
    # Padded query rows get lse = +inf, i.e. zero probabilities.
    lse_c = tiling.split_q(lse, fill=_POS_INF)[..., 0]
    # D_i = rowsum(dO * O): (nq, B, H_kv, G, q_chunk)
    delta_c = tiling.split_q(ops.sum(d_out * out, axis=-1, keepdims=True))[..., 0]

    def probs_and_dlogits(i, j, q_i, k_j, v_j, do_i):
        s = tiling.logits(q_i, k_j, i, j, bias_blocks)
        p = ops.exp(s - ops.take(lse_c, i, axis=0)[..., None])
        dp = ops.einsum("bngqd,bnkd->bngqk", do_i, v_j)
        ds = p * (dp - ops.take(delta_c, i, axis=0)[..., None])
        return p, ds

    def dq_block(i):
        q_i, do_i = ops.take(q_c, i, axis=0), ops.take(do_c, i, axis=0)

        def body(j, dq):
            k_j = ops.take(k_c, j, axis=0)
            _, ds = probs_and_dlogits(i, j, q_i, k_j, ops.take(v_c, j, axis=0), do_i)
            return dq + ops.einsum("bngqk,bnkd->bngqd", ds, k_j)

        lo, hi = tiling.key_range(i)
        return _loop(lo, hi, body, ops.zeros_like(q_i))

    dq = tiling.merge_q(_map(dq_block, tiling.nq, tiling.batch))

    bias_grad_shape = None
    if bias_blocks is not None:
        # Per key block: (nq|1, B|1, H_kv|1, G|1, q_chunk|1, k_chunk|1).
        b = bias_blocks.blocks
        bias_grad_shape = [_dim(b, a) for a in range(len(b.shape))]
        bias_grad_shape = [bias_grad_shape[0]] + bias_grad_shape[2:]

    def dkv_block(j):
        k_j, v_j = ops.take(k_c, j, axis=0), ops.take(v_c, j, axis=0)

        def body(i, carry):
            dk, dv = carry[0], carry[1]
            q_i, do_i = ops.take(q_c, i, axis=0), ops.take(do_c, i, axis=0)
            p, ds = probs_and_dlogits(i, j, q_i, k_j, v_j, do_i)
            dv = dv + ops.einsum("bngqk,bngqd->bnkd", p, do_i)
            dk = dk + ops.einsum("bngqk,bngqd->bnkd", ds, q_i)
            if bias_blocks is None:
                return dk, dv
            db = carry[2]
            red = _reduce_to(ds, bias_blocks.blocks.shape[2:])
            if bias_blocks.q_full:
                start_idx = [i] + [0] * (len(bias_grad_shape) - 1)
                db = ops.slice_update(db, start_idx, red[None])
            else:
                db = db + red[None]
            return dk, dv, db

        init = (ops.zeros_like(k_j), ops.zeros_like(v_j))
        if bias_blocks is not None:
            init = init + (ops.zeros(bias_grad_shape, "float32"),)
        lo, hi = tiling.query_range(j)
        return _loop(lo, hi, body, init)

    results = _map(dkv_block, tiling.nk, tiling.batch)
    dk, dv = tiling.merge_k(results[0]), tiling.merge_k(results[1])
    d_bias = None
    if bias_blocks is not None:
        d_bias = results[2]
        # (nk, nq|1, B|1, H_kv|1, G|1, q_chunk|1, k_chunk|1)
        if not bias_blocks.k_full:
            d_bias = ops.sum(d_bias, axis=0, keepdims=True)
        d_bias = _unblock(d_bias, bias_blocks)
    return dq, dk, dv, d_bias


def backward_chunks(chunks):
    """The backward pass's `(q_chunk, k_chunk)` for forward blocks `chunks`."""
    return tuple(min(c, BACKWARD_MAX_CHUNK) for c in chunks)


def chunked_dot_product_attention(
    query,
    key,
    value,
    *,
    attention_mask=None,
    bias=None,
    is_causal=False,
    scale=None,
    start_index=0,
    sliding_window=None,
    chunk_size=DEFAULT_CHUNK_SIZE,
):
    """Exact scaled dot-product attention in `O(T)` memory.

    Same inputs and outputs as `keras_attn.ops.dot_product_attention` (use
    that, with `chunk_size=`, rather than this function): `query`
    `(B, T_q, H, D)`, `key` `(B, T_k, H_kv, D)`, `value` `(B, T_k, H_kv, D_v)`,
    a boolean `attention_mask` already normalised to rank 4
    `(B|1, H|1, T_q|1, T_k)`, an additive `bias` broadcastable to
    `(B, H, T_q, T_k)`. The softmax runs in float32; query rows without any
    visible key give zeros (outputs and gradients). Dropout on the
    probabilities and returning the scores are not available here (both
    need the full score matrix).

    Args:
        chunk_size: `q_chunk` for both axes, or a pair `(q_chunk, k_chunk)`:
            the forward pass's blocks, which bound the memory. The backward
            pass uses blocks of at most `BACKWARD_MAX_CHUNK` per axis (never
            larger than the forward's). Lengths that are not multiples are
            padded internally.

    Returns:
        `(B, T_q, H, D_v)` in `value`'s dtype.
    """
    chunks = dispatch.check_chunk_size(chunk_size) or (DEFAULT_CHUNK_SIZE,) * 2
    out_dtype = value.dtype
    q = ops.cast(query, "float32")
    k = ops.cast(key, "float32")
    v = ops.cast(value, "float32")
    num_heads, num_kv_heads, head_dim = query.shape[2], key.shape[2], query.shape[3]
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    scale = float(scale)

    mask5 = None
    if attention_mask is not None:
        mask5 = _to_5d(masking._as_bool(attention_mask), num_heads, num_kv_heads)
    bias5 = None
    if bias is not None:
        bias = ops.cast(bias, "float32")
        while len(bias.shape) < 4:
            bias = bias[None]
        bias5 = _to_5d(bias, num_heads, num_kv_heads)

    def tiling(block_sizes):
        return _Tiling(
            block_sizes,
            batch=_dim(q, 0),
            t_q=_dim(q, 1),
            t_k=_dim(k, 1),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            is_causal=is_causal,
            window=sliding_window,
            start=ops.cast(start_index, "int32"),
            mask5=mask5,
        )

    forward_tiling = tiling(chunks)

    def run(q_in, k_in, v_in, bias_in=None):
        q_s = q_in * scale
        out, lse = _forward(forward_tiling, q_s, k_in, v_in, bias_in)

        def grad(*args, upstream=None):
            if upstream is None:
                (upstream,) = args
            # Built here, not with the forward: inference never needs it.
            backward_sizes = backward_chunks(forward_tiling.chunks)
            backward_tiling = (
                forward_tiling
                if backward_sizes == forward_tiling.chunks
                else tiling(backward_sizes)
            )
            dq, dk, dv, d_bias = _backward(
                backward_tiling, q_s, k_in, v_in, out, lse,
                ops.cast(upstream, "float32"), bias_in,
            )
            grads = [dq * scale, dk, dv]
            if bias_in is not None:
                d_bias = d_bias[..., : _dim(bias_in, 3), : _dim(bias_in, 4)]
                grads.append(ops.reshape(d_bias, ops.shape(bias_in)))
            return tuple(grads)

        return out, grad

    fn = ops.custom_gradient(run)
    if bias5 is None:
        out = fn(q, k, v)
    else:
        out = fn(q, k, v, bias5)
    return ops.cast(out, out_dtype)


def _reduce_to(x, shape):
    """Sums `x` over the axes where `shape` has a 1 (keeping dims)."""
    axes = tuple(a for a, d in enumerate(shape) if d == 1 and x.shape[a] != 1)
    return ops.sum(x, axis=axes, keepdims=True) if axes else x


def _unblock(x, blocked):
    """`(nk|1, nq|1, B|1, H_kv|1, G|1, q_chunk|1, k_chunk|1)` -> rank 5, padded."""
    # -> (B|1, H_kv|1, G|1, nq|1, q_chunk|1, nk|1, k_chunk|1)
    x = ops.transpose(x, (2, 3, 4, 1, 5, 0, 6))
    s = [_dim(x, a) for a in range(7)]
    return ops.reshape(x, (s[0], s[1], s[2], s[3] * s[4], s[5] * s[6]))
