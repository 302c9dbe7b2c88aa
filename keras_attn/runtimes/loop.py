"""The greedy loop an app runs next to an exported prefill/decode model.

The loop itself is NumPy around the two callables (a TFLite signature
runner, an onnxruntime session, a SavedModel signature), so an app can copy
it; `keras_attn.runtimes.signatures.greedy_loop` is the same function.
"""

import numpy as np

from keras_attn.generation import search

# With `step=True` the loop passes the cache's first `L` slots, `L` the filled
# slots rounded up to a multiple of this (the exports' read bucket,
# `keras_attn.runtimes.trace.READ_BUCKET`): a runtime that re-plans its
# buffers when an input's shape changes does so once per this many tokens.
STEP_BUCKET = 128


def greedy_loop(prefill, decode, prompt_ids, max_length, *, encoder_ids=None,
                stop_token_ids=(), pad_token_id=0, sliding_window=None, step=False):
    """Greedy decoding with two callables over NumPy dicts (any exported runtime).

    `prefill(**inputs)` and `decode(**inputs)` take and return dicts named as
    the signatures. NumPy only: this is the loop to copy into an app.

    Bad requests are refused with a ValueError before they reach the model
    where NumPy can tell (negative ids, wrong rank or dtype), and after a call
    whose `valid` output (TFLite / ONNX exports with `checks="flag"`) is
    False, e.g. an id >= the vocabulary size, which the artifact clamped.
    A callable that names its inputs (a LiteRT `SignatureRunner`, a
    SavedModel signature) and takes other names than these signatures' is
    refused with a ValueError listing the names it takes.

    The exported cache holds the `max_length` it was exported with, and
    `max_length` here may not exceed it (a ValueError): positions past a
    cache's end are dropped, which would give wrong tokens. A model exported
    with `sliding_window=W` has a ring-buffer cache of `W` slots that wraps,
    so any `max_length` works: pass `sliding_window=W` to say so.

    `step=True`: `decode` is a `decode_step` signature. The loop keeps the
    cache, passes its first `L` slots (the filled ones rounded up to
    `STEP_BUCKET`, at most the cache's) and writes the returned
    `new_cache` into slot `index`: a step then copies what the context
    holds, not the whole allocation (benchmarks/bench_long_context.py).
    """
    if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1:
        raise ValueError(
            "Received an invalid value for argument `max_length`, expected a "
            f"positive integer. Received: max_length={max_length!r}"
        )
    prompt_ids = _checked_ids("prompt_ids", prompt_ids)
    batch, width = prompt_ids.shape
    if not 1 <= width <= max_length:
        raise ValueError(
            "`prompt_ids` must be `(batch, prompt_width)` with 1 <= prompt_width "
            f"<= max_length={max_length}. Received: prompt_ids.shape={prompt_ids.shape}"
        )
    tokens = np.full((batch, max_length), pad_token_id, np.int32)
    tokens[:, :width] = prompt_ids
    in_prompt = np.zeros((batch, max_length), bool)
    in_prompt[:, :width] = prompt_ids != pad_token_id
    inputs = {"token_ids": prompt_ids}
    if encoder_ids is not None:
        inputs["encoder_ids"] = _checked_ids("encoder_ids", encoder_ids)
    out = _call(prefill, "prefill", inputs)
    vocab = out["logits"].shape[-1]
    for key, ids in inputs.items():
        name = "prompt_ids" if key == "token_ids" else key
        if ids.size and ids.max() >= vocab:
            raise ValueError(
                f"`{name}` must hold token ids in [0, vocabulary_size={vocab}) (the "
                f"logits' last axis). Received: max id {int(ids.max())}"
            )
    _check_valid(out, "prefill", inputs)
    state = {"cache": out["cache"]}
    if encoder_ids is not None:
        state["cross_cache"] = out["cross_cache"]
        state["encoder_padding_mask"] = out["encoder_padding_mask"]
    # cache: (num_layers, 2, batch, cache_length, kv_heads, head_dim)
    cache_length = out["cache"].shape[3]
    ring = sliding_window is not None and sliding_window == cache_length
    if cache_length < max_length and not ring:
        hint = ("" if sliding_window is None else
                f" (sliding_window={sliding_window} is not the cache length, so the "
                "cache is not a ring buffer)")
        raise ValueError(
            f"The exported cache holds {cache_length} positions, fewer than "
            f"max_length={max_length}{hint}: positions past its end would be "
            f"dropped. Export with `max_length` >= {max_length}, or pass "
            f"`sliding_window={cache_length}` if the model was exported with that "
            "sliding window (its cache is then a ring buffer that wraps). Received: "
            f"max_length={max_length}, cache shape={tuple(out['cache'].shape)}"
        )
    start = max(int(in_prompt.sum(1).min()), 1)
    if cache_length < max_length and start < width:
        # A ring-buffer cache (sliding window) cannot step back over the
        # prefilled prompt: start from an empty cache, feed prompts one by one.
        state["cache"] = np.zeros_like(out["cache"])
        start = 1
    if step and cache_length < max_length:
        raise ValueError(
            "`step=True` needs a cache of every position (a `decode_step` signature); "
            f"a ring-buffer cache of {cache_length} slots has none. Pass `decode` with "
            "step=False.")
    cache = np.array(out["cache"]) if step else None  # the loop's own, written in place
    done = np.zeros(batch, bool)
    for i in range(start, max_length):
        if done.all():
            break
        request = dict(token_ids=tokens[:, i - 1: i], index=np.array(i - 1, np.int32), **state)
        if step:
            slots = min(cache_length, -(-i // STEP_BUCKET) * STEP_BUCKET)
            request["cache"] = np.ascontiguousarray(cache[:, :, :, :slots])
            out = _check_valid(_call(decode, "decode_step", request), "decode_step", request)
            cache[:, :, :, i - 1: i] = out["new_cache"]
        else:
            out = _check_valid(_call(decode, "decode", request), "decode", request)
            state["cache"] = out["cache"]
        chosen = np.argmax(out["logits"][:, 0], axis=-1).astype(np.int32)
        chosen = np.where(done, pad_token_id, chosen)
        chosen = np.where(in_prompt[:, i], tokens[:, i], chosen)
        done |= ~in_prompt[:, i] & np.isin(chosen, stop_token_ids)
        tokens[:, i] = chosen
    return tokens


def input_names(fn):
    """The input names of an exported signature, where the callable tells
    them (a TFLite / LiteRT `SignatureRunner`, a SavedModel signature), else None."""
    details = getattr(fn, "get_input_details", None)
    if details is not None:
        return sorted(details())
    structured = getattr(fn, "structured_input_signature", None)
    if structured is not None:
        return sorted(structured[1])
    return None


def _call(fn, signature, inputs):
    """`fn(**inputs)`, refused with the names `fn` takes when they differ
    (the runtimes' own errors name one input: `Invalid Input name (tokens)
    for SignatureDef`)."""
    expected = input_names(fn)
    if expected is not None and sorted(inputs) != expected:
        raise ValueError(
            f"The `{signature}` callable takes inputs {expected}; greedy_loop feeds "
            f"{sorted(inputs)}, the names of keras_attn's prefill/decode exports "
            "(`keras_attn.runtimes.signatures`: `token_ids`, `cache`, `index`, and "
            "`encoder_ids`, `cross_cache`, `encoder_padding_mask` for encoder-decoder "
            "models). A LiteRT-LM bundle's model (`tokens`, `input_pos`, "
            "`kv_cache_*`) runs in `litert_lm.Engine` "
            "(`keras_attn.runtimes.litertlm.generate`); a model export's signature "
            "(`keras_attn.export`, e.g. a classifier's `tokens`) is not a generator.")
    return fn(**inputs)


def _checked_ids(name, ids):
    ids = search.as_token_ids(name, ids)
    ids = np.asarray(ids)
    if ids.size and ids.min() < 0:
        raise ValueError(
            f"`{name}` must hold token ids >= 0 (a negative id would wrap around the "
            f"vocabulary). Received: min id {int(ids.min())}"
        )
    if ids.size and ids.max() > np.iinfo(np.int32).max:
        raise ValueError(f"`{name}` holds ids past int32. Received: max id {int(ids.max())}")
    return ids.astype(np.int32)


def _check_valid(out, name, inputs):
    valid = out.get("valid")
    if valid is not None and not bool(np.all(valid)):
        index = inputs.get("index")
        raise ValueError(
            f"The exported `{name}` signature flagged the request invalid (valid=False): "
            "token ids outside [0, vocabulary_size), or `index` outside the cache. "
            f"Received: index={None if index is None else int(index)}, token_ids min/max="
            f"{int(inputs['token_ids'].min())}/{int(inputs['token_ids'].max())}"
        )
    return out
