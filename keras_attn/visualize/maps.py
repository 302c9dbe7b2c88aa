"""Every attention map of a model built with keras_attn layers, as NumPy arrays."""

import dataclasses

import keras
import numpy as np

from keras_attn.ops import recording


@dataclasses.dataclass
class AttentionMap:
    """One attention call's probabilities.

    Attributes:
        name: the layer's path in the model (e.g.
            `"encoder_0/self_attention"`); a layer called twice gets `#1`,
            `#2`... appended in call order.
        scores: `(B, H, T_q, T_k)` float32 probabilities; masked positions
            are exactly 0.
        mask: `(B, H|1, T_q, T_k)` bool, True where a query may attend to a
            key (padding, causal, window and explicit masks combined), or
            None when nothing was masked.
    """

    name: str
    scores: np.ndarray
    mask: np.ndarray = None

    @property
    def num_heads(self):
        return self.scores.shape[1]

    def key_padding(self):
        """`(B, T_k)` True for keys no query of the row may see (padding)."""
        if self.mask is None:
            return np.zeros((self.scores.shape[0], self.scores.shape[-1]), bool)
        return ~self.mask.any(axis=(1, 2))

    def query_padding(self):
        """`(B, T_q)` True for queries that see no key (e.g. padded rows)."""
        if self.mask is None:
            return np.zeros(self.scores.shape[:1] + self.scores.shape[2:3], bool)
        return ~self.mask.any(axis=(1, 3))


def _numpy(x):
    return None if x is None else np.asarray(keras.ops.convert_to_numpy(x))


def attention_maps(model, inputs, **call_kwargs):
    """Calls `model(inputs, **call_kwargs)` once and returns every attention map.

    Works with any model whose attention runs through keras_attn's
    `MultiHeadAttention` (directly, or inside `TransformerEncoderBlock`,
    `TransformerDecoderBlock`, converted Hugging Face models and
    `DecoderOnlyLM` / `Seq2SeqLM`): functional, Sequential or subclassed.
    The model is not rebuilt or changed: the call runs eagerly inside
    `keras_attn.ops.recording.recording()`, where each attention layer also
    computes its probabilities; outside it nothing is recorded and nothing
    costs more.

    Args:
        model: a built Keras model or layer (anything callable).
        inputs: what the model takes (arrays, a list or a dict).
        **call_kwargs: passed to the call (e.g. `padding_mask=`).

    Returns:
        A list of `AttentionMap` in call order (self- and cross-attention of
        each block in the order they ran).

    Example:

    >>> import numpy as np, keras, keras_attn as ka
    >>> x = keras.Input((None, 16))
    >>> y = ka.TransformerEncoderBlock(num_heads=2, intermediate_dim=32, name="enc")(x)
    >>> maps = attention_maps(keras.Model(x, y), np.random.rand(1, 5, 16).astype("float32"))
    >>> len(maps), maps[0].name, maps[0].scores.shape
    (1, 'enc/self_attention', (1, 2, 5, 5))
    """
    if not getattr(model, "built", True):
        model(inputs, **call_kwargs)  # a first call may build symbolically: not recorded
    with recording.recording() as records:
        model(inputs, **call_kwargs)
    counts = {}
    maps = []
    for layer, scores, mask in records:
        name = _name(layer, model)
        counts[name] = counts.get(name, 0) + 1
        maps.append((name, _numpy(scores), _numpy(mask)))
    seen = {}
    result = []
    for name, scores, mask in maps:
        if counts[name] > 1:
            seen[name] = seen.get(name, 0) + 1
            name = f"{name}#{seen[name]}"
        result.append(AttentionMap(name, scores.astype(np.float32), _full_mask(mask, scores)))
    return result


def _full_mask(mask, scores):
    """The recorded mask as `(B, H|1, T_q, T_k)` bool (a subclass overriding
    `_compute_attention` gets Keras's `(B, T_q, T_k)`), or None."""
    if mask is None:
        return None
    mask = mask.astype(bool)
    if mask.ndim == scores.ndim - 1:
        mask = mask[:, None]
    if mask.ndim != scores.ndim:
        return None  # N-D attention axes: scores carry the layout, the mask another
    return np.broadcast_to(mask, (scores.shape[0], mask.shape[1]) + scores.shape[2:])


def _name(layer, model):
    path = getattr(layer, "path", None) or layer.name
    prefix = getattr(model, "name", None)
    if prefix and path.startswith(prefix + "/"):
        path = path[len(prefix) + 1:]
    return path


def attention_rollout(maps, add_residual=True):
    """Attention rollout (Abnar & Zuidema, 2020) through a stack of self-attention maps.

    Each layer's heads are averaged, the identity is added for the residual
    connection (`add_residual`), rows are renormalised, and the layers are
    multiplied from the first to the last: entry `[b, i, j]` is how much
    output position `i` draws on input position `j` through the whole stack.

    Args:
        maps: `AttentionMap`s or `(B, H, T, T)` arrays of successive
            self-attention layers (equal `T`).
        add_residual: add the identity before renormalising.

    Returns:
        `(B, T, T)` float64, rows summing to 1.
    """
    arrays = [m.scores if isinstance(m, AttentionMap) else np.asarray(m) for m in maps]
    if not arrays:
        raise ValueError("`maps` is empty: pass the self-attention maps of a stack of layers.")
    shapes = {a.shape[:1] + a.shape[2:] for a in arrays}
    if len(shapes) != 1 or any(a.ndim != 4 or a.shape[2] != a.shape[3] for a in arrays):
        raise ValueError(
            "attention_rollout needs self-attention maps of one shape (B, H, T, T). Received "
            f"shapes: {[a.shape for a in arrays]}"
        )
    rollout = None
    for a in arrays:
        layer = a.astype(np.float64).mean(axis=1)
        if add_residual:
            layer = layer + np.eye(layer.shape[-1])
        total = layer.sum(-1, keepdims=True)
        layer = np.divide(layer, total, out=np.zeros_like(layer), where=total > 0)
        rollout = layer if rollout is None else layer @ rollout
    return rollout
