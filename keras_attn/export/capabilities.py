"""What each direct decoder writer covers, in one table over the model's description.

A writer reads a `keras_attn.description.Decoder` (`model.describe()`). Each
row of `FEATURES` is one thing a model can have: how to find it in a
description (and name it, as the model's own option) and the writers that
write it. `support(description, writer)` returns None (covered) or the first
reason the writer does not cover that model; `check` raises it as a
`NotFusableError`, which the exports' `writer="auto"` turns into a fallback
to the traced path with that reason in its warning (`keras_attn.export.writers`).
`markdown_table()` is the table docs/guides/export_serving.md shows.

Adding a decoder feature: the layer, `describe()`, one row here (which
writers cover it), and each covering writer's emitter.
"""

import dataclasses
from typing import Callable

from keras_attn.export.onnx_fused import NotFusableError

# Writer key -> how messages name it.
WRITERS = {
    "onnx_genai": "fused decoder writer",
    "onnx_signatures": "direct ONNX signature writer",
    "litertlm": "direct TFLite writer",
    "tflite_signatures": "direct signatures writer",
}
ALL = frozenset(WRITERS)
# Activations each writer has an emitter for.
ACTIVATIONS = {
    "onnx_genai": ("silu", "relu", "tanh", "gelu", "gelu_tanh", "linear"),
    "onnx_signatures": ("silu", "relu", "tanh", "gelu", "gelu_tanh", "linear"),
    "litertlm": ("silu", "gelu", "gelu_tanh", "relu"),
    "tflite_signatures": ("silu", "gelu", "gelu_tanh", "relu"),
}
# Writers that keep one cache stacked over the layers (a ring of the window
# when every layer has the same one): the signature writers.
STACKED_CACHE = frozenset({"onnx_signatures", "tflite_signatures"})


@dataclasses.dataclass(frozen=True)
class Feature:
    """`found(description, context)` -> None (absent) or the text naming it
    (the model's option and value); `covered`: the writers that write it."""

    name: str
    found: Callable
    covered: frozenset


def _per_layer(values, name, why):
    values = list(values)
    return f"{name}={values!r} ({why})" if len(set(values)) > 1 else None


def _first(d, test, text):
    for layer in d.layers:
        if test(layer):
            return text(layer)
    return None


def _longrope_past(d, context):
    scaling = d.positions.rope_scaling or {}
    if scaling.get("rope_type") != "longrope":
        return None
    max_length, original = context.get("max_length"), scaling["original_max_position_embeddings"]
    if max_length is None or max_length > original:
        return (f"rope_scaling of type 'longrope' with max_length={max_length} past "
                f"original_max_position_embeddings={original} (its factors switch with the call's length)")
    return None


def _ring(d, context):
    max_length = context.get("max_length")
    return max_length is not None and d.stacked_cache(max_length)[1]


def _rotary_width(d):
    for layer in d.layers:
        rotary = layer.attention.rotary
        if rotary is not None and rotary.rotary_dim % 16:
            return (f"partial_rotary_factor={rotary.layer.partial_rotary_factor} rotates "
                    f"{rotary.rotary_dim} of {rotary.head_dim} features (GroupQueryAttention "
                    "needs a multiple of 16)")
    return None


def _activation(d, context):
    allowed = ACTIVATIONS[context["writer"]]
    return _first(d, lambda l: l.feedforward.activation not in allowed,
                  lambda l: f"activation={l.feedforward.activation_repr!r}")


FEATURES = (
    Feature("layers quantized by Keras", lambda d, c: d.quantized and (
        f"layers quantized by Keras (`model.quantize({d.quantized[0]!r})`) are not read"
        "; export the float model with the export's own `quantization=`"), frozenset()),
    Feature("model options not described", lambda d, c: d.unsupported and "; ".join(
        f"{key} ({what})" for key, what in d.unsupported), frozenset()),
    Feature("shared keys and values (Gemma 4)", lambda d, c: any(
        l.attention.key_value_source is not None for l in d.layers) and (
        f"key_value_sources={[l.attention.key_value_source for l in d.layers]!r} (layers attending "
        "over another layer's keys and values)"), frozenset()),
    Feature("per-layer inputs (Gemma 4)", lambda d, c: d.per_layer_input_dim and (
        f"per_layer_input_dim={d.per_layer_input_dim!r} (per-layer input embeddings)"), frozenset()),
    Feature("value norm", lambda d, c: any(l.attention.value_norm for l in d.layers) and (
        "use_value_norm=True (a norm of each value head)"), frozenset()),
    Feature("block output scale", lambda d, c: any(l.output_scale is not None for l in d.layers) and (
        "use_output_scale=True (a scale on each block's output)"), frozenset()),
    Feature("attention options not described", lambda d, c: _first(
        d, lambda l: l.attention.unsupported,
        lambda l: f"{l.name}: " + "; ".join(f"{k} ({w})" for k, w in l.attention.unsupported)), frozenset()),
    Feature("gated attention", lambda d, c: _first(
        d, lambda l: l.attention.gate, lambda l: f"{l.name}: use_gate=True"), frozenset()),
    Feature("relative position bias", lambda d, c: d.positions.kind == "relative" and (
        "position='relative'"), frozenset()),
    Feature("learned or sinusoidal positions", lambda d, c: d.positions.kind in ("learned", "sinusoidal") and (
        f"position={d.positions.kind!r}"), frozenset({"onnx_signatures"})),
    Feature("LayerNorm", lambda d, c: d.normalization == "layer_norm" and (
        "normalization='layer_norm'"), frozenset({"onnx_signatures"})),
    Feature("a norm over another axis than the last", lambda d, c: _first(
        d, lambda l: not (l.attention_norm.last_axis and l.feedforward_norm.last_axis),
        lambda l: f"{l.name}: a norm over another axis than the last"), frozenset()),
    Feature("dynamic NTK rotary scaling", lambda d, c: (d.positions.rope_scaling or {}).get(
        "rope_type") == "dynamic" and (
        "rope_scaling of type 'dynamic' (its frequencies depend on the call's length)"), frozenset()),
    Feature("LongRoPE past its original length", _longrope_past, frozenset()),
    Feature("head sizes per layer", lambda d, c: _per_layer(
        [l.attention.head_dim for l in d.layers], "head_dim", "caches of other shapes per layer"),
        frozenset({"litertlm"})),
    Feature("key/value heads per layer", lambda d, c: _per_layer(
        [l.attention.num_key_value_heads for l in d.layers], "num_key_value_heads",
        "caches of other shapes per layer"), frozenset({"litertlm"})),
    Feature("feed-forward widths per layer", lambda d, c: _per_layer(
        [l.feedforward.up.kernel.shape[1] for l in d.layers], "intermediate_dim", "one value per layer"),
        ALL - {"onnx_genai"}),
    Feature("head size not a multiple of 16", lambda d, c: _first(
        d, lambda l: l.attention.head_dim % 16,
        lambda l: f"head_dim={l.attention.head_dim} (GroupQueryAttention needs a multiple of 16)"),
        ALL - {"onnx_genai"}),
    Feature("rotary width not a multiple of 16", lambda d, c: _rotary_width(d), ALL - {"onnx_genai"}),
    # Found only when outside the writer's own list (ACTIVATIONS).
    Feature("activation", _activation, frozenset()),
    Feature("ring-buffer cache with position tables", lambda d, c: c["writer"] in STACKED_CACHE and _ring(
        d, c) and d.positions.kind != "rotary" and (
        f"position={d.positions.kind!r} with a ring-buffer cache (positions past max_length)"), frozenset()),
    Feature("ring-buffer cache with LongRoPE", lambda d, c: c["writer"] in STACKED_CACHE and _ring(
        d, c) and (d.positions.rope_scaling or {}).get("rope_type") == "longrope" and (
        "rope_scaling of type 'longrope' with a ring-buffer cache (its factors switch past the "
        "original length)"), frozenset()),
)


def describe(model, writer):
    """`model.describe()`, or `NotFusableError` when `model` is not a model
    the decoder writers read."""
    label = WRITERS[writer]
    if not callable(getattr(model, "describe", None)) or hasattr(model, "encode"):
        raise NotFusableError(f"the {label} takes a DecoderOnlyLM, not {type(model).__name__}")
    return model.describe()


def support(description, writer, max_length=None):
    """None when `writer` covers the model `description` (a cache of
    `max_length`, when given), else the first reason it does not."""
    if writer not in WRITERS:
        raise ValueError(f"Received an invalid value for argument `writer`, expected one of "
                         f"{sorted(WRITERS)}. Received: writer={writer!r}")
    context = {"writer": writer, "max_length": max_length}
    for feature in FEATURES:
        found = feature.found(description, context)
        if found and writer not in feature.covered:
            return f"{found} is not covered by the {WRITERS[writer]}"
    return None


def check(description, writer, max_length=None):
    """Raises `NotFusableError` with `support`'s reason when `writer` does not cover it."""
    reason = support(description, writer, max_length)
    if reason is not None:
        raise NotFusableError(reason)


def markdown_table():
    """The capability table as Markdown: one row per feature, one column per writer."""
    names = list(WRITERS)
    lines = ["| feature | " + " | ".join(WRITERS[n] for n in names) + " |",
             "|---|" + "---|" * len(names)]
    for feature in FEATURES:
        if feature.name == "activation":
            cells = [", ".join(ACTIVATIONS[n]) for n in names]
        else:
            cells = ["yes" if n in feature.covered else "no" for n in names]
        lines.append(f"| {feature.name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
