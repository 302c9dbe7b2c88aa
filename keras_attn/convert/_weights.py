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


def set_rms_norm(layer, scale, name):
    """A `keras.layers.RMSNormalization` (scale only)."""
    assign(layer.scale, scale, name)


def set_dense(layer, kernel, bias, name):
    """`bias` None for a Dense without one (both sides must agree)."""
    assign(layer.kernel, kernel, name + ".weight")
    _assign_bias(layer, bias, name)


def _assign_bias(layer, bias, name):
    if (bias is None) != (layer.bias is None):
        raise ValueError(
            f"Checkpoint layer `{name}` has {'no ' if bias is None else 'a '}bias; the "
            f"keras_attn layer `{layer.path}` {'has' if layer.bias is not None else 'has none'}."
        )
    if bias is not None:
        assign(layer.bias, np.reshape(bias, tuple(layer.bias.shape)), name + ".bias")


def set_attention(mha, q, k, v, out):
    """`q, k, v, out`: `(kernel (in, out), bias or None, name)` with `in`-major
    kernels; the output axis is head-major (`(heads, head_dim)` flattened),
    so a reshape gives the EinsumDense layouts, grouped-query heads included."""
    for dense, (kernel, bias, name) in zip(
        (mha.query_dense, mha.key_dense, mha.value_dense), (q, k, v)
    ):
        assign(dense.kernel, np.reshape(kernel, tuple(dense.kernel.shape)), name)
        _assign_bias(dense, bias, name)
    kernel, bias, name = out
    dense = mha.output_dense
    assign(dense.kernel, np.reshape(kernel, tuple(dense.kernel.shape)), name)
    _assign_bias(dense, bias, name)
