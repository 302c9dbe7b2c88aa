"""What a model computes, as plain data: the one description every graph writer reads.

`DecoderOnlyLM.describe()` returns a `Decoder`: per layer its norms, its
attention (heads, key/value heads, head size, the four projections with
their biases, QK-norm, rotary, window, soft cap, value norm, shared keys and
values) and its feed-forward; per model the token table, its scale, the head
(or the tied table), the final norm and soft cap, the positions and the
per-layer inputs; a projection's LoRA adapter, unmerged (`Dense.lora`:
every writer reads `kernel`, the adapter merged in, unless it keeps the
adapters apart). The ONNX and TFLite writers (`keras_attn.export`) read
this, never the Keras layers, so that a feature of the model is described
once here and written once per format; what a writer covers is decided over
the description by `keras_attn.export.capabilities`. The encoder writers read
`read_encoder(model)`: a functional Keras model's calls in order, as steps
(embeddings and plain token lookups, standalone norms, additions and scalar
products, Transformer blocks (their `Layer`s as a decoder's: rotary, windows,
grouped heads, QK-norm, gated feed-forwards), dense layers, comparisons and
indexing, and a sentence embedding's pooling, L2 normalization and
truncation).

Weights are `Weight`s: a variable read when a writer asks for it, as a
read-only float32 view of the variable's own memory where the backend keeps
it on the CPU in float32 (no second copy of a model while it is written),
else as a float32 host copy. A description holds no array of its own: at
real size it costs nothing to make.
"""

import dataclasses
from typing import Any
from typing import Optional

import numpy as np


def array_of(x):
    """A Keras variable or tensor as float32 NumPy (any backend). A float32
    variable on the CPU comes back as a read-only view of its own memory;
    anything else as a host copy."""
    import keras

    if not isinstance(x, keras.Variable):
        return np.asarray(keras.ops.convert_to_numpy(x), dtype=np.float32)
    if x.dtype == "float32":
        value = x.value
        backend = keras.backend.backend()
        if backend == "tensorflow":  # a read of a resource variable shares its buffer
            value = np.asarray(value.read_value())
        elif backend == "torch":
            value = value.detach().cpu().numpy()
        else:
            value = np.asarray(value)
        value = value.view()
        value.flags.writeable = False
        return value
    return np.asarray(x.numpy(), dtype=np.float32)


@dataclasses.dataclass(frozen=True)
class Weight:
    """A weight as a writer reads it: `shape` (after a C-order reshape of the
    stored `source_shape`) known without reading; `read()` the float32 array
    (a view where `array_of` gives one; a reshape of a view stays a view).
    `owner` is a layer whose `attribute` holds the value (read when asked:
    a LoRA-enabled layer serves its kernel merged)."""

    owner: Any
    attribute: str
    shape: tuple
    source_shape: tuple

    def read(self):
        value = array_of(getattr(self.owner, self.attribute))
        return value if self.shape == self.source_shape else value.reshape(self.shape)


@dataclasses.dataclass(frozen=True)
class LoRA:
    """A projection's unmerged PEFT-style adapter (`generation/lora.py`):
    the projection is `x @ base + scale * (x @ a) @ b`, `base` `(in, out)`
    the frozen kernel, `a` `(in, r)`, `b` `(r, out)`, `scale` `alpha / r`."""

    base: Weight
    a: Weight
    b: Weight
    scale: float

    def scaled_b(self):
        """`scale * b` (float32): the adapter as one `(x @ a) @ b'` (how the
        GenAI model builder and its `.onnx_adapter` files hold it)."""
        return self.b.read() * np.float32(self.scale)


@dataclasses.dataclass(frozen=True)
class Dense:
    """A projection `x @ kernel (+ bias)`: `kernel` `(in, out)`, `bias` `(out,)`
    or None. `kernel` is what the projection computes (an adapter merged in);
    `lora` the adapter unmerged, for a writer that keeps it apart, or None."""

    name: str
    kernel: Weight
    bias: Optional[Weight]
    lora: Optional[LoRA] = None

    def read_bias(self):
        """The bias as float32 NumPy, or None."""
        return None if self.bias is None else self.bias.read()


@dataclasses.dataclass(frozen=True)
class Norm:
    """`kind` "rms" (scale only) or "layer" (scale and bias), over the last axis
    when `last_axis`."""

    name: str
    kind: str
    scale: Weight
    bias: Optional[Weight]
    epsilon: float
    last_axis: bool = True


@dataclasses.dataclass(frozen=True)
class Rotary:
    """A rotary embedding over the first `rotary_dim` features of each head.
    `layer` is the model's own `RotaryEmbedding` (its scaling options stay
    the layer's: `tables` evaluates it); layers sharing one layer share it
    here too (compare with `is`)."""

    layer: Any
    head_dim: int
    rotary_dim: int

    def tables(self, max_length):
        """`(cos, sin)`, each `(max_length, rotary_dim / 2)` float32."""
        return rotary_tables(self.layer, self.head_dim, max_length)


_ROTARY_PROBE_POSITIONS = 512


def rotary_tables(rotary, head_dim, max_length):
    """`(cos, sin)`, each `(max_length, rotary_dim / 2)`: the angles keras_attn's
    `RotaryEmbedding` uses (times LongRoPE's attention factor), read off the
    layer by rotating unit vectors (so its scaling options are the layer's,
    not re-derived here)."""
    half = rotary.rotary_dim(head_dim) // 2
    # One "head" per frequency i, holding the unit vector e_i: the rotated
    # vector is cos at feature i and sin at feature i + half.
    probe = np.zeros((1, 1, half, head_dim), np.float32)
    index = np.arange(half)
    probe[0, 0, index, index] = 1.0
    cos, sin = [], []
    for start in range(0, max_length, _ROTARY_PROBE_POSITIONS):
        count = min(_ROTARY_PROBE_POSITIONS, max_length - start)
        rotated = array_of(rotary(np.repeat(probe, count, axis=1), start_index=start))[0]
        cos.append(rotated[:, index, index])
        sin.append(rotated[:, index, index + half])
    return np.concatenate(cos), np.concatenate(sin)


@dataclasses.dataclass(frozen=True)
class Attention:
    """Self-attention of one layer. `query`/`key`/`value` map the hidden size
    to `heads * head_dim` (`kv_heads * head_dim`), `output` back; `window`:
    keys a query sees, its own included (None: all); `key_value_source`: the
    index of the layer whose keys and values this one reads (None: its own;
    `key` and `value` are then None)."""

    num_heads: int
    num_key_value_heads: int
    head_dim: int
    query: Dense
    key: Optional[Dense]
    value: Optional[Dense]
    output: Dense
    query_norm: Optional[Norm]
    key_norm: Optional[Norm]
    rotary: Optional[Rotary]
    window: Optional[int]
    logit_soft_cap: Optional[float]
    value_norm: bool = False
    gate: bool = False
    key_value_source: Optional[int] = None
    unsupported: tuple = ()

    def packed_kernel(self):
        """`(in, q + k + v)`: the three projections as one."""
        return np.concatenate([d.kernel.read() for d in (self.query, self.key, self.value)], axis=1)

    def packed_bias(self):
        """The three biases as one (zeros for a missing one beside another), or None."""
        dense = (self.query, self.key, self.value)
        if all(d.bias is None for d in dense):
            return None
        return np.concatenate([d.bias.read() if d.bias is not None else np.zeros(d.kernel.shape[1], np.float32)
                               for d in dense])


@dataclasses.dataclass(frozen=True)
class FeedForward:
    """`down(activation(gate(x)) * up(x))`, or `down(activation(up(x)))` without
    a gate. `activation` is the canonical name (`activations.canonical_name`), or None
    with `activation_repr` saying what the model has."""

    gate: Optional[Dense]
    up: Dense
    down: Dense
    activation: Optional[str]
    activation_repr: str


def projections(layer):
    """A described `Layer`'s projections (`Dense`s), attention then feed-forward."""
    a, f = layer.attention, layer.feedforward
    return [d for d in (a.query, a.key, a.value, a.output, f.gate, f.up, f.down) if d is not None]


@dataclasses.dataclass(frozen=True)
class Layer:
    name: str
    attention_norm: Norm
    attention: Attention
    attention_post_norm: Optional[Norm]
    feedforward_norm: Norm
    feedforward: FeedForward
    feedforward_post_norm: Optional[Norm]
    output_scale: Optional[Weight] = None


@dataclasses.dataclass(frozen=True)
class Positions:
    """How positions enter: "rotary" (in the attention, per layer), "learned"
    (`table` `(rows, hidden)`), "sinusoidal" (`layer` evaluated at positions),
    or "relative" (a bias on the scores)."""

    kind: str
    table: Optional[Weight] = None
    layer: Any = None
    rows: Optional[int] = None
    rope_scaling: Optional[dict] = None


@dataclasses.dataclass(frozen=True)
class CacheLayer:
    """One layer's cache: `(slots, num_key_value_heads, head_dim)`; `ring` when
    the slots are a window reused past it; `shares` the layer whose cache
    this one reads (None: its own)."""

    num_key_value_heads: int
    head_dim: int
    slots: int
    ring: bool
    shares: Optional[int] = None


@dataclasses.dataclass(frozen=True)
class Decoder:
    """A decoder-only language model (see the module docstring).

    `unsupported`: `(option, what)` pairs for what the model has and this
    description does not carry (a writer refuses them by name)."""

    name: str
    vocabulary_size: int
    hidden_dim: int
    embedding: Weight
    embedding_scale: Optional[float]
    positions: Positions
    normalization: str
    layers: tuple
    final_norm: Norm
    head: Optional[Dense]
    final_logit_soft_cap: Optional[float]
    per_layer_input_dim: Optional[int] = None
    quantized: tuple = ()
    unsupported: tuple = ()

    @property
    def num_layers(self):
        return len(self.layers)

    @property
    def tied(self):
        """Whether the head reads the token table (stored once)."""
        return self.head is None

    def windows(self):
        return [layer.attention.window for layer in self.layers]

    def cache_layout(self, max_length, ring_buffers=True):
        """Per layer, its `CacheLayer` for a cache of `max_length`: a ring of
        `window` slots on a windowed layer shorter than `max_length` (with
        `ring_buffers`), else `max_length` slots."""
        layout = []
        for layer in self.layers:
            a = layer.attention
            ring = bool(ring_buffers and a.window is not None and a.window < max_length)
            layout.append(CacheLayer(a.num_key_value_heads, a.head_dim,
                                     a.window if ring else max_length, ring, a.key_value_source))
        return tuple(layout)

    def stacked_cache(self, max_length):
        """`(slots, ring)` of one cache stacked over every layer: a ring of the
        window when every layer has the same window shorter than
        `max_length`, else `max_length` slots."""
        windows = set(self.windows())
        if len(windows) == 1 and None not in windows and min(windows) < max_length:
            return min(windows), True
        return max_length, False


# --- Reading a Keras decoder ------------------------------------------------
# Self-attention options (MultiHeadAttention.get_config) a description
# carries or that do not change the inference graph; any other is recorded
# in `Attention.unsupported` by name.
_ATTENTION_OPTIONS = {
    "name", "trainable", "dtype", "num_heads", "key_dim", "value_dim", "dropout", "use_bias",
    "sliding_window", "use_gate", "seed", "num_key_value_heads", "chunk_size",
    "output_use_bias", "kernel_initializer", "bias_initializer", "kernel_regularizer",
    "bias_regularizer", "activity_regularizer", "kernel_constraint", "bias_constraint",
    "output_shape", "attention_axes", "rotary_embedding", "use_qk_norm", "qk_norm_epsilon",
    "logit_soft_cap", "use_value_norm", "shared_key_value",
}


def _weight(layer, attribute, shape=None):
    # A LoRA-enabled layer (Keras's LoRA or keras_attn's PEFT-style subclass,
    # `generation/lora.py`) keeps the kernel's variable as `_kernel` and serves the
    # merged value as `kernel`: the shape comes from the variable, the value
    # (merged) from the attribute when it is read.
    raw = getattr(layer, "_" + attribute, None)
    if raw is None:
        raw = getattr(layer, attribute)
    source = tuple(int(d) for d in raw.shape)
    return Weight(layer, attribute, source if shape is None else tuple(int(d) for d in shape), source)


def _dense(layer, heads_first_input=False):
    """A Dense or attention EinsumDense as `(in, out)`: query/key/value
    `(D, H, d)` -> `(D, H*d)`; the output projection `(H, d, D)` -> `(H*d, D)`."""
    shape = _weight(layer, "kernel").source_shape
    flat = (int(np.prod(shape[:-1])), shape[-1]) if heads_first_input else (shape[0], int(np.prod(shape[1:])))
    bias = getattr(layer, "bias", None)
    bias = None if bias is None else _weight(layer, "bias", (int(np.prod(bias.shape)),))
    return Dense(layer.name, _weight(layer, "kernel", flat), bias, _lora(layer, flat))


def _lora(layer, flat):
    """The PEFT-style adapter of `layer` unmerged (None without one, or once
    `merge_lora` has added it to the kernel). Its `(in, r)`/`(r, out)` are
    over the kernel's input and output axes in C order, as `flat` is."""
    # Keras's own LoRA (style="keras") has no `lora_merged` and per-head
    # factors: served merged only.
    if getattr(layer, "lora_merged", True):
        return None
    return LoRA(_weight(layer, "_kernel", flat), _weight(layer, "lora_kernel_a"), _weight(layer, "lora_kernel_b"),
                float(layer.lora_alpha) / int(layer.lora_rank))


def _norm(layer):
    if layer is None:
        return None
    axis = getattr(layer, "axis", -1)
    last = axis in (-1, [-1], (-1,))
    if hasattr(layer, "gamma"):  # keras.layers.LayerNormalization
        bias = _weight(layer, "beta") if getattr(layer, "beta", None) is not None else None
        return Norm(layer.name, "layer", _weight(layer, "gamma"), bias, float(layer.epsilon), last)
    return Norm(layer.name, "rms", _weight(layer, "scale"), None, float(layer.epsilon), last)


def _attention(attention, window, source):
    unsupported = [(key, "an attention option") for key in sorted(set(attention.get_config()) - _ATTENTION_OPTIONS)]
    if attention.value_dim != attention.key_dim:
        unsupported.append(("value_dim", f"value_dim={attention.value_dim} != key_dim={attention.key_dim}"))
    rotary = attention.rotary_embedding
    head_dim = attention.key_dim
    return Attention(
        num_heads=attention.num_heads,
        num_key_value_heads=attention.num_key_value_heads or attention.num_heads,
        head_dim=head_dim,
        query=_dense(attention.query_dense),
        key=None if attention.key_dense is None else _dense(attention.key_dense),
        value=None if attention.value_dense is None else _dense(attention.value_dense),
        output=_dense(attention.output_dense, heads_first_input=True),
        query_norm=_norm(getattr(attention, "query_norm", None)),
        key_norm=_norm(getattr(attention, "key_norm", None)),
        rotary=None if rotary is None else Rotary(rotary, head_dim, rotary.rotary_dim(head_dim)),
        window=window,
        logit_soft_cap=attention.logit_soft_cap,
        value_norm=bool(getattr(attention, "use_value_norm", False)),
        gate=bool(getattr(attention, "use_gate", False)),
        key_value_source=source,
        unsupported=tuple(unsupported),
    )


def _activation_of(function):
    """`(canonical name or None, the name shown)` of an activation function."""
    from keras_attn.layers.activations import canonical_name

    return canonical_name(function), getattr(function, "__name__", repr(function))


def _feedforward(block):
    gate = block.feedforward_gate_dense
    up = block.feedforward_intermediate_dense
    activation, shown = _activation_of((gate if gate is not None else up).activation)
    return FeedForward(gate=None if gate is None else _dense(gate), up=_dense(up),
                       down=_dense(block.feedforward_output_dense), activation=activation,
                       activation_repr=shown)


def _layer(block, window, source):
    return Layer(
        name=block.name,
        attention_norm=_norm(block.self_attention_layer_norm),
        attention=_attention(block.self_attention, window, source),
        attention_post_norm=_norm(getattr(block, "self_attention_post_norm", None)),
        feedforward_norm=_norm(block.feedforward_layer_norm),
        feedforward=_feedforward(block),
        feedforward_post_norm=_norm(getattr(block, "feedforward_post_norm", None)),
        output_scale=None if getattr(block, "output_scale", None) is None
        else _weight(block, "output_scale"),
    )


def _table_positions(kind, embedding, rows):
    """`Positions` of a `TokenAndPositionEmbedding`'s learned or sinusoidal positions."""
    layer = embedding.position_embedding
    return Positions(kind, table=_weight(layer, "position_embeddings") if kind == "learned" else None,
                     layer=layer, rows=rows)


def _quantized(model):
    return tuple(sorted({layer.quantization_mode for layer in model._flatten_layers()
                         if getattr(layer, "quantization_mode", None)}))


def read_decoder(model, options_described):
    """The `Decoder` of a built `DecoderOnlyLM` (`model.describe()`).
    `options_described`: the model's `get_config` keys this reader carries;
    any other is recorded in `unsupported` by name (a subclass's option is
    never written as if absent)."""
    config = model.get_config()
    unsupported = [(key, "a model option") for key in sorted(set(config) - set(options_described))]
    sources = getattr(model, "key_value_sources", None) or [None] * len(model.blocks)
    layers = []
    for block, window, source in zip(model.blocks, model.layer_sliding_windows(), sources):
        if getattr(block, "cross_attention", None) is not None:
            unsupported.append((block.name, "cross-attention"))
        layers.append(_layer(block, window, source))
    position = model.position
    if position in ("rotary", "relative"):
        table, positions = _weight(model.embedding, "embeddings"), Positions(position, rope_scaling=model.rope_scaling)
    else:
        table = _weight(model.embedding.token_embedding, "embeddings")
        positions = _table_positions(position, model.embedding, model.max_positions)
    return Decoder(
        name=model.name,
        vocabulary_size=model.vocabulary_size,
        hidden_dim=model.hidden_dim,
        embedding=table,
        embedding_scale=model.embedding_scale,
        positions=positions,
        normalization=model.normalization,
        layers=tuple(layers),
        final_norm=_norm(model.final_norm),
        head=None if model.lm_head is None else Dense(
            model.lm_head.name, _weight(model.lm_head, "kernel"),
            None if getattr(model.lm_head, "bias", None) is None else _weight(model.lm_head, "bias")),
        final_logit_soft_cap=model.final_logit_soft_cap,
        per_layer_input_dim=getattr(model, "per_layer_input_dim", None),
        quantized=_quantized(model),
        unsupported=tuple(unsupported),
    )


# --- An encoder: a functional Keras model's calls as steps -------------------
# Each step names the values it reads and the one it makes (a graph input's
# value is its name); `Encoder.steps` is in the order the values are made.


@dataclasses.dataclass(frozen=True)
class Tensor:
    """A graph input or output: `name`, Keras `dtype`, `shape` `(None, ...)`,
    the `value` it is; for an input of token ids, `vocabulary`: the smallest
    of the embeddings reading it (for `check_ids`)."""

    name: str
    dtype: str
    shape: tuple
    value: str
    vocabulary: Optional[int] = None


@dataclasses.dataclass(frozen=True)
class Step:
    """A call of layer `name` reading the value `input`, making `output`; as
    it is: `Identity`, `Dropout` (inference), a key of full slices only."""

    name: str
    input: str
    output: str


@dataclasses.dataclass(frozen=True)
class EmbeddingStep(Step):
    """`TokenAndPositionEmbedding` of the ids `input`: `tokens[ids] +
    positions[:T] + types[type_ids]` (row 0 of `types` without `type_ids`; no
    `types`: no term), then `norm`."""

    type_ids: Optional[str]
    tokens: Weight
    positions: Positions
    types: Optional[Weight]
    norm: Optional[Norm]
    mask_zero: bool


@dataclasses.dataclass(frozen=True)
class LookupStep(Step):
    """`keras.layers.Embedding` of the ids `input`: `table[ids]` (ModernBERT's,
    EuroBERT's token embedding; no positions, no norm)."""

    table: Weight
    mask_zero: bool


@dataclasses.dataclass(frozen=True)
class NormStep(Step):
    """A norm layer of its own (`LayerNormalization`, with or without its
    bias, or `RMSNormalization`) over the last axis of `input`."""

    norm: Norm


@dataclasses.dataclass(frozen=True)
class ArithmeticStep(Step):
    """`input + other` (`op` "add") or `input * other` ("multiply"): `other`
    the name of a value of the input's shape, or None and `scalar` a float
    (NomicBERT's token plus type embeddings, Gemma's embedding scale)."""

    op: str
    other: Optional[str]
    scalar: Optional[float]


@dataclasses.dataclass(frozen=True)
class BlockStep(Step):
    """`TransformerEncoderBlock` (its `layer` as a decoder's): `padding` the
    `(B, T)` mask of valid keys (None: none), `causal`, and with
    `mask_padded_queries` the attention output of padded queries zeroed
    before the output projection."""

    padding: Optional[str]
    layer: Layer
    normalize_first: bool
    causal: bool
    mask_padded_queries: bool


@dataclasses.dataclass(frozen=True)
class DenseStep(Step):
    """`activation(input @ kernel + bias)`; `activation` as `FeedForward`'s."""

    dense: Dense
    activation: Optional[str]
    activation_repr: str


@dataclasses.dataclass(frozen=True)
class CompareStep(Step):
    """`input == scalar` (`equal`) or `input != scalar`; `scalar` of the input's dtype."""

    equal: bool
    scalar: Any


@dataclasses.dataclass(frozen=True)
class GetItemStep(Step):
    """`input[key]`: per axis an int (that axis dropped) or None (a full slice)."""

    key: tuple


@dataclasses.dataclass(frozen=True)
class PoolingStep(Step):
    """`SentencePooling` of the sequence `input` `(B, T, D)` over the tokens
    of `mask` `(B, T)` (nonzero: a token), leaving out the first
    `prompt_length` `(B,)` tokens when it is not None: each of `modes`
    (`keras_attn.layers.sentence_pooling.MODES`) gives a `(B, D)` vector,
    concatenated in that order."""

    mask: str
    prompt_length: Optional[str]
    modes: tuple


@dataclasses.dataclass(frozen=True)
class NormalizeStep(Step):
    """L2 normalization of the last axis, as `keras.ops.normalize`:
    `input * min(rsqrt(sum(input ** 2)), 1 / epsilon)`."""

    epsilon: float


@dataclasses.dataclass(frozen=True)
class TruncateStep(Step):
    """The first `size` features of the last axis (`x[..., :size]`)."""

    size: int


@dataclasses.dataclass(frozen=True)
class Encoder:
    """A functional Keras model as steps (see above). `unsupported`:
    `(layer name, what)` for each call the description does not carry (its
    outputs are named all the same)."""

    name: str
    inputs: tuple
    steps: tuple
    outputs: tuple
    quantized: tuple = ()
    unsupported: tuple = ()

    @property
    def layers(self):
        """The blocks' `Layer`s, as a decoder's (the capability table reads both)."""
        return tuple(s.layer for s in self.steps if isinstance(s, BlockStep))


def _index_key(key):
    """`x[:, i, :]`-style keys as a tuple of ints and Nones (full slices), else
    None. A list is such a tuple: a `.keras` file stores the key as a list, and
    Keras's `GetItem` reads it back as the tuple."""
    key = tuple(key) if isinstance(key, (list, tuple)) else (key,)
    if all(isinstance(k, slice) and k == slice(None)
           or isinstance(k, (int, np.integer)) and not isinstance(k, bool) for k in key):
        return tuple(None if isinstance(k, slice) else int(k) for k in key)
    return None


def _truncation(key, rank):
    """`size` of a key `(:, ..., :size)` over `rank` axes (a list as
    `_index_key`'s), else None."""
    key = list(key) if isinstance(key, (list, tuple)) else [key]
    if len(key) != rank or any(not (isinstance(k, slice) and k == slice(None)) for k in key[:-1]):
        return None
    last = key[-1]
    if (not isinstance(last, slice) or last.start not in (None, 0) or last.step not in (None, 1)
            or not isinstance(last.stop, (int, np.integer)) or isinstance(last.stop, bool) or last.stop <= 0):
        return None
    return int(last.stop)


def _encoder_step(op, node, name):
    """The step of one call, or the text of why it is not one."""
    import keras

    from keras_attn.layers.sentence_pooling import SentencePooling
    from keras_attn.layers.token_and_position_embedding import TokenAndPositionEmbedding
    from keras_attn.layers.transformer_encoder_block import TransformerEncoderBlock

    args, kwargs = node.arguments.args, node.arguments.kwargs
    out = name(node.outputs[0])
    kind = type(op).__name__
    if kwargs.get("training"):
        return "called with training=True"
    if isinstance(op, TransformerEncoderBlock):
        extra = {k: v for k, v in kwargs.items() if v is not None and v is not False}
        extra.pop("padding_mask", None)
        causal = extra.pop("use_causal_mask", False)
        if extra or len(args) > 2 or not isinstance(causal, bool):
            return f"called with {sorted(extra) or 'extra arguments'}"
        padding = kwargs.get("padding_mask", args[1] if len(args) > 1 else None)
        if padding is None and getattr(args[0], "_keras_mask", None) is not None:
            return "inherits a Keras mask"
        if padding is not None and len(padding.shape) != 2:
            return f"a padding mask of shape {tuple(padding.shape)} (not (batch, length))"
        return BlockStep(op.name, name(args[0]), out, None if padding is None else name(padding),
                         _layer(op, op.sliding_window, None), op.normalize_first, causal,
                         op.mask_padded_queries)
    if isinstance(op, TokenAndPositionEmbedding):
        extra = {k: v for k, v in kwargs.items() if k != "token_type_ids" and v not in (None, False, 0)}
        if extra or len(args) > 1:
            return f"called with {sorted(extra) or 'extra arguments'}"
        types = kwargs.get("token_type_ids")
        table = op.token_type_embedding
        return EmbeddingStep(
            op.name, name(args[0]), out, None if types is None else name(types),
            tokens=_weight(op.token_embedding, "embeddings"),
            positions=_table_positions(op.position, op, op.sequence_length),
            types=None if table is None else _weight(table, "embeddings"),
            norm=_norm(op.layer_norm), mask_zero=op.mask_zero)
    if isinstance(op, keras.layers.Embedding):
        if len(args) != 1 or kwargs:
            return "called with extra arguments"
        if "int" not in str(args[0].dtype):
            return f"an Embedding of {args[0].dtype} ids (not integers)"
        return LookupStep(op.name, name(args[0]), out, _weight(op, "embeddings"), bool(op.mask_zero))
    if isinstance(op, (keras.layers.LayerNormalization, keras.layers.RMSNormalization)):
        if len(args) != 1:
            return "called with extra arguments"
        if isinstance(op, keras.layers.LayerNormalization) and (op.gamma is None or op.rms_scaling):
            return "a LayerNormalization with scale=False or rms_scaling=True"
        norm = _norm(op)
        if not norm.last_axis:
            return f"a norm over axis={op.axis} (not the last)"
        return NormStep(op.name, name(args[0]), out, norm)
    if isinstance(op, keras.layers.Dense):
        if len(args) != 1:
            return "called with extra arguments"
        return DenseStep(op.name, name(args[0]), out, _dense(op), *_activation_of(op.activation))
    if isinstance(op, (keras.layers.Dropout, keras.layers.Identity)):
        return Step(op.name, name(args[0]), out)
    if kind in ("Add", "Multiply") and len(args) == 2 and not kwargs:
        x, other = args
        if not isinstance(x, keras.KerasTensor):
            x, other = other, x
        if isinstance(other, keras.KerasTensor):
            if tuple(other.shape) != tuple(x.shape) or other.dtype != x.dtype:
                return f"{kind} of shapes {tuple(x.shape)} and {tuple(other.shape)} (not one shape and dtype)"
            return ArithmeticStep(op.name, name(x), out, kind.lower(), name(other), None)
        if not np.isscalar(other) or x.dtype != "float32":
            return f"{kind} of a float32 value and a scalar only"
        return ArithmeticStep(op.name, name(x), out, kind.lower(), None, float(other))
    if kind in ("NotEqual", "Equal") and len(args) == 2:
        x, other = args
        if isinstance(other, keras.KerasTensor) or not np.isscalar(other):
            return "only a comparison with a scalar"
        return CompareStep(op.name, name(x), out, kind == "Equal", np.asarray(other, dtype=x.dtype))
    if isinstance(op, SentencePooling):
        values = dict(zip(("hidden", "attention_mask", "prompt_length"), args),
                      **{k: v for k, v in kwargs.items() if k != "training"})
        if set(values) - {"hidden", "attention_mask", "prompt_length"} or "attention_mask" not in values:
            return "called with extra arguments"
        if len(values["hidden"].shape) != 3 or len(values["attention_mask"].shape) != 2:
            return "pooling other than (batch, length, features) over a (batch, length) mask"
        prompt = values.get("prompt_length")
        return PoolingStep(op.name, name(values["hidden"]), out, name(values["attention_mask"]),
                           None if prompt is None else name(prompt), tuple(op.modes))
    if kind == "Normalize" and len(args) == 1:
        if op.order != 2 or op.axis not in (-1, len(args[0].shape) - 1):
            return f"only the L2 norm of the last axis (received order={op.order}, axis={op.axis})"
        epsilon = keras.backend.epsilon() if op.epsilon is None else op.epsilon
        return NormalizeStep(op.name, name(args[0]), out, float(epsilon))
    if kind == "GetItem" and len(args) == 2:
        size = _truncation(args[1], len(args[0].shape))
        if size is not None:
            return TruncateStep(op.name, name(args[0]), out, size)
        key = _index_key(args[1])
        if key is None or len(key) != len(args[0].shape):
            return "only keys of ints and full slices"
        if not any(k is not None for k in key):
            return Step(op.name, name(args[0]), out)
        return GetItemStep(op.name, name(args[0]), out, key)
    return f"{kind} layer"


def read_encoder(model):
    """The `Encoder` of a built functional Keras model: its calls in order
    (each call's step, or its layer's name and why in `unsupported`), its
    inputs and its outputs (named as `model.output_names`)."""
    import keras

    names = {id(t): t.name for t in model.inputs}

    def name(tensor):
        return names.setdefault(id(tensor), f"{getattr(tensor, 'name', 'value')}:{len(names)}")

    steps, unsupported = [], []
    for depth in sorted(model._nodes_by_depth, reverse=True):
        for node in model._nodes_by_depth[depth]:
            op = node.operation
            if node.is_input or isinstance(op, keras.layers.InputLayer):
                continue
            step = _encoder_step(op, node, name)
            if isinstance(step, str):
                unsupported.append((op.name, step))
            else:
                steps.append(step)
    sizes = [(s.input, s.tokens.shape[0]) for s in steps if isinstance(s, EmbeddingStep)] + [
        (s.input, s.table.shape[0]) for s in steps if isinstance(s, LookupStep)]
    inputs = tuple(Tensor(t.name, t.dtype, tuple(t.shape), t.name,
                          min((n for v, n in sizes if v == t.name), default=None)) for t in model.inputs)
    outputs = tuple(Tensor(n, t.dtype, tuple(t.shape), name(t))
                    for t, n in zip(model.outputs, model.output_names))
    return Encoder(model.name, inputs, tuple(steps), outputs, _quantized(model), tuple(unsupported))
