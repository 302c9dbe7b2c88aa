"""What every family converter shares: the checkpoint it reads, the family
record the table holds, the refusals, and the weight copies.

A family converter is `convert(checkpoint, *, dropout=None) -> keras.Model`.
It reads the Hugging Face config object (`checkpoint.config`) and the tensors
through `checkpoint.tensors`, a read-only mapping from tensor name to array
(`keys()` and `[name]`, nothing else), so a converter never sees where the
numbers come from. Two mappings exist: a `transformers` model's state dict
(`StateDictTensors`) and the safetensors files of a `save_pretrained` folder
(`SafetensorsTensors`, each tensor read from disk when it is asked for: no
PyTorch model is built). Both give float32 NumPy arrays.

`Weights` wraps the mapping for one conversion: each tensor taken once,
shapes checked on assignment, torch `Linear` layouts turned into Keras
kernels, the leftovers an error at the end. `assign` gives a float32 array
to a variable of any float dtype (rounded to nearest even, in NumPy, the
same on every backend). `values_from_checkpoint` is the scope every
conversion runs in (`registry.convert`): the model is built without
variable values and each variable is made once, from its checkpoint
tensor. `refuse` is the one way a
converter says what it cannot represent: a ValueError naming the config
field and its value.
"""

import collections.abc
import contextlib
import dataclasses
import fnmatch
import json
import mmap
import os
import struct
from typing import Callable, Optional, Tuple

import keras
import ml_dtypes
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


# safetensors dtype names -> NumPy dtypes (little-endian, as the format is).
_SAFETENSORS_DTYPES = {
    "F64": "<f8", "F32": "<f4", "F16": "<f2", "BF16": ml_dtypes.bfloat16,
    "I64": "<i8", "I32": "<i4", "I16": "<i2", "I8": "i1", "U8": "u1", "BOOL": "?",
}
# Names of older checkpoints that `transformers` renames when it loads any
# model (its "legacy" conversion mapping), renamed here alike.
_LEGACY_NAMES = (("LayerNorm.gamma", "LayerNorm.weight"), ("LayerNorm.beta", "LayerNorm.bias"))
# Tensors are converted to float32 this many bytes at a time, so that a big
# table is never held twice (as stored and as float32).
_READ_BLOCK = 64 * 2**20


def safetensors_files(folder):
    """The safetensors files of a `save_pretrained` folder: the shards listed
    in `model.safetensors.index.json`, else `model.safetensors`; `[]` if it
    has neither (a PyTorch `.bin` checkpoint)."""
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        return [os.path.join(folder, name) for name in sorted(set(weight_map.values()))]
    single = os.path.join(folder, "model.safetensors")
    return [single] if os.path.isfile(single) else []


def _safetensors_header(path):
    """`{name: (dtype, shape, start byte, end byte)}` of one safetensors file
    (8 bytes of header length, a JSON header, then the data)."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    size = os.path.getsize(path)
    entries = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if entry["dtype"] not in _SAFETENSORS_DTYPES:
            raise ValueError(f"Checkpoint tensor `{name}` in {path} has dtype {entry['dtype']}, "
                             f"which keras_attn does not read (supported: {sorted(_SAFETENSORS_DTYPES)})")
        dtype = np.dtype(_SAFETENSORS_DTYPES[entry["dtype"]])
        begin, end = (8 + length + offset for offset in entry["data_offsets"])
        shape = tuple(entry["shape"])
        if end - begin != int(np.prod(shape)) * dtype.itemsize or end > size:
            raise ValueError(f"Checkpoint tensor `{name}` in {path}: its bytes {entry['data_offsets']} "
                             f"do not hold shape {shape} of {entry['dtype']} (file of {size} bytes)")
        entries[name] = (dtype, shape, begin, end)
    return entries


# Arrays of at least this many bytes get pages of their own (`aligned_empty`).
_OWN_PAGES = 2**20


def aligned_empty(shape, dtype, alignment=64):
    """An uninitialized C-contiguous array whose data starts on `alignment`
    bytes (TensorFlow copies an unaligned array once more on assignment).

    An array of `_OWN_PAGES` bytes or more is an anonymous memory map: its
    pages go back to the system when it is freed. From the heap, the freed
    tensors of a conversion (held until their variables are made) stay in
    the process when the variables are allocated beside them (BERT-base:
    0.3 GB more at the end, measured). The map is private and, on Linux,
    populated as it is made: the kernel fills it in one pass instead of one
    page fault per 4 KB as it is written (Qwen2.5-1.5B's conversion: 16.9 s
    against 20.8 s for a shared map filled by faults, measured).
    """
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape)) * dtype.itemsize
    if nbytes >= _OWN_PAGES:  # page-aligned
        if hasattr(mmap, "MAP_PRIVATE"):  # POSIX
            flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
            pages = mmap.mmap(-1, nbytes, flags=flags)
        else:
            pages = mmap.mmap(-1, nbytes)
        return np.frombuffer(pages, dtype).reshape(shape)
    buffer = np.empty(nbytes + alignment, np.uint8)
    start = -buffer.ctypes.data % alignment
    return buffer[start : start + nbytes].view(dtype).reshape(shape)


class SafetensorsTensors(collections.abc.Mapping):
    """The safetensors files of a `save_pretrained` folder (one file or
    shards) as the name -> float32 array mapping converters read.

    Only the headers are read up front. Each tensor is read from disk when it
    is asked for (plain reads, not a memory map that would keep the pages it
    touched resident until closed) and converted to float32 block by block
    (bfloat16 and float16 exactly), so reading a tensor costs its float32
    array and nothing else. Integer tensors keep their dtype.
    """

    def __init__(self, folder, files=None):
        # `files`: these files of `folder` instead of its checkpoint's (a
        # PEFT adapter's `adapter_model.safetensors`).
        files = safetensors_files(folder) if files is None else files
        if not files:
            raise ValueError(f"No safetensors checkpoint in {folder!r}: expected model.safetensors "
                             "or model.safetensors.index.json")
        self._where = {}  # name -> (path, dtype, shape, start, end)
        for path in files:
            for name, entry in _safetensors_header(path).items():
                for old, new in _LEGACY_NAMES:
                    name = name.replace(old, new)
                self._where[name] = (path, *entry)

    def dtype(self, name):
        """The dtype `name` is stored in."""
        return self._where[name][1]

    def __getitem__(self, name):
        path, dtype, shape, begin, end = self._where[name]
        floating = np.issubdtype(dtype, np.floating) or dtype == ml_dtypes.bfloat16
        out = aligned_empty(shape, "float32" if floating else dtype)
        flat = out.reshape(-1)
        step = max(1, _READ_BLOCK // dtype.itemsize)
        with open(path, "rb") as f:
            f.seek(begin)
            for i in range(0, flat.size, step):
                block = np.frombuffer(f.read(min(step, flat.size - i) * dtype.itemsize), dtype)
                flat[i : i + block.size] = block
        return out

    def __iter__(self):
        return iter(self._where)

    def __len__(self):
        return len(self._where)


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
        projections: `projections(model) -> {transformers module name: layer}`
            for the families whose linear layers map one to one, unscaled,
            onto ours (`llama.projections`): what LoRA adapters convert
            through (`keras_attn.convert.adapters`); None where they do not
            (fused or rescaled projections).
    """

    name: str
    model_types: Tuple[str, ...]
    architectures: Tuple[str, ...]
    convert: Callable
    projections: Optional[Callable] = None

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


# Keras variable dtypes -> NumPy dtypes.
_VARIABLE_DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16,
                    "float64": np.float64}


@contextlib.contextmanager
def values_from_checkpoint():
    """The scope of one conversion: the variables created inside get no
    value until it ends (Keras's deferred variables, `keras.StatelessScope`),
    `assign` gives each its checkpoint value, and at the end each variable
    is made from that value; a variable nothing was assigned to gets its own
    initializer's. So no random initial value is ever computed (TensorFlow's
    oneDNN allocator keeps those temporaries: +1.8 GB for Qwen2.5-0.5B's
    token table, `benchmarks/RESULTS.md`, "Real sizes") and each variable's
    memory is allocated once (on TensorFlow, the variable adopts its value's
    memory; elsewhere the value is freed as the variable is made). Models are
    built symbolically inside (an eager call would compute every initializer).
    """
    with keras.StatelessScope():
        yield


class _Value:
    """An initializer returning one array, which nothing else references: a
    deferred variable's value."""

    def __init__(self, value):
        self.value = value

    def __call__(self, shape, dtype=None):
        if self.value.nbytes >= _OWN_PAGES and keras.backend.backend() == "tensorflow":
            return _tensorflow_alias(self.value)
        return self.value


def _tensorflow_alias(array):
    """A TensorFlow tensor on `array`'s memory (DLPack; bfloat16, which
    DLPack does not name, as its bits). The variable made from it adopts
    that memory: a `tf.Variable` copies a NumPy value twice on the way
    (a 0.54 GB array: +1.1 GB transient, measured), a tensor on its own
    memory not at all."""
    import tensorflow as tf

    if array.dtype == ml_dtypes.bfloat16:
        bits = tf.experimental.dlpack.from_dlpack(array.view(np.uint16).__dlpack__())
        return tf.bitcast(bits, tf.bfloat16)
    return tf.experimental.dlpack.from_dlpack(array.__dlpack__())


def assign(variable, value, name, reshape=False):
    """Gives float32 `value` to `variable`, rounded (to nearest even) to its
    dtype: its initial value if it is deferred (`values_from_checkpoint`),
    else assigned now. `reshape`: a value of another shape with as many
    numbers is taken in C order (a head-major output axis onto `(heads,
    head_dim)`)."""
    value = np.asarray(value, dtype="float32")
    shape = tuple(variable.shape)
    if value.shape != shape and not (reshape and value.size == int(np.prod(shape))):
        raise ValueError(
            f"Checkpoint tensor `{name}` has shape {value.shape}; the keras_attn "
            f"variable `{variable.path}` expects {shape}."
        )
    # Always a copy of its own: the variable may take this memory as it is
    # (`_Value`), so it must share it with no other array (a transformers
    # model's parameter, a view another variable also takes).
    converted = aligned_empty(shape, _VARIABLE_DTYPES[variable.dtype])
    _copy(converted.reshape(value.shape), value)
    # A deferred variable (created in a `keras.StatelessScope`, no value yet)
    # keeps its initializer until the scope ends; Keras has no public way to
    # set it, and `assign` in the scope would only record the value beside it.
    if getattr(variable, "_initializer", None) is not None:
        variable._initializer = _Value(converted)
    else:
        variable.assign(converted)


_TILE = 256


def _copy(destination, value):
    """`destination[...] = value`. A 2-D value read against its memory order
    (a checkpoint's `(out, in)` kernel transposed) is copied in square
    tiles, which keep both sides in cache: 5x faster than NumPy's strided
    copy for a 1536 x 8960 kernel, measured."""
    if value.ndim != 2 or value.flags.c_contiguous:
        destination[...] = value
        return
    rows, columns = value.shape
    for i in range(0, rows, _TILE):
        for j in range(0, columns, _TILE):
            destination[i:i + _TILE, j:j + _TILE] = value[i:i + _TILE, j:j + _TILE]


def set_norm(layer, weights, prefix):
    """A LayerNormalization from `prefix.weight` and `prefix.bias`."""
    assign(layer.gamma, weights.take(prefix + ".weight"), prefix + ".weight")
    assign(layer.beta, weights.take(prefix + ".bias"), prefix + ".bias")


def set_rms_norm(layer, scale, name):
    """A `keras.layers.RMSNormalization` (scale only)."""
    assign(layer.scale, scale, name)


def set_dense(layer, kernel, bias, name, reshape=False):
    """`bias` None for a Dense without one (both sides must agree);
    `reshape` as for `assign` (the bias is always taken in C order)."""
    assign(layer.kernel, kernel, name + ".weight", reshape=reshape)
    _assign_bias(layer, bias, name)


def _assign_bias(layer, bias, name):
    if (bias is None) != (layer.bias is None):
        raise ValueError(
            f"Checkpoint layer `{name}` has {'no ' if bias is None else 'a '}bias; the "
            f"keras_attn layer `{layer.path}` {'has' if layer.bias is not None else 'has none'}."
        )
    if bias is not None:
        assign(layer.bias, bias, name + ".bias", reshape=True)


def set_attention(mha, q, k, v, out):
    """`q, k, v, out`: `(kernel (in, out), bias or None, name)` with `in`-major
    kernels; the output axis is head-major (`(heads, head_dim)` flattened),
    so a reshape gives the EinsumDense layouts, grouped-query heads included.
    `k` and `v` are None for a layer without key/value projections
    (`shared_key_value`)."""
    for dense, weights in zip(
        (mha.query_dense, mha.key_dense, mha.value_dense, mha.output_dense), (q, k, v, out)
    ):
        if dense is None and weights is None:
            continue
        if dense is None or weights is None:
            raise ValueError(
                f"The keras_attn layer `{mha.path}` has {'no ' if dense is None else 'a '}key/value "
                f"projection; the checkpoint {'has' if weights is not None else 'has none'}."
            )
        kernel, bias, name = weights
        set_dense(dense, kernel, bias, name, reshape=True)


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
        assign(lm.lm_head.bias, np.zeros(lm.lm_head.bias.shape, "float32"), "lm_head.bias")


def set_output_head(layer, weights, name, table, tied, table_name):
    """An encoder's output Dense `name` (a masked LM's decoder): with `tied`,
    the token table `table` (a safetensors folder leaves the tied
    `name.weight` out; a state dict has it, checked equal); its bias when
    the checkpoint has one."""
    if name + ".weight" in weights:
        kernel = weights.take(name + ".weight")
        if tied and not np.array_equal(kernel, table):
            refuse("tie_word_embeddings", True, f"but {name}.weight differs from {table_name}")
    elif tied:
        kernel = table
    else:
        refuse("tie_word_embeddings", False, f"but the checkpoint has no {name}.weight")
    bias = weights.take(name + ".bias") if name + ".bias" in weights else None
    set_dense(layer, kernel.T, bias, name)
