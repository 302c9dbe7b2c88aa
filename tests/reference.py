"""Independent NumPy reference implementations used by the tests.

Nothing here imports keras_attn: every numeric claim of the package is
checked against these straightforward float64 formulas.
"""

import math

import numpy as np


def softmax(x, axis=-1):
    x = x - x.max(axis=axis, keepdims=True)
    e = np.exp(x)
    return e / e.sum(axis=axis, keepdims=True)


def attention(q, k, v, mask=None, bias=None, scale=None):
    """q (B,Tq,H,D), k (B,Tk,Hkv,D), v (B,Tk,Hkv,Dv); mask broadcast to (B,H,Tq,Tk).

    Fully masked rows give zeros. Returns (out (B,Tq,H,Dv), probs (B,H,Tq,Tk)).
    """
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    heads, kv_heads = q.shape[2], k.shape[2]
    # Grouped-query attention the naive way: repeat K/V heads.
    k = np.repeat(k, heads // kv_heads, axis=2)
    v = np.repeat(v, heads // kv_heads, axis=2)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    logits = np.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if bias is not None:
        logits = logits + np.asarray(bias, np.float64)
    probs = np.zeros_like(logits)
    if mask is None:
        probs = softmax(logits)
    else:
        mask = np.broadcast_to(np.asarray(mask, bool), logits.shape)
        masked = np.where(mask, logits, -np.inf)
        any_row = mask.any(-1, keepdims=True)
        safe = np.where(any_row, masked, 0.0)
        probs = np.where(any_row, softmax(safe), 0.0)
        probs = np.where(mask, probs, 0.0)
    out = np.einsum("bhqk,bkhd->bqhd", probs, v)
    return out, probs


def causal(tq, tk=None, offset=0):
    tk = tq if tk is None else tk
    return np.arange(tk)[None, :] <= (np.arange(tq)[:, None] + offset)


def linear(x, w, b=None):
    y = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    return y if b is None else y + b


def layer_norm(x, gamma, beta, eps):
    x = np.asarray(x, np.float64)
    mean = x.mean(-1, keepdims=True)
    var = x.var(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * gamma + beta


def mha(query, value, key, weights, num_heads, num_kv_heads, mask=None, bias=None):
    """Multi-head attention from explicit weights (Keras EinsumDense layout).

    weights: dict with wq (D, H, Dk), bq (H, Dk), wk, bk, wv, bv (D, Hkv, Dh),
    wo (H, Dv, Dout), bo (Dout,).
    """
    q = np.einsum("btd,dhk->bthk", query, weights["wq"]) + weights.get("bq", 0)
    k = np.einsum("btd,dhk->bthk", key, weights["wk"]) + weights.get("bk", 0)
    v = np.einsum("btd,dhk->bthk", value, weights["wv"]) + weights.get("bv", 0)
    out, probs = attention(q, k, v, mask=mask, bias=bias)
    out = np.einsum("bthk,hkd->btd", out, weights["wo"]) + weights.get("bo", 0)
    return out, probs


def mha_weights(layer, dtype=None):
    """The `weights` of `mha` read from a MultiHeadAttention layer (its
    `*_dense` sublayers; biases when it has them), cast to `dtype` if given."""
    weights = {}
    for name, dense in (("q", layer.query_dense), ("k", layer.key_dense),
                        ("v", layer.value_dense), ("o", layer.output_dense)):
        weights["w" + name] = np.asarray(dense.kernel.numpy(), dtype)
        if dense.bias is not None:
            weights["b" + name] = np.asarray(dense.bias.numpy(), dtype)
    return weights


def sinusoidal(length, dim, max_wavelength=10000.0, start=0):
    pos = np.arange(start, start + length, dtype=np.float64)[:, None]
    enc = np.zeros((length, dim))
    for i in range(dim):
        angle = pos[:, 0] / max_wavelength ** (2 * (i // 2) / dim)
        enc[:, i] = np.sin(angle) if i % 2 == 0 else np.cos(angle)
    return enc


def rotary(x, max_wavelength=10000.0, start=0, scaling_factor=1.0, inv_freq=None):
    """x (B, T, ..., D): rotate pairs (i, i + D/2) by pos / w^(2i/D), or by
    pos * inv_freq[i] when `inv_freq` (D/2 frequencies) is given."""
    x = np.asarray(x, np.float64)
    t, d = x.shape[1], x.shape[-1]
    half = d // 2
    out = np.empty_like(x)
    for p in range(t):
        pos = (start + p) / scaling_factor
        for i in range(half):
            freq = max_wavelength ** (-2 * i / d) if inv_freq is None else inv_freq[i]
            theta = pos * freq
            a, b = x[:, p, ..., i], x[:, p, ..., i + half]
            out[:, p, ..., i] = a * math.cos(theta) - b * math.sin(theta)
            out[:, p, ..., i + half] = b * math.cos(theta) + a * math.sin(theta)
    return out


def alibi_slopes(n):
    # Press et al.'s reference code.
    def pow2(n):
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        return [start * start**i for i in range(n)]

    if math.log2(n).is_integer():
        return pow2(n)
    closest = 2 ** math.floor(math.log2(n))
    return pow2(closest) + alibi_slopes(2 * closest)[0::2][: n - closest]


def t5_bucket(relative_position, bidirectional=True, num_buckets=32, max_distance=128):
    # Mesh TensorFlow / T5 reference logic, scalar version.
    ret = 0
    n = -relative_position
    if bidirectional:
        num_buckets //= 2
        ret += (n < 0) * num_buckets
        n = abs(n)
    else:
        n = max(n, 0)
    max_exact = num_buckets // 2
    if n < max_exact:
        return ret + n
    val = max_exact + int(
        math.log(n / max_exact) / math.log(max_distance / max_exact) * (num_buckets - max_exact)
    )
    return ret + min(val, num_buckets - 1)


def gelu(x):
    from scipy.special import erf

    return 0.5 * x * (1 + erf(x / math.sqrt(2)))


def relu(x):
    return np.maximum(x, 0)


def attention_with_grads(q, k, v, mask, bias, scale, d_out):
    """Forward and gradients of softmax attention in float64 NumPy.

    q `(B, Tq, H, D)`, k/v `(B, Tk, Hkv, D)`, mask bool `(B, H, Tq, Tk)`,
    bias `(B, H, Tq, Tk)` or None. Rows without visible keys give zeros.
    """
    q, k, v, d_out = (np.asarray(x, np.float64) for x in (q, k, v, d_out))
    groups = q.shape[2] // k.shape[2]
    kr, vr = np.repeat(k, groups, axis=2), np.repeat(v, groups, axis=2)
    s = np.einsum("bqhd,bkhd->bhqk", q, kr) * scale
    if bias is not None:
        s = s + bias
    s = np.where(mask, s, -np.inf)
    row_max = np.max(s, axis=-1, keepdims=True)
    row_max = np.where(np.isfinite(row_max), row_max, 0.0)
    e = np.where(mask, np.exp(s - row_max), 0.0)
    denom = e.sum(-1, keepdims=True)
    p = np.where(denom > 0, e / np.where(denom > 0, denom, 1.0), 0.0)
    out = np.einsum("bhqk,bkhd->bqhd", p, vr)
    d_v = np.einsum("bhqk,bqhd->bkhd", p, d_out)
    d_p = np.einsum("bqhd,bkhd->bhqk", d_out, vr)
    d_s = p * (d_p - np.sum(d_p * p, axis=-1, keepdims=True))
    d_q = np.einsum("bhqk,bkhd->bqhd", d_s, kr) * scale
    d_k = np.einsum("bhqk,bqhd->bkhd", d_s, q) * scale

    def fold(x):  # sum the query heads sharing one key/value head
        b, t, h, d = x.shape
        return x.reshape(b, t, h // groups, groups, d).sum(axis=3)

    return out, d_q, fold(d_k), fold(d_v), d_s


def blockwise_dequantized(kernel, bits, block=32):
    """What symmetric `bits`-bit blocks of `block` along the input axis of
    `kernel` `(k, n)` give back (MatMulNBits' layout, written here
    independently of the writers). In float32, as the weights are: a code
    exactly between two integers rounds the same way."""
    k, n = kernel.shape
    padded = np.zeros((-(-k // block) * block, n), np.float32)
    padded[:k] = kernel
    blocks = padded.reshape(-1, block, n)
    top = np.float32(2 ** (bits - 1) - 1)
    scale = np.abs(blocks).max(axis=1, keepdims=True) / top
    codes = np.clip(np.rint(blocks / np.where(scale == 0, 1, scale)), -top, top)
    return (codes * scale).reshape(-1, n)[:k].astype(np.float32)
