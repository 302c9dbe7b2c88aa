"""Checkpoint tensors into keras_attn layers: each tensor taken once (the
leftovers are an error), shapes checked, torch `Linear` layouts turned into
Keras kernels."""

import numpy as np

# Buffers and constants that carry no trained values.
_IGNORED_SUFFIXES = ("position_ids", "embeddings.token_type_ids", ".attn.bias", ".attn.masked_bias")


class Weights:
    """The checkpoint's tensors, by name without the base-model prefix; each
    taken once, and the leftovers reported at the end."""

    def __init__(self, state, prefix):
        self.state = {}
        for name, value in state.items():
            if name.endswith(_IGNORED_SUFFIXES):
                continue
            if prefix and name.startswith(prefix + "."):
                name = name[len(prefix) + 1 :]
            self.state[name] = value
        self.used = set()

    def __contains__(self, name):
        return name in self.state

    def take(self, name):
        self.used.add(name)
        return self.state[name]

    def check_all_used(self, architecture):
        left = sorted(set(self.state) - self.used)
        if left:
            raise ValueError(
                f"Cannot convert {architecture}: these checkpoint tensors have no "
                f"keras_attn counterpart: {left[:10]}{' ...' if len(left) > 10 else ''}"
            )


def assign(variable, value, name):
    value = np.asarray(value, dtype="float32")
    if tuple(variable.shape) != value.shape:
        raise ValueError(
            f"Checkpoint tensor `{name}` has shape {value.shape}; the keras_attn "
            f"variable `{variable.path}` expects {tuple(variable.shape)}."
        )
    variable.assign(value)


def set_norm(layer, weights, prefix):
    assign(layer.gamma, weights.take(prefix + ".weight"), prefix + ".weight")
    assign(layer.beta, weights.take(prefix + ".bias"), prefix + ".bias")


def set_dense(layer, kernel, bias, name):
    assign(layer.kernel, kernel, name + ".weight")
    assign(layer.bias, bias, name + ".bias")


def set_attention(mha, q, k, v, out, num_heads):
    """`q, k, v, out`: `(kernel (in, out), bias)` pairs with `in`-major kernels."""
    for dense, (kernel, bias, name) in zip(
        (mha._query_dense, mha._key_dense, mha._value_dense), (q, k, v)
    ):
        d_in, d_out = kernel.shape
        assign(dense.kernel, kernel.reshape(d_in, num_heads, d_out // num_heads), name)
        assign(dense.bias, bias.reshape(num_heads, d_out // num_heads), name)
    kernel, bias, name = out
    d_in, d_out = kernel.shape
    assign(mha._output_dense.kernel, kernel.reshape(num_heads, d_in // num_heads, d_out), name)
    assign(mha._output_dense.bias, bias, name)
