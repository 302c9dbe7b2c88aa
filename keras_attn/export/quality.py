"""Quality measures: how closely an exported artifact's outputs match Keras's.

`verify.verify_artifact` records, per sample set, the figures these functions
compute (`quality_stats`, `argmax_matches`); `quality_of` and `agreement_of`
merge them over the sample sets, `quality_passes` checks one output against
its threshold and `quality_text` writes it. A float32 export is checked by its
max abs error alone (`verify.compare`); a quantized one by the measure of each
output (`MEASURES`, chosen by `auto_measures`).
"""

import numpy as np

from keras_attn.export.samples import output_names

MEASURES = ("argmax", "cosine", "relative_error")
"""How a quantized export's output is compared with Keras's.

- "argmax": the fraction of rows (every position of the last axis' leading
  axes) whose argmax equals Keras's: top-1 class, next token. Higher is
  better; checked as a minimum.
- "cosine": the cosine similarity of each row (a vector along the last
  axis: one token's hidden state, one sentence embedding) to Keras's;
  `value` is the smallest row's, `mean` the average. Higher is better;
  checked as a minimum. Rows that are zero in both are skipped.
- "relative_error": `||export - keras|| / ||keras||` over each sample set;
  `value` is the largest. Lower is better; checked as a maximum.

Rows at padded positions (zeros of an input named like "attention_mask",
see `padding_rows`) are left out of every measure.
"""

# Each quantization's default thresholds by measure (the minimum argmax
# agreement or cosine, the maximum relative error). "dynamic" is int8 weights
# with activations quantized at run time, in TFLite and ONNX alike. From
# measurements on a pretrained sentence encoder (all-MiniLM-L6-v2,
# benchmarks/RESULTS.md) and on the trained examples.
DEFAULT_THRESHOLDS = {
    None: {},
    "float16": {"argmax": 0.99, "cosine": 0.999, "relative_error": 0.05},
    "dynamic": {"argmax": 0.95, "cosine": 0.98, "relative_error": 0.2},
    "int8": {"argmax": 0.9, "cosine": 0.98, "relative_error": 0.2},
    "int16x8": {"argmax": 0.95, "cosine": 0.98, "relative_error": 0.2},
}

# A quantized model with no float output (nothing to measure) is checked
# with these absolute bounds instead.
FALLBACK_ATOL = {"float16": 1e-2, "dynamic": 0.25, "int8": 1.0, "int16x8": 0.25}

# Output names that say the last axis indexes classes or tokens.
_SCORE_NAME_PARTS = ("logit", "score", "prob", "class", "label")


def _output_layers(model):
    """The layer producing each model output, seen through pass-through layers."""
    layers = []
    for tensor in model.outputs:
        layer = tensor._keras_history.operation
        while type(layer).__name__ in ("Identity", "Dropout"):
            nodes = getattr(layer, "_inbound_nodes", None) or []
            inbound = nodes[0].input_tensors if nodes else []
            if len(inbound) != 1:
                break
            layer = inbound[0]._keras_history.operation
        layers.append(layer)
    return layers


def _is_softmax(layer):
    if type(layer).__name__ == "Softmax":
        return True
    activation = getattr(layer, "activation", None)
    return getattr(activation, "__name__", None) in ("softmax", "log_softmax")


def _vocabulary_sizes(model):
    """Vocabulary sizes of the model's embeddings, less any embedding width
    (a hidden state as wide as a vocabulary is still a hidden state)."""
    layers = list(model._flatten_layers(include_self=False))
    sizes = {getattr(layer, attr) for layer in layers
             for attr in ("input_dim", "vocabulary_size")
             if isinstance(getattr(layer, attr, None), int)
             and (attr == "vocabulary_size" or "Embedding" in type(layer).__name__)}
    widths = {getattr(layer, attr) for layer in layers
              for attr in ("output_dim", "embedding_dim")
              if "Embedding" in type(layer).__name__
              and isinstance(getattr(layer, attr, None), int)}
    return sizes - widths


def auto_measures(model):
    """The measure "auto" picks for each float output: `{name: measure}`.

    "argmax" when the last axis indexes classes or tokens: the output's name
    contains logit/score/prob/class/label, it comes out of a softmax, or its
    last axis is the size of one of the model's vocabularies (an LM head);
    "cosine" for other vectors (last axis > 1: embeddings, hidden states);
    "relative_error" for the rest (one number per row, scalars).
    """
    names = output_names(model)
    vocab = _vocabulary_sizes(model)
    measures = {}
    for name, tensor, layer in zip(names, model.outputs, _output_layers(model)):
        if "float" not in str(tensor.dtype):
            continue
        last = tensor.shape[-1] if len(tensor.shape) else None
        if last is not None and last > 1 and (
                any(part in name.lower() for part in _SCORE_NAME_PARTS)
                or _is_softmax(layer) or last in vocab):
            measures[name] = "argmax"
        elif last is None or last > 1:
            measures[name] = "cosine"
        else:
            measures[name] = "relative_error"
    return measures


def padding_rows(sample, ref):
    """Which rows of a `(batch, length, d)` output are real tokens, or None.

    Taken from an input whose name contains "mask" with shape `(batch,
    length)` (a Hugging Face `attention_mask`): its zeros are padding, whose
    hidden states nothing reads, so no measure counts them.
    """
    ref = np.asarray(ref)
    if ref.ndim != 3:
        return None
    for name, x in sample.items():
        x = np.asarray(x)
        if "mask" in name.lower() and x.shape == ref.shape[:2]:
            return x != 0
    return None


def _cosine_rows(ref, out, keep_rows=None):
    ref = np.asarray(ref, np.float64).reshape(-1, max(np.shape(ref)[-1:] or [1]))
    out = np.asarray(out, np.float64).reshape(ref.shape)
    nr, no = np.linalg.norm(ref, axis=-1), np.linalg.norm(out, axis=-1)
    keep = (nr > 0) | (no > 0)
    if keep_rows is not None:
        keep &= np.asarray(keep_rows).reshape(-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        cos = np.sum(ref * out, axis=-1) / (nr * no)
    cos = np.where(np.isfinite(cos), cos, 0.0)  # one side zero (or nan): no agreement
    return cos[keep]


def quality_stats(measure, ref, out, keep_rows=None):
    """One sample set's figures for one output: a dict merged by `merge_quality`.

    `keep_rows`: a boolean `(batch, length)` array of the rows to count (see
    `padding_rows`), or None for all.
    """
    if keep_rows is not None:
        keep = np.asarray(keep_rows)[..., None]
        ref, out = np.where(keep, ref, 0), np.where(keep, out, 0)
    if measure == "argmax":
        if keep_rows is not None:
            ref, out = np.asarray(ref)[keep_rows], np.asarray(out)[keep_rows]
        matched, total = _argmax_counts(ref, out)
        return {"matched": matched, "total": total}
    if measure == "cosine":
        cos = _cosine_rows(ref, out, keep_rows)
        return {"min": float(cos.min()) if cos.size else 1.0,
                "sum": float(cos.sum()), "rows": int(cos.size)}
    ref = np.asarray(ref, np.float64)
    diff = np.linalg.norm(np.asarray(out, np.float64) - ref)
    norm = np.linalg.norm(ref)
    err = float(diff / norm) if norm > 0 else (0.0 if diff == 0 else float("inf"))
    return {"max": err if np.isfinite(err) else float("inf"), "sum": err, "sets": 1}


def merge_quality(measure, stats, threshold):
    """`{"measure", "value", "mean", "threshold"}` of one output over every sample set."""
    if measure == "argmax":
        matched = sum(s["matched"] for s in stats)
        total = sum(s["total"] for s in stats)
        value = matched / total if total else None
        mean = value
    elif measure == "cosine":
        rows = sum(s["rows"] for s in stats)
        value = min(s["min"] for s in stats)
        mean = sum(s["sum"] for s in stats) / rows if rows else 1.0
    else:
        value = max(s["max"] for s in stats)
        mean = sum(s["sum"] for s in stats) / len(stats)
    return {"measure": measure, "value": value, "mean": mean, "threshold": threshold}


def quality_passes(q):
    if q["threshold"] is None or q["value"] is None:
        return True
    if q["measure"] == "relative_error":
        return q["value"] <= q["threshold"]
    return q["value"] >= q["threshold"]


def quality_text(name, q):
    """`last_hidden_state: cosine min 0.9968 (mean 0.9986) >= 0.99`."""
    if q["value"] is None:
        return f"{name}: {q['measure']} (no rows)"
    label = {"argmax": "argmax agreement", "cosine": "cosine min",
             "relative_error": "relative error"}[q["measure"]]
    text = f"{name}: {label} {q['value']:.4f}"
    if q["measure"] == "cosine":
        text += f" (mean {q['mean']:.4f})"
    if q["threshold"] is not None:
        text += f" {'<=' if q['measure'] == 'relative_error' else '>='} {q['threshold']:g}"
    return text


def quality_of(checks, measures, thresholds):
    """`{output name: {"measure", "value", "mean", "threshold"}}` over `checks`."""
    return {name: merge_quality(measure, [c["quality"][name] for c in checks],
                                thresholds.get(name))
            for name, measure in measures.items()}


def agreement_of(checks):
    """Fraction of argmax positions equal to Keras's over `checks`; None if there were none."""
    matched = sum(c["argmax_matches"][0] for c in checks)
    total = sum(c["argmax_matches"][1] for c in checks)
    return matched / total if total else None


def argmax_matches(reference, got):
    """`(matched, total)` argmax positions over the float outputs with a last axis > 1.

    `(0, 0)` when no output is a score vector (nothing to agree on).
    """
    counts = [_argmax_counts(ref, out) for ref, out in zip(reference, got)]
    return sum(m for m, _ in counts), sum(t for _, t in counts)


def _argmax_counts(ref, out):
    ref, out = np.asarray(ref), np.asarray(out)
    if ref.ndim < 1 or ref.shape[-1] < 2 or not np.issubdtype(ref.dtype, np.floating):
        return 0, 0
    same = np.argmax(ref, axis=-1) == np.argmax(out, axis=-1)
    return int(same.sum()), int(same.size)
