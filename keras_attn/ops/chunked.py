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
`take`, `slice_update`), so it runs on the TensorFlow, JAX and PyTorch
backends (tests check values and gradients against the reference on each). On
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

from keras_attn import checks
from keras_attn.ops import dispatch
from keras_attn.ops import masking
from keras_attn.ops.shapes import dim as _dim
from keras_attn.ops.tiling import Tiling
from keras_attn.ops.tiling import to_5d
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
    mask=None,
    bias=None,
    scale=None,
    chunk_size=DEFAULT_CHUNK_SIZE,
):
    """Exact scaled dot-product attention in `O(T)` memory.

    The `"blocked"` kernel of `keras_attn.ops.dot_product_attention` (use
    that, with `chunk_size=`, rather than this function): `query`
    `(B, T_q, H, D)`, `key` `(B, T_k, H_kv, D)`, `value` `(B, T_k, H_kv, D_v)`,
    `mask` a `masking.AttentionMask` (or None) whose boolean `mask` is rank 4
    `(B|1, H|1, T_q|1, T_k)` and whose causal / sliding-window band is built
    here block by block (its padded query rows are zeroed by the caller), an
    additive `bias` broadcastable to `(B, H, T_q, T_k)`. The softmax runs in
    float32; query rows without any visible key give zeros (outputs and
    gradients). Dropout on the probabilities and returning the scores are
    not available here (both need the full score matrix).

    Args:
        chunk_size: `q_chunk` for both axes, or a pair `(q_chunk, k_chunk)`:
            the forward pass's blocks, which bound the memory. The backward
            pass uses blocks of at most `BACKWARD_MAX_CHUNK` per axis (never
            larger than the forward's). Lengths that are not multiples are
            padded internally.

    Returns:
        `(B, T_q, H, D_v)` in `value`'s dtype.
    """
    chunks = checks.check_chunk_size(chunk_size) or (DEFAULT_CHUNK_SIZE,) * 2
    mask = masking.AttentionMask() if mask is None else mask
    out_dtype = value.dtype
    q = ops.cast(query, "float32")
    k = ops.cast(key, "float32")
    v = ops.cast(value, "float32")
    num_heads, num_kv_heads, head_dim = query.shape[2], key.shape[2], query.shape[3]
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    scale = float(scale)

    mask5 = None
    if mask.mask is not None:
        mask5 = to_5d(masking.as_bool(mask.mask), num_heads, num_kv_heads)
    bias5 = None
    if bias is not None:
        bias = ops.cast(bias, "float32")
        while len(bias.shape) < 4:
            bias = bias[None]
        bias5 = to_5d(bias, num_heads, num_kv_heads)

    def tiling(block_sizes):
        return Tiling(
            block_sizes,
            batch=_dim(q, 0),
            t_q=_dim(q, 1),
            t_k=_dim(k, 1),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            is_causal=mask.is_causal,
            window=mask.sliding_window,
            start=ops.cast(mask.start_index, "int32"),
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
