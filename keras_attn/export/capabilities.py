"""What each direct writer covers, in one table over the model's description.

A decoder writer reads a `keras_attn.description.Decoder` (`model.describe()`),
an encoder writer an `Encoder` (`description.read_encoder(model)`). Each
row of `FEATURES` is one thing a model can have: how to find it in a
description (and name it, as the model's own option), the writers it
applies to and those that write it. `support(description, writer)` returns
None (covered) or the first reason the writer does not cover that model;
`check` raises it as a `NotFusableError`, which the exports' `writer="auto"`
turns into a fallback to the traced path with that reason in its warning
(`keras_attn.export.writers`).
`markdown_table(writers)` is the table the guides show (the decoder writers'
in docs/guides/generation.md, the encoder writers' in export_serving.md).

Adding a feature: the layer, the description, one row here (which writers
cover it), and each covering writer's emitter.
"""

import dataclasses
from typing import Callable

from keras_attn import description as description_lib


class NotFusableError(ValueError):
    """The model has a layer or setting the direct writer does not cover."""


# Writer key -> how messages name it.
WRITERS = {
    "onnx_genai": "fused decoder writer",
    "onnx_signatures": "direct ONNX signature writer",
    "litertlm": "direct TFLite writer",
    "tflite_signatures": "direct signatures writer",
    "onnx_encoder": "direct ONNX encoder writer",
    "tflite_encoder": "direct TFLite encoder writer",
}
ALL = frozenset(WRITERS)
ENCODERS = frozenset({"onnx_encoder", "tflite_encoder"})
DECODERS = ALL - ENCODERS
# Activations each writer has an emitter for: all of them but in the TFLite decoder writers.
ACTIVATIONS = {writer: ("silu", "relu", "tanh", "gelu", "gelu_tanh", "linear") for writer in WRITERS} | {
    writer: ("silu", "gelu", "gelu_tanh", "relu") for writer in ("litertlm", "tflite_signatures")}
# Writers that keep one cache stacked over the layers (a ring of the window
# when every layer has the same one): the signature writers.
STACKED_CACHE = frozenset({"onnx_signatures", "tflite_signatures"})


@dataclasses.dataclass(frozen=True)
class Feature:
    """`found(description, context)` -> None (absent) or the text naming it
    (the model's option and value); `covered`: the writers that write it,
    among those it `applies` to (whose description can have it)."""

    name: str
    found: Callable
    covered: frozenset
    applies: frozenset = ALL


def _per_layer(values, name, why):
    values = list(values)
    return f"{name}={values!r} ({why})" if len(set(values)) > 1 else None


def _first(items, test, text):
    """`text(item)` of the first of `items` that passes `test`, else None."""
    found = [item for item in items if test(item)]
    return text(found[0]) if found else None


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
    return _first([b.attention.rotary for b in d.layers], lambda r: r is not None and r.rotary_dim % 16,
                  lambda r: f"partial_rotary_factor={r.layer.partial_rotary_factor} rotates "
                            f"{r.rotary_dim} of {r.head_dim} features (GroupQueryAttention needs a multiple of 16)")


def _activation(d, context):
    """The feed-forwards' and (encoders) the dense steps' activations."""
    allowed = ACTIVATIONS[context["writer"]]
    named = [(b.name, b.feedforward) for b in d.layers] + [
        (s.name, s) for s in getattr(d, "steps", ()) if isinstance(s, description_lib.DenseStep)]
    return _first(named, lambda n: n[1].activation not in allowed,
                  lambda n: f"{n[0]}: activation={n[1].activation_repr!r}")


def _layer_feature(test, text):
    """A feature found on a layer (a decoder's or an encoder block's)."""
    return lambda d, c: _first(d.layers, test, lambda b: f"{b.name}: {text(b)}")


# Layer settings every writer writes, but the encoder writers the soft cap
# (`_ENCODERS_LACK`): (feature, found on a layer, the model's option that sets it).
_LAYER_SETTINGS = (
    ("RMSNorm", lambda b: "rms" in (getattr(b.attention_norm, "kind", None), b.feedforward_norm.kind),
     lambda b: "normalization='rms_norm'"),
    ("sandwich norms", lambda b: b.attention_post_norm or b.feedforward_post_norm,
     lambda b: "use_sandwich_norm=True"),
    ("QK-norm", lambda b: b.attention.query_norm, lambda b: "use_qk_norm=True"),
    ("rotary positions", lambda b: b.attention.rotary, lambda b: "a rotary_embedding"),
    ("sliding windows", lambda b: b.attention.window, lambda b: f"sliding_window={b.attention.window}"),
    ("grouped-query heads", lambda b: b.attention.num_key_value_heads != b.attention.num_heads,
     lambda b: f"num_key_value_heads={b.attention.num_key_value_heads} (num_heads={b.attention.num_heads})"),
    ("attention logit soft cap", lambda b: b.attention.logit_soft_cap,
     lambda b: f"logit_soft_cap={b.attention.logit_soft_cap}"),
    ("gated feed-forward", lambda b: b.feedforward.gate, lambda b: "use_gated_feedforward=True"),
)

_ENCODERS_LACK = ("attention logit soft cap",)
_EMBEDDING, _GET_ITEM = description_lib.EmbeddingStep, description_lib.GetItemStep
_LOOKUP = description_lib.LookupStep
_POOLING = description_lib.PoolingStep
# `SentencePooling` modes the encoder writers have an emitter for (as
# masked sums: the others need a max or weights over positions).
POOLING_MODES = ("cls", "lasttoken", "mean", "mean_sqrt_len_tokens")


FEATURES = (
    Feature("LoRA adapters kept apart (runtime inputs)", lambda d, c: c.get("adapters") and _first(
        [(l.name, dense) for l in d.layers for dense in description_lib.projections(l)],
        lambda n: n[1].lora is not None, lambda n: f"{n[0]}: a LoRA adapter on {n[1].name} (`enable_lora`)"),
        frozenset({"onnx_genai", "litertlm"}), DECODERS),
    Feature("layers quantized by Keras", lambda d, c: d.quantized and (
        f"layers quantized by Keras (`model.quantize({d.quantized[0]!r})`) are not read"
        "; export the float model with the export's own `quantization=`"), frozenset()),
    Feature("inputs other than int32 and float32, outputs other than float32", lambda d, c: _first(
        [("input", t) for t in d.inputs if t.dtype not in ("int32", "float32")]
        + [("output", t) for t in d.outputs if t.dtype != "float32"], bool,
        lambda k: f"{k[0]} {k[1].name} of dtype {k[1].dtype}"), frozenset(), ENCODERS),
    Feature("inputs other than (batch, length) or float (batch, length, features)", lambda d, c: _first(
        d.inputs, lambda t: len(t.shape) != 2 and (len(t.shape), t.dtype) != (3, "float32"),
        lambda t: f"input {t.name} of shape {t.shape} and dtype {t.dtype}"),
        frozenset({"onnx_encoder"}), ENCODERS),
    Feature("embeddings with mask_zero", lambda d, c: _first(
        d.steps, lambda s: isinstance(s, (_EMBEDDING, _LOOKUP)) and s.mask_zero,
        lambda s: f"{s.name}: mask_zero=True (id 0 as padding, a Keras mask)"), frozenset(), ENCODERS),
    Feature("sinusoidal embedding positions", lambda d, c: _first(
        d.steps, lambda s: isinstance(s, _EMBEDDING) and s.positions.kind != "learned",
        lambda s: f"{s.name}: position={s.positions.kind!r}"), frozenset(), ENCODERS),
    Feature("model options or calls not described", lambda d, c: d.unsupported and "; ".join(
        f"{key} ({what})" for key, what in d.unsupported), frozenset()),
    Feature("shared keys and values (Gemma 4)", lambda d, c: any(
        l.attention.key_value_source is not None for l in d.layers) and (
        f"key_value_sources={[l.attention.key_value_source for l in d.layers]!r} (layers attending "
        "over another layer's keys and values)"), frozenset(), DECODERS),
    Feature("per-layer inputs (Gemma 4)", lambda d, c: d.per_layer_input_dim and (
        f"per_layer_input_dim={d.per_layer_input_dim!r} (per-layer input embeddings)"), frozenset(),
        DECODERS),
    Feature("value norm", lambda d, c: any(l.attention.value_norm for l in d.layers) and (
        "use_value_norm=True (a norm of each value head)"), frozenset()),
    Feature("block output scale", lambda d, c: any(l.output_scale is not None for l in d.layers) and (
        "use_output_scale=True (a scale on each block's output)"), frozenset()),
    Feature("attention options not described", _layer_feature(
        lambda l: l.attention.unsupported, lambda l: "; ".join(f"{k} ({w})" for k, w in l.attention.unsupported)),
        frozenset()),
    Feature("gated attention", _layer_feature(lambda l: l.attention.gate, lambda l: "use_gate=True"), frozenset()),
    Feature("relative position bias", lambda d, c: d.positions.kind == "relative" and (
        "position='relative'"), frozenset(), DECODERS),
    Feature("learned or sinusoidal positions", lambda d, c: d.positions.kind in ("learned", "sinusoidal") and (
        f"position={d.positions.kind!r}"), frozenset({"onnx_signatures"}), DECODERS),
    Feature("LayerNorm", lambda d, c: d.normalization == "layer_norm" and (
        "normalization='layer_norm'"), frozenset({"onnx_signatures"}), DECODERS),
    *(Feature(name, _layer_feature(test, text), DECODERS if name in _ENCODERS_LACK else ALL)
      for name, test, text in _LAYER_SETTINGS),
    Feature("rotary scaling that depends on the length", _layer_feature(
        lambda l: l.attention.rotary is not None and (
            l.attention.rotary.layer.rope_scaling or {}).get("rope_type") in ("dynamic", "longrope"),
        lambda l: f"rope_scaling={l.attention.rotary.layer.rope_scaling!r} (its frequencies "
                  "depend on the call's length)"), frozenset(), ENCODERS),
    Feature("a norm over another axis than the last", _layer_feature(
        lambda l: not (getattr(l.attention_norm, "last_axis", True) and l.feedforward_norm.last_axis),
        lambda l: "a norm over another axis than the last"), frozenset()),
    Feature("dynamic NTK rotary scaling", lambda d, c: (d.positions.rope_scaling or {}).get(
        "rope_type") == "dynamic" and (
        "rope_scaling of type 'dynamic' (its frequencies depend on the call's length)"), frozenset(), DECODERS),
    Feature("LongRoPE past its original length", _longrope_past, frozenset(), DECODERS),
    Feature("head sizes per layer", lambda d, c: _per_layer(
        [l.attention.head_dim for l in d.layers], "head_dim", "caches of other shapes per layer"),
        frozenset({"litertlm"}), DECODERS),
    Feature("key/value heads per layer", lambda d, c: _per_layer(
        [l.attention.num_key_value_heads for l in d.layers], "num_key_value_heads",
        "caches of other shapes per layer"), frozenset({"litertlm"}), DECODERS),
    Feature("feed-forward widths per layer", lambda d, c: _per_layer(
        [l.feedforward.up.kernel.shape[1] for l in d.layers], "intermediate_dim", "one value per layer"),
        DECODERS - {"onnx_genai"}, DECODERS),
    Feature("head size not a multiple of 16", lambda d, c: _first(
        d.layers, lambda l: l.attention.head_dim % 16,
        lambda l: f"head_dim={l.attention.head_dim} (GroupQueryAttention needs a multiple of 16)"),
        DECODERS - {"onnx_genai"}, DECODERS),
    Feature("rotary width not a multiple of 16", lambda d, c: _rotary_width(d), DECODERS - {"onnx_genai"},
            DECODERS),
    # Found only when outside the writer's own list (ACTIVATIONS).
    Feature("activation", _activation, frozenset()),
    Feature("sentence pooling modes max and weightedmean", lambda d, c: _first(
        d.steps, lambda s: isinstance(s, _POOLING) and set(s.modes) - set(POOLING_MODES),
        lambda s: f"{s.name}: modes={s.modes!r} (the writers pool with {POOLING_MODES})"),
        frozenset(), ENCODERS),
    Feature("sentence pooling without the prompt's tokens", lambda d, c: _first(
        d.steps, lambda s: isinstance(s, _POOLING) and s.prompt_length is not None,
        lambda s: f"{s.name}: a prompt_length input (include_prompt=False)"), frozenset(), ENCODERS),
    Feature("negative indices", lambda d, c: _first(
        d.steps, lambda s: isinstance(s, _GET_ITEM) and any(k is not None and k < 0 for k in s.key),
        lambda s: f"{s.name}: key {s.key} (negative indices)"), frozenset({"onnx_encoder"}), ENCODERS),
    Feature("ring-buffer cache with position tables", lambda d, c: c["writer"] in STACKED_CACHE and _ring(
        d, c) and d.positions.kind != "rotary" and (
        f"position={d.positions.kind!r} with a ring-buffer cache (positions past max_length)"), frozenset(), DECODERS),
    Feature("ring-buffer cache with LongRoPE", lambda d, c: c["writer"] in STACKED_CACHE and _ring(
        d, c) and (d.positions.rope_scaling or {}).get("rope_type") == "longrope" and (
        "rope_scaling of type 'longrope' with a ring-buffer cache (its factors switch past the "
        "original length)"), frozenset(), DECODERS),
)


def describe(model, writer):
    """The description `writer` reads (`model.describe()` for a decoder writer,
    `description.read_encoder(model)` for an encoder writer), or
    `NotFusableError` when `model` is not a model that writer reads."""
    label = WRITERS[writer]
    if writer in ENCODERS:
        if not hasattr(model, "_nodes_by_depth") or not hasattr(model, "output_names"):
            raise NotFusableError(f"the {label} takes a functional Keras model, not {type(model).__name__}")
        return description_lib.read_encoder(model)
    if not callable(getattr(model, "describe", None)) or hasattr(model, "encode"):
        raise NotFusableError(f"the {label} takes a DecoderOnlyLM, not {type(model).__name__}")
    return model.describe()


def checked(model, writer, max_length=None, options=(), adapters=False):
    """`writer`'s description of `model` (`describe`) when `writer` covers it
    (a cache of `max_length`, when given; `adapters`: as `support`) and each
    of `options`, `(name, value, the values it writes)`; else
    `NotFusableError` naming the first option or feature it does not cover."""
    for name, value, written in options:
        if value not in written:
            raise NotFusableError(f"{name}={value!r} (the {WRITERS[writer]} writes {list(written)})")
    description = describe(model, writer)
    check(description, writer, max_length, adapters)
    return description


def support(description, writer, max_length=None, adapters=False):
    """None when `writer` covers the model `description` (a cache of
    `max_length`, when given; its LoRA adapters kept apart from the weights,
    with `adapters`: without, every writer writes them merged), else the
    first reason it does not."""
    if writer not in WRITERS:
        raise ValueError(f"Received an invalid value for argument `writer`, expected one of "
                         f"{sorted(WRITERS)}. Received: writer={writer!r}")
    if isinstance(description, description_lib.Encoder) != (writer in ENCODERS):
        kinds = ("an Encoder", "a Decoder") if writer in ENCODERS else ("a Decoder", "an Encoder")
        raise ValueError(f"The {WRITERS[writer]} reads {kinds[0]}, not {kinds[1]}. "
                         f"Received: writer={writer!r}")
    context = {"writer": writer, "max_length": max_length, "adapters": adapters}
    for feature in FEATURES:
        if writer not in feature.applies:
            continue
        found = feature.found(description, context)
        if found and writer not in feature.covered:
            return f"{found} is not covered by the {WRITERS[writer]}"
    return None


def check(description, writer, max_length=None, adapters=False):
    """Raises `NotFusableError` with `support`'s reason when `writer` does not cover it."""
    reason = support(description, writer, max_length, adapters)
    if reason is not None:
        raise NotFusableError(reason)


def markdown_table(writers=DECODERS):
    """The capability table of `writers` as Markdown: one column per writer,
    one row per feature that one of them does not cover (or the activations)."""
    names = [n for n in WRITERS if n in writers]
    lines = ["| feature | " + " | ".join(WRITERS[n] for n in names) + " |",
             "|---|" + "---|" * len(names)]
    for feature in FEATURES:
        if feature.name == "activation":
            cells = [", ".join(ACTIVATIONS[n]) for n in names]
        elif not any(n in feature.applies and n not in feature.covered for n in names):
            continue
        else:
            cells = ["yes" if n in feature.covered else "no" for n in names]
        lines.append(f"| {feature.name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
