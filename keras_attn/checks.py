"""Argument checks of keras_attn, written once: ops, layers, export, generation, convert.

Each check raises early, naming the argument, what was expected and the value
(or shape, or dtype) received, in Keras's words: "Received an invalid value
for argument `num_heads`, expected a positive integer. Received:
num_heads=0". A value of the wrong type raises a TypeError, a value of the
right type out of range a ValueError. Checks that return their argument
return it validated (and normalised where said), so a constructor reads
`self.num_heads = checks.check_positive_int("num_heads", num_heads)`.

This module sits at the bottom of the package: it imports Keras and NumPy
only, so every other module may import it (docs/architecture.md).

Example:

>>> check_positive_int("num_heads", 4)
4
>>> check_positive_int("num_heads", 0)
Traceback (most recent call last):
...
ValueError: Received an invalid value for argument `num_heads`, expected a positive integer. Received: num_heads=0
"""

import math

import keras
import numpy as np
from keras import ops

try:  # Keras sets this scope while it computes output specs on placeholders.
    from keras.src.backend import in_symbolic_scope as _in_symbolic_scope
except ImportError:  # pragma: no cover - older/newer Keras without it
    def _in_symbolic_scope():
        return False


def static_int(value):
    """`value` as a Python int when it is known before run time, else None.

    Python/NumPy integers, 0-d NumPy arrays and eager scalar tensors (Keras
    converts NumPy call arguments to them). Variables and symbolic tensors
    (traced functions, loop variables) give None.
    """
    if isinstance(value, (bool, np.bool_)):
        return None
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, np.ndarray):
        if value.ndim == 0 and np.issubdtype(value.dtype, np.integer):
            return int(value)
        return None
    if hasattr(value, "assign"):  # a variable: its value may change before run time
        return None
    if ops.is_tensor(value) and len(value.shape) == 0 and "int" in str(value.dtype):
        try:  # eager tensors have a value; symbolic ones (tracing) do not
            return int(ops.convert_to_numpy(value))
        except Exception:  # noqa: BLE001  (each backend raises its own type)
            return None
    return None


# --- Python values -----------------------------------------------------------


def check_positive_int(name, value, allow_none=False):
    """A positive Python int (or None with `allow_none`), returned."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        expected = "a positive integer" + (" or None" if allow_none else "")
        error = TypeError if not isinstance(value, (int, float)) else ValueError
        raise error(
            f"Received an invalid value for argument `{name}`, expected "
            f"{expected}. Received: {name}={value!r}"
        )
    return value


def check_positive_float(name, value):
    """A positive finite number, returned as a float."""
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not 0 < value < float("inf")
    ):
        raise ValueError(
            f"Received an invalid value for argument `{name}`, expected a "
            f"positive finite number. Received: {name}={value!r}"
        )
    return float(value)


def check_choice(name, value, choices):
    """One of `choices`, returned."""
    if value not in choices:
        raise ValueError(
            f"Received an invalid value for argument `{name}`, expected one of "
            f"{list(choices)}. Received: {name}={value!r}"
        )
    return value


def check_bool(name, value):
    """A Python bool, returned."""
    if not isinstance(value, bool):
        raise TypeError(
            f"Received an invalid value for argument `{name}`, expected a bool. "
            f"Received: {name}={value!r}"
        )
    return value


def check_dropout(name, rate):
    """A dropout rate: a finite number in [0, 1), returned as a float."""
    if isinstance(rate, bool) or not isinstance(rate, (int, float)):
        raise TypeError(
            f"Received an invalid value for argument `{name}`, expected a float "
            f"in [0, 1). Received: {name}={rate!r}"
        )
    if not (math.isfinite(rate) and 0.0 <= rate < 1.0):
        raise ValueError(
            f"Received an invalid value for argument `{name}`, expected a float "
            f"in [0, 1). Received: {name}={rate!r}"
        )
    return float(rate)


def check_batch_size(batch_size):
    """A positive Python or NumPy integer (a data pipeline's batch size)."""
    if not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
        raise ValueError(
            "Received an invalid value for argument `batch_size`, expected a "
            f"positive integer. Received: batch_size={batch_size!r}"
        )


# --- Attention arguments -------------------------------------------------------


def check_start_index(start_index, length=None, table_size=None, layer_name=""):
    """A non-negative `start_index` (the position of the first query), and,
    given a static `length` and a `table_size`, positions within the table.

    A Python/NumPy integer (or an eager scalar tensor) is checked with its
    value. With a symbolic `start_index` only a static `length` longer than
    the whole table can be rejected here: the rest is checked by
    TensorFlow's slice at run time, except under XLA, which clamps an
    out-of-range dynamic slice to the last rows (so callers such as the
    generation loops check their `max_length` against the table up front).
    """
    if isinstance(start_index, (bool, np.bool_)):
        raise TypeError(
            "Received an invalid value for argument `start_index`, expected a "
            f"non-negative integer. Received: start_index={start_index!r}"
        )
    start = static_int(start_index)
    if start is not None and start < 0:
        raise ValueError(
            "Received an invalid value for argument `start_index`, expected a "
            f"non-negative integer. Received: start_index={start}"
        )
    if table_size is None or length is None:
        return
    if start is not None and start + length > table_size:
        raise ValueError(
            f"{layer_name} covers {table_size} positions, but positions "
            f"[{start}, {start + length}) were requested "
            f"(start_index={start}, sequence length={length}). "
            "Use a larger `sequence_length` or a sinusoidal/rotary encoding, "
            "which extrapolate."
        )
    if start is None and length > table_size:
        raise ValueError(
            f"{layer_name} covers {table_size} positions, but a sequence of "
            f"length {length} was given (from a dynamic start_index). "
            "Use a larger `sequence_length` or a sinusoidal/rotary encoding, "
            "which extrapolate."
        )


def check_sliding_window(sliding_window):
    """None or a positive int, returned."""
    if sliding_window is None:
        return None
    if isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or sliding_window <= 0:
        raise ValueError(
            "Received an invalid value for argument `sliding_window`, expected "
            f"None or a positive integer. Received: sliding_window={sliding_window!r}"
        )
    return sliding_window


def check_soft_cap(name, value):
    """None or a positive float (a logit soft cap `cap * tanh(x / cap)`), returned."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(
            f"Received an invalid value for argument `{name}`, expected None or a "
            f"positive number. Received: {name}={value!r}"
        )
    return float(value)


def check_chunk_size(chunk_size, name="chunk_size"):
    """The block sizes of the blocked attention path: None, 0 (never
    blocked), a positive int or a pair `(q_chunk, k_chunk)`. Returns None, 0
    or a `(q_chunk, k_chunk)` tuple."""
    if chunk_size is None:
        return None
    if isinstance(chunk_size, int) and not isinstance(chunk_size, bool) and chunk_size == 0:
        return 0
    pair = chunk_size if isinstance(chunk_size, (tuple, list)) else (chunk_size, chunk_size)
    if len(pair) != 2 or not all(
        isinstance(c, int) and not isinstance(c, bool) and c > 0 for c in pair
    ):
        raise ValueError(
            f"Received an invalid value for argument `{name}`, expected None, 0, a "
            "positive integer or a pair of positive integers (q_chunk, k_chunk). "
            f"Received: {name}={chunk_size!r}"
        )
    return (int(pair[0]), int(pair[1]))


def check_layer_chunk_size(chunk_size, dropout):
    """A layer's `chunk_size` (as `check_chunk_size`) against its (validated)
    `dropout`: the blocked path never builds the attention probabilities, so
    an explicit block size and dropout on them exclude each other (None
    picks the blocked path only when dropout is inactive).

    Returns it with a pair as a list, so that `get_config` survives a JSON
    round trip unchanged.
    """
    if chunk_size != 0:
        check_chunk_size(chunk_size)
    if chunk_size not in (0, None) and dropout > 0.0:
        raise ValueError(
            "An explicit `chunk_size` (the blocked attention path) cannot be "
            "combined with attention dropout: the blocked path never builds "
            "the probabilities that dropout would drop. Use chunk_size=None "
            "(blocked only when dropout is inactive, e.g. at inference) or "
            f"dropout=0. Received: chunk_size={chunk_size!r}, dropout={dropout!r}"
        )
    return list(chunk_size) if isinstance(chunk_size, tuple) else chunk_size


def check_num_key_value_heads(num_key_value_heads, num_heads, name="num_key_value_heads"):
    """None or a positive divisor of `num_heads`, returned (`name`: the
    argument's, e.g. `num_key_value_heads[2]` for one layer's)."""
    check_positive_int(name, num_key_value_heads, allow_none=True)
    if num_key_value_heads is not None and num_heads % num_key_value_heads:
        raise ValueError(
            f"Received an invalid value for argument `{name}`, "
            f"expected a divisor of num_heads={num_heads}. Received: "
            f"{name}={num_key_value_heads}"
        )
    return num_key_value_heads


def check_block_switches(
    normalization,
    use_gated_feedforward,
    attention_use_bias,
    attention_output_use_bias,
    feedforward_use_bias,
):
    """The Transformer blocks' architecture switches (also taken by the
    generation models), validated; `attention_output_use_bias=None` follows
    `attention_use_bias`. Returns them as a dict of constructor arguments."""
    attention_use_bias = check_bool("attention_use_bias", attention_use_bias)
    return {
        "normalization": check_choice("normalization", normalization, ("layer_norm", "rms_norm")),
        "use_gated_feedforward": check_bool("use_gated_feedforward", use_gated_feedforward),
        "attention_use_bias": attention_use_bias,
        "attention_output_use_bias": check_bool(
            "attention_output_use_bias",
            attention_use_bias if attention_output_use_bias is None else attention_output_use_bias,
        ),
        "feedforward_use_bias": check_bool("feedforward_use_bias", feedforward_use_bias),
    }


# --- Shapes --------------------------------------------------------------------


def check_rank(name, x, rank):
    """The ops' `(batch, seq, heads, head_dim)` tensors have rank `rank`."""
    if len(x.shape) != rank:
        raise ValueError(
            f"Expected `{name}` of rank {rank} (batch, seq, heads, head_dim). "
            f"Received: {name}.shape={tuple(x.shape)}"
        )


def check_shape_rank(name, shape, rank, layout):
    """A `build` shape `{name}_shape` has rank `rank` (described by `layout`)."""
    if shape is None or len(shape) != rank:
        raise ValueError(
            f"Expected `{name}` of rank {rank} {layout}. Received: "
            f"{name}_shape={None if shape is None else tuple(shape)}"
        )


def check_heads_and_sizes(query, key, value):
    """The ops' query, key and value: rank 4, key/value heads dividing the
    query heads, equal head sizes of query and key, equal key/value lengths."""
    for name, x in (("query", query), ("key", key), ("value", value)):
        check_rank(name, x, 4)
    q_heads, k_heads, v_heads = query.shape[2], key.shape[2], value.shape[2]
    if k_heads != v_heads or q_heads % k_heads:
        raise ValueError(
            "`key` and `value` must have the same number of heads, and the "
            "number of query heads must be a multiple of it. Received: "
            f"query.shape={tuple(query.shape)}, key.shape={tuple(key.shape)}, "
            f"value.shape={tuple(value.shape)}"
        )
    if query.shape[-1] != key.shape[-1]:
        raise ValueError(
            "`query` and `key` must have the same head size (last axis). "
            f"Received: query.shape={tuple(query.shape)}, key.shape={tuple(key.shape)}"
        )
    tk_key, tk_value = key.shape[1], value.shape[1]
    if tk_key is not None and tk_value is not None and tk_key != tk_value:
        raise ValueError(
            "`key` and `value` must have the same sequence length. Received: "
            f"key.shape={tuple(key.shape)}, value.shape={tuple(value.shape)}"
        )


def check_attention_inputs(query, value, key, feature_checks=()):
    """A layer's `(batch, seq, features)` query, value and key: rank 3, one
    batch size, equal value/key lengths, and `(name, x, expected)` feature
    sizes of `feature_checks`."""
    for name, x in (("query", query), ("value", value), ("key", key)):
        if len(x.shape) != 3:
            raise ValueError(
                f"Expected `{name}` of rank 3 (batch, seq, features). Received: "
                f"{name}.shape={tuple(x.shape)}"
            )
    batches = [x.shape[0] for x in (query, value, key) if x.shape[0] is not None]
    if len(set(batches)) > 1:
        raise ValueError(
            "`query`, `value` and `key` must have the same batch size. Received: "
            f"query.shape={tuple(query.shape)}, value.shape={tuple(value.shape)}, "
            f"key.shape={tuple(key.shape)}"
        )
    if (
        value.shape[1] is not None
        and key.shape[1] is not None
        and value.shape[1] != key.shape[1]
    ):
        raise ValueError(
            "`value` and `key` must have the same sequence length. Received: "
            f"value.shape={tuple(value.shape)}, key.shape={tuple(key.shape)}"
        )
    for name, x, expected in feature_checks:
        if expected is not None and x.shape[-1] is not None and x.shape[-1] != expected:
            raise ValueError(
                f"`{name}` has {x.shape[-1]} features but the layer was built "
                f"for {expected}. Received: {name}.shape={tuple(x.shape)}"
            )


def check_bias(bias, scores_shape, name="bias"):
    """An additive logits bias broadcastable to `scores_shape = (B, H, T_q,
    T_k)`, checked on its static shape so that no path (the blocked one pads
    its inputs) silently misreads it. Returns it as a tensor (or None)."""
    if bias is None:
        return None
    if not hasattr(bias, "shape"):
        bias = ops.convert_to_tensor(bias)
    shape = tuple(bias.shape)
    if len(shape) > 4 or any(
        got is not None and want is not None and got not in (1, want)
        for got, want in zip(reversed(shape), reversed(scores_shape))
    ):
        batch, heads, t_q, t_k = scores_shape
        raise ValueError(
            f"Received an invalid `{name}` shape: {shape} does not broadcast to "
            f"(batch={batch}, heads={heads}, T_q={t_q}, T_k={t_k}). Expected at "
            "most rank 4, each axis 1 or equal to the attention's."
        )
    return bias


# --- Masks and dtypes ------------------------------------------------------------

_MASK_DTYPE_PREFIXES = ("bool", "int", "uint", "float", "bfloat")


def check_mask_dtype(name, mask):
    """A mask is boolean (True = attend) or an integer/float 0/1 mask."""
    dtype = getattr(mask, "dtype", None)
    try:
        # "bool" whatever the backend spells it ("torch.bool", "<dtype: 'bool'>").
        dtype = "bool" if dtype is None else keras.backend.standardize_dtype(dtype)
    except ValueError:  # not a Keras dtype at all, e.g. strings
        dtype = str(dtype)
    if not dtype.startswith(_MASK_DTYPE_PREFIXES):
        raise TypeError(
            f"Received an invalid `{name}` dtype: expected bool (True = attend) "
            f"or an integer/float 0/1 mask. Received: {name}.dtype={dtype}"
        )


def check_padding_mask(name, mask, tensor, tensor_name):
    """A padding mask (or None) is `(B, T)` matching `tensor`'s batch and length."""
    if mask is None:
        return
    check_mask_dtype(name, mask)
    shape = tuple(mask.shape)
    expected = tuple(tensor.shape[:2])
    ok = len(shape) == 2 and all(
        g is None or w is None or g == w for g, w in zip(shape, expected)
    )
    if not ok:
        raise ValueError(
            f"Received an invalid `{name}`: expected shape (batch, seq) = "
            f"{expected} to match `{tensor_name}`. Received: {name}.shape={shape}"
        )


def _dtype(x):
    return keras.backend.standardize_dtype(getattr(x, "dtype", None) or "float32")


def check_float_features(layer_name, **tensors):
    """Raises a TypeError naming the argument if a feature tensor is not floating.

    Integer features would run (the projections cast them), but token ids or
    a mask passed where features belong is a bug, not a request.
    """
    for name, x in tensors.items():
        if x is None:
            continue
        dtype = _dtype(x)
        if "float" not in dtype:
            raise TypeError(
                f"{layer_name} expects floating-point `{name}` features (e.g. "
                f"float32); token ids need an embedding first. Received: {name} with "
                f"dtype={dtype} and shape={tuple(x.shape)}"
            )


def check_integer_ids(layer_name, name, x):
    """Raises a TypeError naming the argument if token ids are not integers.

    Float ids would be truncated silently by the embedding lookup. Symbolic
    placeholders are let through: Keras builds a subclassed model on float
    placeholders when it reloads a `.keras` file (`build_from_config`), and a
    refusal there would leave the model unbuilt and its saved weights unloaded.
    A functional model with a float `keras.Input` fails on its first real call.
    """
    if isinstance(x, keras.KerasTensor) or _in_symbolic_scope():
        return
    dtype = _dtype(x)
    if "int" not in dtype:
        raise TypeError(
            f"{layer_name} expects integer token ids in `{name}` (int32 or int64); "
            f"float ids would be truncated silently. For a `keras.Input`, pass "
            f"dtype='int32'. Received: {name} with dtype={dtype} and "
            f"shape={tuple(x.shape)}"
        )


def check_keys(arg_name, value, allowed, what="keys"):
    """`value` (a dict) must have keys among `allowed`; `what` names them in the message."""
    unknown = sorted(set(value) - set(allowed))
    if unknown:
        raise ValueError(
            f"Received an invalid value for argument `{arg_name}`: unknown {what} "
            f"{unknown}; expected some of {list(allowed)}. Received: {arg_name}={value!r}"
        )
    return value


def check_members(arg_name, values, allowed, kind="subset"):
    """`values` must be a non-empty collection (not a string) of `allowed` items."""
    if isinstance(values, str) or not values or any(v not in allowed for v in values):
        raise ValueError(
            f"Received an invalid value for argument `{arg_name}`, expected a "
            f"non-empty {kind} of {list(allowed)}. Received: {arg_name}={values!r}"
        )
    return values


def concrete_values(x):
    """`x` as a NumPy array when its values are known now (NumPy input, an
    eager tensor), else None: symbolic tensors (Keras placeholders, a traced
    `tf.function`, `jax.jit` or a compiled export) have no values to check."""
    if isinstance(x, keras.KerasTensor) or _in_symbolic_scope():
        return None
    if isinstance(x, np.ndarray):
        return x
    try:  # each backend raises its own type for a traced tensor
        return np.asarray(ops.convert_to_numpy(x))
    except Exception:  # noqa: BLE001
        return None


def check_ids_in_range(layer_name, name, x, vocabulary_size, size_name="vocabulary_size"):
    """Raises a ValueError naming the layer, the id and the vocabulary size if
    a concrete (eager) id of `x` lies outside `[0, vocabulary_size)`.

    An embedding lookup would otherwise fail deep in the backend's gather
    (TensorFlow on CPU), or read a clamped or unspecified row (GPU, JAX).
    Traced calls (`model.fit`, `predict`, exports) are not checked here: an
    exported signature checks ids as its `check_ids` says
    (docs/guides/serving_validation.md).
    """
    ids = concrete_values(x)
    if ids is None or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
        return
    low, high = ids.min(), ids.max()
    if low >= 0 and high < vocabulary_size:
        return
    bad = low if low < 0 else high
    where = tuple(int(i) for i in np.argwhere(ids == bad)[0])
    raise ValueError(
        f"{layer_name} received a token id outside its vocabulary: `{name}` must "
        f"hold ids in [0, {size_name}={vocabulary_size}). Received: {name}{list(where)}"
        f"={int(bad)} (min {int(low)}, max {int(high)}, shape {tuple(ids.shape)})"
    )
