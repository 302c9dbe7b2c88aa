"""What every family converter shares: the checkpoint it reads, the family
record the table holds, the refusals, and the weight copies.

A family converter is `convert(checkpoint, *, dropout=None) -> keras.Model`.
It reads the Hugging Face config object (`checkpoint.config`) and the tensors
through `checkpoint.tensors`, a read-only mapping from tensor name to array
(`keys()` and `[name]`, nothing else). Today that mapping is a `transformers`
state dict (`StateDictTensors`, each tensor turned into float32 NumPy when it
is read); a reader of safetensors files that opens each tensor on demand is
the same mapping, so a converter never sees where the numbers come from.

`Weights` wraps the mapping for one conversion: each tensor taken once,
shapes checked on assignment, torch `Linear` layouts turned into Keras
kernels, the leftovers an error at the end. `refuse` is the one way a
converter says what it cannot represent: a ValueError naming the config
field and its value.
"""

import collections.abc
import dataclasses
import fnmatch
from typing import Callable, Tuple

import numpy as np

from keras_attn.layers import activations

# Buffers and constants that carry no trained values.
_IGNORED_SUFFIXES = ("position_ids", "embeddings.token_type_ids", ".attn.bias", ".attn.masked_bias")


# ---------------------------------------------------------------------------
# What a converter reads


class StateDictTensors(collections.abc.Mapping):
    """A PyTorch state dict as the name -> float32 array mapping converters
    read; each tensor is copied to NumPy when it is read, not before."""

    def __init__(self, state_dict):
        self._state = state_dict

    def __getitem__(self, name):
        return self._state[name].detach().cpu().float().numpy()

    def __iter__(self):
        return iter(self._state)

    def __len__(self):
        return len(self._state)


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """One checkpoint to convert.

    Attributes:
        config: the Hugging Face config object (`transformers.PretrainedConfig`).
        architecture: the model class name (`"LlamaForCausalLM"`): the loaded
            model's class, or the config's `architectures[0]`.
        tensors: a mapping from checkpoint tensor name to array (any float
            dtype; converters read it as float32).
    """

    config: object
    architecture: str
    tensors: collections.abc.Mapping

    @property
    def model_type(self):
        return getattr(self.config, "model_type", None)


@dataclasses.dataclass(frozen=True)
class Family:
    """A row of the converter table (`keras_attn/convert/registry.py`).

    Attributes:
        name: what the family is called in messages (`"BERT"`).
        model_types: the config `model_type`s it takes.
        architectures: the model classes it takes, names or `fnmatch` patterns
            (`"*ForCausalLM"`); another class of these model types is refused.
        convert: `convert(checkpoint, *, dropout=None) -> keras.Model`.
    """

    name: str
    model_types: Tuple[str, ...]
    architectures: Tuple[str, ...]
    convert: Callable

    def takes(self, architecture):
        return any(fnmatch.fnmatchcase(architecture, pattern) for pattern in self.architectures)


# ---------------------------------------------------------------------------
# Refusals


def refuse(field, value, why):
    """Raises the ValueError that names a config field keras_attn cannot represent."""
    raise ValueError(f"Cannot convert this model: config field `{field}`={value!r} {why}.")


def refuse_architecture(checkpoint, supported):
    """Raises the ValueError for a model class its family does not take."""
    names = list(supported)
    listed = names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]
    raise ValueError(
        f"Cannot convert {checkpoint.architecture}: for model_type={checkpoint.model_type!r} "
        f"supported {'is' if len(names) == 1 else 'are'} {listed}. "
        f"Received: architecture={checkpoint.architecture!r}"
    )


def mapped_activation(field, value, activation=None):
    """`activation` (default `value`) if the blocks map it, else a refusal of `field=value`."""
    activation = value if activation is None else activation
    if not isinstance(activation, str) or activation not in activations.ALIASES:
        refuse(field, value, f"is not an activation keras_attn maps (supported: {sorted(activations.ALIASES)})")
    return activation


# ---------------------------------------------------------------------------
# Weight copies


class Weights:
    """The checkpoint's tensors, by name without the base-model prefix; each
    taken once, and the leftovers reported at the end."""

    def __init__(self, tensors, prefix=""):
        self._tensors = tensors
        self._names = {}  # name without the prefix -> name in `tensors`
        for name in tensors.keys():
            if name.endswith(_IGNORED_SUFFIXES):
                continue
            short = name[len(prefix) + 1 :] if prefix and name.startswith(prefix + ".") else name
            self._names[short] = name
        self.used = set()

    def __contains__(self, name):
        return name in self._names

    def take(self, name):
        self.used.add(name)
        return np.asarray(self._tensors[self._names[name]], dtype="float32")

    def linear(self, name):
        """An `nn.Linear` as `(kernel (in, out), bias or None, name)`: the
        bias is taken when the checkpoint has one."""
        bias = self.take(name + ".bias") if name + ".bias" in self else None
        return self.take(name + ".weight").T, bias, name

    def check_all_used(self, architecture):
        left = sorted(set(self._names) - self.used)
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
    """A LayerNormalization from `prefix.weight` and `prefix.bias`."""
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
        assign(layer.bias, _fit(bias, layer.bias.shape), name + ".bias")


def _fit(value, shape):
    """`value` in the layout `shape` when it has as many numbers (a head-major
    output axis onto `(heads, head_dim)`); else as it is, for `assign` to refuse."""
    value = np.asarray(value)
    return np.reshape(value, tuple(shape)) if value.size == int(np.prod(tuple(shape))) else value


def set_attention(mha, q, k, v, out):
    """`q, k, v, out`: `(kernel (in, out), bias or None, name)` with `in`-major
    kernels; the output axis is head-major (`(heads, head_dim)` flattened),
    so a reshape gives the EinsumDense layouts, grouped-query heads included."""
    for dense, (kernel, bias, name) in zip(
        (mha.query_dense, mha.key_dense, mha.value_dense, mha.output_dense), (q, k, v, out)
    ):
        set_dense(dense, _fit(kernel, dense.kernel.shape), bias, name)


def set_lm_head(lm, weights, tied, table, table_name, untied_bias=False):
    """The output head from `lm_head.weight`: with `tied`, checked equal to the
    token table `table` (named `table_name`); else copied into `lm.lm_head`
    (`untied_bias`: the head has a bias, set to zero). An untied model
    without `lm_head.weight` is refused."""
    if "lm_head.weight" not in weights:
        if not tied:
            refuse("tie_word_embeddings", False, "but the checkpoint has no lm_head.weight")
        return
    head = weights.take("lm_head.weight")
    if tied:
        if not np.array_equal(head, table):
            refuse("tie_word_embeddings", True, f"but lm_head.weight differs from {table_name}")
        return
    assign(lm.lm_head.kernel, head.T, "lm_head.weight")
    if untied_bias:
        lm.lm_head.bias.assign(np.zeros(lm.lm_head.bias.shape, "float32"))
