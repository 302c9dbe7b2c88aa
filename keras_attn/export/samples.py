"""What an exporter feeds and reads: the model's input specs, output names,
sample inputs (random ones within each input's range, or the user's
normalized to dicts) and the Keras outputs the artifacts are compared with."""

import dataclasses
import inspect

import keras
import numpy as np


@dataclasses.dataclass(frozen=True)
class InputSpec:
    name: str
    shape: tuple  # batch axis first, None = dynamic
    dtype: str


def vocabulary(layer):
    """The number of rows of `layer`'s table (its `vocabulary_size` or
    `input_dim`: ids are valid below it), or None for a layer without one."""
    for attr in ("vocabulary_size", "input_dim"):
        value = getattr(layer, attr, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def _vocabularies(layer):
    return [v for v in map(vocabulary, layer._flatten_layers(include_self=False)) if v]


def embedded_inputs(model):
    """`{input name: vocabulary size}` of the integer inputs that a layer with a
    table reads directly (the smallest such table; a subclassed model stands
    for the smallest table it holds, since its sublayers are called out of
    the functional graph's sight). For a BERT the token ids get the token
    table's size, not the two token types'."""
    by_id = {id(t): t.name for t in getattr(model, "inputs", None) or () if "int" in str(t.dtype)}
    found = {}
    for layer in model._flatten_layers(include_self=False):
        size = vocabulary(layer)
        if size is None and isinstance(layer, keras.Model) and not hasattr(layer, "inputs"):
            size = min(_vocabularies(layer), default=None)
        for node in getattr(layer, "_inbound_nodes", ()) if size else ():
            for tensor in keras.tree.flatten((node.arguments.args, node.arguments.kwargs)):
                name = by_id.get(id(tensor))
                if name is not None:
                    found[name] = min(found.get(name, size), size)
    return found


def _is_shape(structure):
    return isinstance(structure, (list, tuple)) and all(
        isinstance(d, (int, type(None))) for d in structure)


def _check_is_model(model):
    if not isinstance(model, keras.Model):
        raise TypeError(
            "Expected `model` to be a keras.Model. Received: "
            f"model={model!r} of type {type(model).__name__}"
        )


def _sample_sets(sample_inputs):
    """One set (array, list of arrays or dict) or a list of dicts, as a list of sets."""
    if (isinstance(sample_inputs, (list, tuple)) and sample_inputs
            and all(isinstance(s, dict) for s in sample_inputs)):
        return list(sample_inputs)
    return None if sample_inputs is None else [sample_inputs]


def _subclassed_inputs(model, sample_inputs):
    """`(structure, [(name, shape, dtype)])` of a called subclassed model's
    inputs: the structure Keras recorded at its first call (one tensor, a
    list or a dict), names from the dict keys or the call's first argument,
    dtypes from `sample_inputs` (else int32 for a single input of a model
    with an embedding, the model's input dtype otherwise)."""
    shapes = getattr(model, "_build_shapes_dict", None) or {}
    if not getattr(model, "built", False) or len(shapes) != 1:
        raise ValueError(
            f"Received an unbuilt model `{model.name}`: a subclassed model that was "
            "never called (or whose call takes several tensor arguments); export needs the "
            "shapes of its inputs. Call it once on a batch (`model(x)`) and "
            "pass that batch as `sample_inputs`, or build it functionally with "
            f"`keras.Input`s. Received: model.built={getattr(model, 'built', None)}"
        )
    structure = next(iter(shapes.values()))
    arg = next(iter(inspect.signature(model.call).parameters), "inputs")
    if isinstance(structure, dict):
        entries = [(str(k), structure[k]) for k in structure]
    elif _is_shape(structure):
        entries = [(arg, structure)]
    else:
        entries = [(f"{arg}_{i}", shape) for i, shape in enumerate(structure)]
    samples = []
    for sample in _sample_sets(sample_inputs) or ():
        if isinstance(sample, dict):
            samples.append([np.asarray(sample.get(k, np.zeros(0))) for k, _ in entries])
        elif len(entries) == 1 and not isinstance(sample, (list, tuple)):
            samples.append([np.asarray(sample)])
        elif isinstance(sample, (list, tuple)) and len(sample) == len(entries):
            samples.append([np.asarray(x) for x in sample])
    inputs = []
    for i, (name, shape) in enumerate(entries):
        shape = tuple(shape)
        if samples:
            dtype = str(samples[0][i].dtype)
        elif len(entries) == 1 and _vocabularies(model):
            dtype = "int32"
        else:
            dtype = str(model.input_dtype)
        # Token ids: every axis dynamic (batch and sequence); other inputs keep
        # the recorded axes unless the given sample sets differ along them.
        dims = [None] + [
            None if "int" in dtype or len({s[i].shape[k] for s in samples
                                           if s[i].ndim == len(shape)}) > 1 else d
            for k, d in enumerate(shape[1:], start=1)
        ]
        inputs.append((name, tuple(dims), "int32" if dtype == "int64" else dtype))
    return structure, inputs


def as_functional(model, sample_inputs=None):
    """`model` as a functional model whose inputs name the exported signature.

    A functional model is returned as it is. A `keras.Sequential` becomes the
    functional model of its layers (it has no `output_names` nor graph
    nodes). A subclassed model that has been called becomes a functional
    model with one `keras.Input` per tensor it was called with (see
    `_subclassed_inputs`) whose output is the model's (a dict output keeps
    its keys as output names). Every variant shares `model`'s layers and
    weights.
    """
    _check_is_model(model)
    if isinstance(model, keras.Sequential):
        try:
            inputs, outputs = model.inputs, model.outputs
        except (AttributeError, ValueError):
            return model  # unbuilt: input_specs says so
        return keras.Model(inputs[0] if len(inputs) == 1 else inputs, outputs, name=model.name)
    if hasattr(model, "inputs") and hasattr(model, "outputs"):
        return model
    structure, entries = _subclassed_inputs(model, sample_inputs)
    tensors = [keras.Input(shape=shape[1:], dtype=dtype, name=name)
               for name, shape, dtype in entries]
    if isinstance(structure, dict):
        call_inputs = {name: t for (name, _, _), t in zip(entries, tensors)}
    elif _is_shape(structure):
        call_inputs = tensors[0]
    else:
        call_inputs = list(tensors)
    outputs = model(call_inputs, training=False)
    if isinstance(outputs, dict):
        outputs = [keras.layers.Identity(name=str(k))(v) for k, v in outputs.items()]
    return keras.Model(tensors[0] if len(tensors) == 1 else tensors, outputs, name=model.name)


def input_specs(model):
    """The named inputs of a built functional/Sequential model (a subclassed
    one goes through `as_functional` first).

    Raises:
        ValueError: the model has no known inputs (never built or called),
            or two inputs share a name.
    """
    _check_is_model(model)
    try:
        inputs = model.inputs
    except (AttributeError, ValueError):
        inputs = None
    if not model.built or not inputs:
        raise ValueError(
            f"Received an unbuilt model `{model.name}` (no known inputs): "
            "export needs a functional or Sequential model with `keras.Input`s "
            "so the exported signature has names, dtypes and shapes. Build it "
            "with `keras.Input(shape=(None, ...), name=...)`. Received: "
            f"model.built={model.built}"
        )
    specs = [InputSpec(t.name, (None,) + tuple(t.shape[1:]), str(t.dtype)) for t in inputs]
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"The model's inputs must have unique names. Received: {names}")
    return specs


def output_names(model):
    """Signature names of the model's outputs, in the order of `model.outputs`.

    These are `model.output_names`, made unique: several outputs of one layer
    (e.g. `MultiHeadAttention(..., return_attention_scores=True)` giving the
    output and the scores) share the layer's name, so every repeat after the
    first gets the suffix `_1`, `_2`, ... (skipping names already taken):
    `["mha", "mha"]` -> `["mha", "mha_1"]`.
    """
    names = getattr(model, "output_names", None)
    if names is None:  # a Sequential: its functional graph's output layers
        names = [t._keras_history[0].name for t in model.outputs]
    names = [str(n) for n in names]
    taken = set(names)
    unique = []
    for name in names:
        if name in unique:
            k = 1
            while f"{name}_{k}" in taken:
                k += 1
            name = f"{name}_{k}"
            taken.add(name)
        unique.append(name)
    return unique


def keras_outputs(model, sample):
    """Runs the Keras model on a `{name: array}` sample; a list of arrays."""
    specs = input_specs(model)
    args = [sample[s.name] for s in specs]
    result = model(args if len(args) > 1 else args[0], training=False)
    return [np.asarray(keras.ops.convert_to_numpy(y)) for y in keras.tree.flatten(result)]


# --------------------------------------------------------------------------
# Sample inputs


def _max_length(model):
    lengths = [
        layer.sequence_length
        for layer in model._flatten_layers(include_self=False)
        if isinstance(getattr(layer, "sequence_length", None), int)
    ]
    return min(lengths) if lengths else None


DEFAULT_SHAPES = ((2, 7), (3, 4))


def make_samples(model, shapes=DEFAULT_SHAPES, seed=0):
    """Random sample inputs from the model's input specs.

    Each `(batch, length)` in `shapes` gives one `{name: array}` set; dynamic
    non-batch axes get `length` (capped by any learned position table).
    Integer inputs get token ids in `[1, vocab)` (the vocabulary of the layer
    that reads them), masks (inputs named `*mask*`) ones and token types
    (`*type*`, `*segment*`) ids of the smallest table, with trailing zeros
    (padding) in every other row, so `mask_zero=True` paths are exercised.
    """
    specs = input_specs(model)
    rng = np.random.default_rng(seed)
    vocab = min(_vocabularies(model), default=2)  # the smallest table: token types
    id_ranges = embedded_inputs(model)
    cap = _max_length(model)
    samples = []
    for batch, length in shapes:
        if cap is not None:
            length = min(length, cap)
        sample = {}
        for spec in specs:
            shape = [batch] + [length if d is None else d for d in spec.shape[1:]]
            if "int" in spec.dtype:
                name = spec.name.lower()  # as `quality.padding_rows` reads the names
                if "mask" in name:
                    x = np.ones(shape, np.int64)
                elif "type" in name or "segment" in name:
                    x = rng.integers(0, vocab, size=shape)
                else:
                    x = rng.integers(1, max(id_ranges.get(spec.name, vocab), 2), size=shape)
                if len(shape) >= 2 and shape[1] > 1:
                    for row in range(1, batch, 2):
                        x[row, max(1, shape[1] // 2 + row % 3) :] = 0
                sample[spec.name] = x.astype(spec.dtype)
            elif spec.dtype == "bool":
                sample[spec.name] = rng.random(shape) > 0.3
            else:
                sample[spec.name] = rng.standard_normal(shape).astype(spec.dtype)
        samples.append(sample)
    return samples


def _as_sample_dict(specs, sample, arg_name):
    if isinstance(sample, dict):
        unknown = sorted(set(sample) - {s.name for s in specs})
        missing = [s.name for s in specs if s.name not in sample]
        if unknown or missing:
            raise ValueError(
                f"Received an invalid `{arg_name}`: its keys must be the model's "
                f"input names {[s.name for s in specs]}. Received keys: "
                f"{sorted(sample)} (missing {missing}, unknown {unknown})"
            )
        return {s.name: np.asarray(sample[s.name]) for s in specs}
    if len(specs) == 1 and not isinstance(sample, (list, tuple)):
        return {specs[0].name: np.asarray(sample)}
    if isinstance(sample, (list, tuple)) and len(sample) == len(specs):
        return {s.name: np.asarray(x) for s, x in zip(specs, sample)}
    raise ValueError(
        f"Received an invalid `{arg_name}`: expected an array (single-input "
        f"model), a list of {len(specs)} arrays or a dict keyed by "
        f"{[s.name for s in specs]}. Received: {type(sample).__name__}"
    )


def normalize_samples(model, sample_inputs, arg_name="sample_inputs"):
    """Validates user sample inputs; returns a list of `{name: array}` sets.

    `sample_inputs` is one set (array, list of arrays or dict) or a list of
    dicts (several sets, e.g. two batch sizes). None generates two sets.
    """
    specs = input_specs(model)
    if sample_inputs is None:
        return make_samples(model)
    sets = [_as_sample_dict(specs, s, arg_name) for s in _sample_sets(sample_inputs)]
    for sample in sets:
        for spec in specs:
            x = sample[spec.name]
            if x.ndim != len(spec.shape) or any(
                    want is not None and got != want for got, want in zip(x.shape, spec.shape)):
                raise ValueError(
                    f"Received an invalid `{arg_name}` for input '{spec.name}': "
                    f"expected shape {spec.shape} (None = any). Received: shape "
                    f"{x.shape}"
                )
            want_int = "int" in spec.dtype
            if want_int != np.issubdtype(x.dtype, np.integer) and spec.dtype != "bool":
                raise ValueError(
                    f"Received an invalid `{arg_name}` for input '{spec.name}': "
                    f"expected dtype {spec.dtype}. Received: dtype {x.dtype}"
                )
            sample[spec.name] = x.astype(spec.dtype)
    return sets


def shapes_of(sample):
    return {k: list(v.shape) for k, v in sample.items()}
