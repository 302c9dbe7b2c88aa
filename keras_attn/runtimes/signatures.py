"""Export cached generation: prefill/decode (and generate) signatures.

The functions are the shared trace's (`keras_attn.runtimes.trace`) with this
contract's names, a stacked cache and the request checks (the direct TFLite
writer writes the same contract op by op).

- SavedModel with signatures `prefill`, `decode` (cache in, cache out),
  `decode_step` (the caller keeps the cache) and a one-call greedy
  `generate` for TF Serving.
- TFLite multi-signature model (`prefill`, `decode`, `decode_step`; builtin
  ops only) for
  `Interpreter.get_signature_runner`: written from the Keras weights by
  `keras_attn.export.tflite_signatures` where that covers the model, else
  TensorFlow's converter over the trace (`tflite_bytes`' `writer`).
- ONNX `prefill.onnx`, `decode.onnx` and `decode_step.onnx` for any ONNX runtime: written from
  the Keras weights in standard ops (`keras_attn.export.onnx_signatures`,
  both models' weights once, in one external data file beside them), or,
  for what that writer does not cover (encoder-decoder models, Gemma 4's
  per-layer caches, relative positions), converted with tf2onnx.

Signatures (decoder-only; encoder-decoder models add the marked parts):

    prefill(token_ids: int32 (B, P) [, encoder_ids: int32 (B, T_enc)])
        -> logits (B, P, V), cache (N, 2, B, max_length, H_kv, D)
           [, cross_cache (N, 2, B, T_enc, H_kv, D), encoder_padding_mask bool (B, T_enc)]
    decode(token_ids: int32 (B, 1), cache, index: int32 scalar
           [, cross_cache, encoder_padding_mask])
        -> logits (B, 1, V), cache
    decode_step(token_ids: int32 (B, 1), cache[:, :, :, :L], index: int32 scalar
                [, cross_cache, encoder_padding_mask])
        -> logits (B, 1, V), new_cache (N, 2, B, 1, H_kv, D)
    generate(prompt_ids: int32 (B, P) [, encoder_ids]) -> tokens int32 (B, max_length)

`decode_step` is `decode` for a caller that keeps the cache: it takes the
first `L` slots (any `L` with `index < L <= max_length`; a dynamic axis in
every format, which a LiteRT runner resizes) and returns the keys and values
of position `index`, which the caller writes into slot `index`. The cache
then crosses the call boundary once per step at the size the context holds,
where `decode` copies the whole allocation in and out: at a fill of 128 a
step costs the same at `max_length` 512 and 4096
(benchmarks/bench_long_context.py). `greedy_loop(..., step=True)` drives it.
A model whose cache is a ring buffer (one window on every layer) has no
`decode_step`: its cache is the window already.

`index` is the position of `token_ids` (prefill writes positions [0, P)).
A greedy loop over these reproduces `greedy_search` token for token: feed the
token at position `i - 1` with `index = i - 1` and take the argmax for `i`,
starting at the shortest prompt length and keeping prompt tokens while a
row's (right-padded) prompt lasts. `index` must stay below the cache length
(the export's `max_length`), except for a sliding-window model, whose cache
is a ring buffer that wraps; `greedy_loop` checks this.

A model whose layers' caches differ in key/value heads or head size
(`DecoderOnlyLM` with `head_dim` / `num_key_value_heads` per layer, Gemma 4)
stacks them padded with zeros to the largest `H_kv` and `D`: layer `i` reads
`cache[i, :, :, :, :H_i, :D_i]` and the padding is never read. (LiteRT-LM
bundles and GenAI folders have one cache per layer, unpadded.)

Bad requests (docs/guides/serving_validation.md has the measured table):

- SavedModel (`checks="assert"`): `prefill`, `decode` and `generate` check at
  run time that token ids are in `[0, vocabulary_size)`, that `index` is in
  `[0, max_length)` (`>= 0` for a ring-buffer cache) and that the prompt
  holds 1 to `max_length` tokens; a bad request raises InvalidArgumentError
  (TF Serving: INVALID_ARGUMENT) whose message names the argument.
- TFLite and ONNX (`checks="flag"`: asserts are not builtin ops): token ids
  and `index` are clamped into range, so no request can read or write out of
  bounds, and an extra output `valid` (bool scalar) is False when anything
  was clamped: the logits and cache of that call are then meaningless.
  `greedy_loop` raises a ValueError on `valid=False`.
"""

import os
import shutil
import tempfile

import tensorflow as tf

from keras_attn.checks import check_choice
from keras_attn.export import onnx_graph
from keras_attn.export import onnx_signatures
from keras_attn.export import tflite_decoder
from keras_attn.export import tflite_signatures
from keras_attn.export.onnx import rename_value
from keras_attn.export.saved_model import SERVING_SAVE_OPTIONS, graph_op_types
from keras_attn.export.staging import release_memory, staged
from keras_attn.export.tflite import tflite_op_names
from keras_attn.export.writers import check_writer, direct_or_none
from keras_attn.generation import cache as cache_lib
from keras_attn.generation import search
from keras_attn.runtimes import request_checks, verification
from keras_attn.runtimes.loop import greedy_loop  # noqa: F401  (public here too)
from keras_attn.runtimes.tflite_convert import GENERATION_QUANTIZATIONS, signatures_to_tflite
from keras_attn.runtimes import trace as decoder_trace
from keras_attn.runtimes.trace import DecoderTrace, cache_storage_dtype


def _check_arguments(model, max_length, checks, allowed, encoder_length=None):
    if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 2:
        raise ValueError(
            "Received an invalid value for argument `max_length`, expected an "
            f"integer >= 2. Received: max_length={max_length!r}"
        )
    if checks not in allowed:
        raise ValueError(
            f"Received an invalid value for argument `checks`, expected one of "
            f"{list(allowed)}. Received: checks={checks!r}"
        )
    # Under XLA a position past a learned table would be clamped silently.
    search.check_max_positions(model, max_length, encoder_length)


def signature_functions(model, *, max_length, batch_size=None, prompt_length=None,
                        encoder_length=None, stop_token_ids=(), pad_token_id=0,
                        checks="none", cache_dtype="float32", update_slices=False):
    """`{"prefill", "decode", "generate", "decode_step"}` tf.functions with input
    signatures (no `decode_step` for a ring-buffer cache; the module docstring
    has the contract).

    Leave `batch_size`/`prompt_length`/`encoder_length` None for dynamic axes
    (SavedModel, ONNX); give them for TFLite, whose inputs are static.
    `checks` validates each request at run time (see the module docstring):
    "assert" (SavedModel), "flag" (TFLite / ONNX: clamps and adds a `valid`
    output to `prefill` and `decode`) or "none".
    `max_length` (and `encoder_length`) may not exceed `model.max_positions`
    when the model has one (a learned position table): a ValueError here,
    because an exported loop compiled with XLA would clamp the positions.
    `cache_dtype="float16"` carries the caches (`cache`, `cross_cache`) in
    float16 between calls: half the memory per token; each call computes in
    float32 and rounds the keys and values it stores.
    `decode` reads only the filled part of the cache (rounded up to
    `keras_attn.runtimes.trace.READ_BUCKET` slots), so a step costs what the context holds;
    `update_slices=True` (TFLite) also writes its one slot with
    `DYNAMIC_UPDATE_SLICE` instead of a select over every slot.
    """
    cache_storage_dtype(cache_dtype)  # checked first, before the model is read
    _check_arguments(model, max_length, checks, request_checks.CHECKS, encoder_length)
    trace = DecoderTrace(model, max_length=max_length, cache_dtype=cache_dtype,
                         read_bucket=decoder_trace.READ_BUCKET, update_slices=update_slices)
    vocab, positions = trace.vocabulary_size, trace.max_positions
    layers, store = trace.num_layers, trace.cache_dtype
    # Caches of other shapes per layer are stacked padded to the largest.
    heads = max(h for h, _ in trace.layer_cache_shapes)
    size = max(d for _, d in trace.layer_cache_shapes)

    def spec(length, name):  # a stacked cache: (num_layers, 2, B, S, H_kv, D)
        return tf.TensorSpec((layers, 2, batch_size, length, heads, size), store, name=name)

    def stack(c):
        if trace.uniform:
            return cache_lib.stack_cache(c)
        return tf.stack([tf.stack([tf.pad(t, [[0, 0], [0, 0], [0, heads - t.shape[2]],
                                              [0, size - t.shape[3]]]) for t in layer["self_attention"]])
                         for layer in c])

    def unstack(stacked, cross):
        c = cache_lib.unstack_cache(stacked, cross)
        if trace.uniform:
            return c
        return [{**layer, "self_attention": tuple(t[:, :, :h, :d] for t in layer["self_attention"])}
                for layer, (h, d) in zip(c, trace.layer_cache_shapes)]

    ids = tf.TensorSpec((batch_size, prompt_length), tf.int32, name="token_ids")
    enc_ids = tf.TensorSpec((batch_size, encoder_length), tf.int32, name="encoder_ids")
    step = tf.TensorSpec((batch_size, 1), tf.int32, name="token_ids")
    # A sliding-window model's cache is a ring buffer shorter than max_length.
    cache = spec(trace.cache_length, "cache")
    step_cache = spec(None, "cache")  # decode_step: the first L slots
    cross = spec(encoder_length, "cross_cache")
    enc_mask = tf.TensorSpec((batch_size, encoder_length), tf.bool, name="encoder_padding_mask")
    index = tf.TensorSpec((), tf.int32, name="index")
    stops = tuple(int(t) for t in stop_token_ids)
    flag = checks == "flag"

    def _check_inputs(check, name, ids, encoder_ids):
        ids = check.token_ids(name, ids, vocab)
        ids = check.length(name, ids, 1, max_length, f"max_length={max_length}")
        if encoder_ids is not None:
            encoder_ids = check.token_ids("encoder_ids", encoder_ids, vocab)
            encoder_ids = check.length("encoder_ids", encoder_ids, 1, positions or 2**31 - 1,
                                       f"model.max_positions={positions}")
        return ids, encoder_ids

    def _prefill(token_ids, encoder_ids=None):
        check = request_checks.Checks(checks, "prefill")
        token_ids, encoder_ids = _check_inputs(check, "token_ids", token_ids, encoder_ids)
        logits, c, mask = trace.prefill(token_ids, encoder_ids)
        out = {"logits": logits, "cache": trace.store(stack(c))}
        if encoder_ids is not None:
            out["cross_cache"] = trace.store(cache_lib.stack_cache(c, "cross_attention"))
            out["encoder_padding_mask"] = mask
        if flag:
            out["valid"] = check.valid()
        return out

    def _decode(token_ids, cache, index, cross_cache=None, encoder_padding_mask=None):
        check = request_checks.Checks(checks, "decode")
        token_ids = check.token_ids("token_ids", token_ids, vocab)
        index = check.index(index, trace.cache_length, trace.ring)
        c = unstack(trace.load(cache), trace.load(cross_cache))
        logits, c = trace.decode(token_ids, c, index, encoder_padding_mask=encoder_padding_mask)
        out = {"logits": logits, "cache": trace.store(stack(c))}
        if flag:
            out["valid"] = check.valid()
        return out

    def _decode_step(token_ids, cache, index, cross_cache=None, encoder_padding_mask=None):
        check = request_checks.Checks(checks, "decode_step")
        token_ids = check.token_ids("token_ids", token_ids, vocab)
        index = check.index(index, tf.shape(cache)[3], False)
        c = unstack(trace.load(cache), trace.load(cross_cache))
        logits, c = trace.decode(token_ids, c, index, encoder_padding_mask=encoder_padding_mask)
        # The slot written, (N, 2, B, 1, H_kv, D); what the caller keeps is not copied back.
        new = [{**layer, "self_attention": tuple(t[:, index:index + 1] for t in layer["self_attention"])}
               for layer in c]
        out = {"logits": logits, "new_cache": trace.store(stack(new))}
        if flag:
            out["valid"] = check.valid()
        return out

    def _generate(prompt_ids, encoder_ids=None):
        check = request_checks.Checks("assert" if checks == "assert" else "none", "generate")
        prompt_ids, encoder_ids = _check_inputs(check, "prompt_ids", prompt_ids, encoder_ids)
        tokens = search.decode_loop(
            model, prompt_ids, encoder_ids, max_length, stops, pad_token_id,
            lambda logits, i: tf.argmax(logits, axis=-1),
        )
        return {"tokens": tokens}

    prompt = tf.TensorSpec((batch_size, prompt_length), tf.int32, name="prompt_ids")
    if trace.seq2seq:
        prefill = tf.function(lambda token_ids, encoder_ids: _prefill(token_ids, encoder_ids),
                              input_signature=[ids, enc_ids])
        decode = tf.function(
            lambda token_ids, cache, index, cross_cache, encoder_padding_mask: _decode(
                token_ids, cache, index, cross_cache, encoder_padding_mask),
            input_signature=[step, cache, index, cross, enc_mask])
        decode_step = tf.function(
            lambda token_ids, cache, index, cross_cache, encoder_padding_mask: _decode_step(
                token_ids, cache, index, cross_cache, encoder_padding_mask),
            input_signature=[step, step_cache, index, cross, enc_mask])
        generate = tf.function(lambda prompt_ids, encoder_ids: _generate(prompt_ids, encoder_ids),
                               input_signature=[prompt, enc_ids])
    else:
        prefill = tf.function(lambda token_ids: _prefill(token_ids), input_signature=[ids])
        decode = tf.function(lambda token_ids, cache, index: _decode(token_ids, cache, index),
                             input_signature=[step, cache, index])
        decode_step = tf.function(lambda token_ids, cache, index: _decode_step(token_ids, cache, index),
                                  input_signature=[step, step_cache, index])
        generate = tf.function(lambda prompt_ids: _generate(prompt_ids), input_signature=[prompt])
    functions = {"prefill": prefill, "decode": decode, "generate": generate}
    if not trace.ring:  # a ring holds its window's slots already
        functions["decode_step"] = decode_step
    return functions


def _module(model, functions):
    module = tf.Module()
    # Track the weights, not the Keras model: saving a subclassed Keras model
    # also traces Keras's default `serving_default`, which feeds it float32
    # inputs (`Model.input_dtype`), and token ids must be integers.
    module.model_variables = [getattr(v, "value", v) for v in model.variables]
    for name, fn in functions.items():
        setattr(module, name, fn)
    return module


def _numpy_runner(fn):
    """A SavedModel signature as a callable over NumPy dicts."""
    def run(**kwargs):
        outputs = fn(**{k: tf.constant(v) for k, v in kwargs.items()})
        return {k: v.numpy() for k, v in outputs.items()}

    return run


def export_saved_model(model, path, *, max_length, stop_token_ids=(), pad_token_id=0,
                       include_generate=True, checks="assert"):
    """Writes a SavedModel with `prefill`, `decode` (and `generate`) signatures.

    With `checks="assert"` (the default) a request with token ids outside
    `[0, vocabulary_size)`, an `index` outside `[0, max_length)` or a prompt
    longer than `max_length` raises InvalidArgumentError naming the argument
    (TF Serving answers INVALID_ARGUMENT); "none" leaves the checks out
    (benchmarks/bench_serving.py measures what they cost).

    Returns:
        A `SignatureReport` (`keras_attn.runtimes.verification`): the saved
        `prefill`, `decode` and `decode_step` run over a random sequence
        against the Keras model's logits (a `ParityError` beyond 1e-4 of the
        largest logit, and nothing is left at `path`). `os.fspath(report)`
        is the SavedModel's folder, so `tf.saved_model.load(report)` works.
        The check holds one copy of the weights: it runs the functions that
        were saved (over the model's own variables) and compares each
        variable in the written checkpoint with the model's, one at a time,
        and the written signature names with these; loading the folder back
        would restore every weight a second time (5 GB at Llama-3.2-1B).
    """
    fns = signature_functions(model, max_length=max_length, stop_token_ids=stop_token_ids,
                              pad_token_id=pad_token_id, checks=checks)
    if not include_generate:
        fns.pop("generate")
    module = _module(model, fns)
    signatures = {name: fn.get_concrete_function() for name, fn in fns.items()}
    with staged(os.fspath(path), "path") as tmp:
        tf.saved_model.save(module, tmp, signatures=signatures, options=SERVING_SAVE_OPTIONS)
        _check_written(tmp, module.model_variables, signatures)
        step = signatures.get("decode_step")
        verified = verification.verify_prefill_decode(
            "saved_model", model, _numpy_runner(signatures["prefill"]),
            _numpy_runner(signatures["decode"]), max_length=max_length,
            decode_step=None if step is None else _numpy_runner(step))
    ops = sorted({op for fn in signatures.values() for op in graph_op_types(fn)})
    return verification.signature_report(
        "saved_model", path, verified, ops=ops,
        details={"signatures": sorted(signatures), "max_length": max_length, "checks": checks})


def _check_written(path, variables, signatures):
    """The SavedModel at `path` names `signatures` and holds each of
    `variables` (`_module`'s `model_variables`) bit for bit, read one at a
    time; a `ParityError` otherwise."""
    import numpy as np
    from tensorflow.core.protobuf import saved_model_pb2

    from keras_attn.export.report import ParityError

    saved = saved_model_pb2.SavedModel()
    with open(os.path.join(path, "saved_model.pb"), "rb") as f:
        saved.ParseFromString(f.read())
    missing = sorted(set(signatures) - set(saved.meta_graphs[0].signature_def))
    if missing:
        raise ParityError(f"The written SavedModel lacks the signatures {missing}; nothing was written.")
    reader = tf.train.load_checkpoint(os.path.join(path, "variables", "variables"))
    for i, variable in enumerate(variables):
        stored = reader.get_tensor(f"model_variables/{i}/.ATTRIBUTES/VARIABLE_VALUE")
        if not np.array_equal(stored, variable.numpy()):
            raise ParityError(
                f"The written SavedModel holds another value of `{variable.name}` than the model "
                f"(variable {i}); nothing was written.")


def tflite_bytes(model, *, max_length, batch_size, prompt_length, encoder_length=None,
                 checks="flag", quantization=None, cache_dtype="float32", writer="auto"):
    """A TFLite flatbuffer with `prefill` and `decode` signatures, builtin ops only.

    With `checks="flag"` (the default) token ids and `index` are clamped into
    range and both signatures have a bool output `valid`, False for a bad
    request (see the module docstring); "none" trusts the caller.
    `quantization`: None (float32), "float16" (float16 weights), "dynamic"
    (int8 weights with LiteRT's hybrid kernels) or "int4" (see
    `tflite_convert.signatures_to_tflite`); `cache_dtype`: "float32" or
    "float16" (see `signature_functions`). benchmarks/bench_decode_quantized.py
    measures speed, size and greedy agreement of each.
    `writer`: "auto" (default) writes the model from the Keras weights
    (`keras_attn.export.tflite_signatures`: one weight in memory at a time;
    a decoder-only `DecoderOnlyLM`, float32 or "dynamic" weights, float32
    cache) where that covers the model and options, else traces it and runs
    TensorFlow's converter, with a warning naming why (encoder-decoder
    models: silently); "direct" (a `NotFusableError` where it does not
    cover them) or "traced" (the converter; "converter" is deprecated).
    """
    return _tflite_content(model, max_length=max_length, batch_size=batch_size,
                           prompt_length=prompt_length, encoder_length=encoder_length, checks=checks,
                           quantization=quantization, cache_dtype=cache_dtype, writer=writer)[0]


def _tflite_content(model, *, max_length, batch_size, prompt_length, encoder_length, checks,
                    quantization, cache_dtype, writer):
    """`(flatbuffer bytes, the writer that wrote it: "direct" or "converter")`."""
    if checks not in ("flag", "none"):
        raise ValueError(
            "Received an invalid value for argument `checks`, expected 'flag' or "
            f"'none' (TFLite has no assert op). Received: checks={checks!r}"
        )
    writer = check_writer(writer, ("converter",))
    seq2seq = hasattr(model, "encode")
    if seq2seq and encoder_length is None:
        raise ValueError(
            "Encoder-decoder models need a static `encoder_length` for TFLite. "
            "Received: encoder_length=None"
        )
    if seq2seq and writer == "auto":
        writer = "traced"  # the direct writer is decoder-only: no news
    if writer != "traced":
        # The trace's argument checks, before the direct writer reads the model.
        cache_storage_dtype(cache_dtype)
        check_choice("quantization", quantization, GENERATION_QUANTIZATIONS)
        _check_arguments(model, max_length, checks, ("flag", "none"), encoder_length)
    content, _ = direct_or_none(
        writer, lambda: tflite_decoder.written_bytes(
            tflite_signatures.write_signatures_tflite, model, max_length=max_length, batch_size=batch_size,
            prompt_length=prompt_length, checks=checks, quantization=quantization, cache_dtype=cache_dtype,
            read_bucket=decoder_trace.READ_BUCKET),
        what=f"The TFLite prefill/decode export of `{model.name}`",
        direct_name="direct TFLite writer", traced_name="TensorFlow's TFLite converter")
    if content is not None:
        return content, "direct"
    fns = signature_functions(model, max_length=max_length, batch_size=batch_size,
                              prompt_length=prompt_length, encoder_length=encoder_length,
                              checks=checks, cache_dtype=cache_dtype, update_slices=True)
    fns.pop("generate")
    return signatures_to_tflite(fns, quantization), "converter"


def export_tflite(model, path, **kwargs):
    """Writes `tflite_bytes(model, **kwargs)` to `path`.

    Returns:
        A `SignatureReport`: the model's `prefill` and `decode`, run in
        LiteRT (its builtin kernels) over a random sequence (the static
        batch and prompt shapes) before writing, against the Keras model's
        logits: float32 within 1e-4 of the largest logit (a `ParityError`
        otherwise, and nothing is written); quantized weights or a float16
        cache: the share of next tokens equal to Keras's is reported
        (`agreement`), not checked. `os.fspath(report)` is `path`.
    """
    from ai_edge_litert import interpreter as litert

    arguments = dict(encoder_length=None, checks="flag", quantization=None, cache_dtype="float32",
                     writer="auto")
    arguments.update(kwargs)
    content, writer = _tflite_content(model, **arguments)
    # LiteRT's builtin kernels: the XNNPACK delegate would pack a copy of
    # the weights for each signature (the Llama-3.2-1B float32 model's 5 GB
    # twice, benchmarks/RESULTS.md), the check is of the same graph. int4
    # blocks run on XNNPACK: the builtin blockwise kernel is a scalar loop
    # (minutes at 0.5B, as for the LiteRT-LM bundles).
    resolver = ({} if arguments["quantization"] == "int4" else
                dict(experimental_op_resolver_type=litert.OpResolverType.BUILTIN_WITHOUT_DEFAULT_DELEGATES))
    interpreter = litert.Interpreter(model_content=content, **resolver)
    step = (interpreter.get_signature_runner("decode_step")
            if "decode_step" in interpreter.get_signature_list() else None)
    verified = verification.verify_prefill_decode(
        "tflite", model, interpreter.get_signature_runner("prefill"),
        interpreter.get_signature_runner("decode"), max_length=kwargs["max_length"],
        decode_step=step,
        batch_size=kwargs.get("batch_size"), prompt_length=kwargs.get("prompt_length"),
        encoder_length=kwargs.get("encoder_length"), quantization=kwargs.get("quantization"),
        cache_dtype=kwargs.get("cache_dtype", "float32"))
    with staged(os.fspath(path), "path") as tmp:
        with open(tmp, "wb") as f:
            f.write(content)
    details = {k: kwargs.get(k) for k in ("max_length", "batch_size", "prompt_length",
                                          "quantization")}
    details["signatures"] = sorted(interpreter.get_signature_list())
    details["writer"] = writer
    return verification.signature_report("tflite", path, verified,
                                         ops=tflite_op_names(content), details=details)


def _flattened(fn, out_names):
    def flat(*args):
        outputs = fn(*args)
        return [outputs[k] for k in out_names]

    return flat


def _check_onnx_arguments(model, max_length, checks):
    if checks not in ("flag", "none"):
        raise ValueError(
            "Received an invalid value for argument `checks`, expected 'flag' or "
            f"'none' (ONNX has no assert op). Received: checks={checks!r}"
        )
    _check_arguments(model, max_length, checks, ("flag", "none"))


def onnx_writer(model, *, max_length, opset=17, writer="auto"):
    """The writer `onnx_models` / `export_onnx` use, "direct"
    (`keras_attn.export.onnx_signatures`) or "tf2onnx", for `writer`
    "auto" (direct where it covers `model`, else a warning naming why),
    "direct" (or the `NotFusableError` that says why not) or "traced"
    ("tf2onnx", deprecated, is "traced")."""
    writer = check_writer(writer, ("tf2onnx",))
    _, why = direct_or_none(
        writer, lambda: onnx_signatures.check_signature_decoder(model, max_length, opset),
        what=f"The ONNX prefill/decode export of `{model.name}`",
        direct_name="direct ONNX signature writer (keras_attn.export.onnx_signatures)",
        traced_name="tf2onnx")
    return "tf2onnx" if writer == "traced" or why is not None else "direct"


def onnx_models(model, *, max_length, opset=17, checks="flag", writer="auto"):
    """`{"prefill", "decode", "decode_step"}` ModelProtos (see the module docstring;
    no `decode_step` for a ring-buffer cache).

    `writer`: "direct" (`keras_attn.export.onnx_signatures`: written from
    the weights in standard ops, each proto holding its weights, so under
    2 GB; `export_onnx` has no such limit), "traced" (the traced
    signatures converted by tf2onnx), or "auto" (the default: direct where it covers
    the model, else tf2onnx with a warning naming why).
    Inputs and outputs carry the signature names, except that an output
    named like an input gets `_out` appended (`cache_out`). Raises a ValueError if
    tf2onnx leaves any op that is not a standard ONNX op. `checks` as for
    `tflite_bytes` ("flag" adds the `valid` output).
    """
    _check_onnx_arguments(model, max_length, checks)
    if onnx_writer(model, max_length=max_length, opset=opset, writer=writer) == "direct":
        return onnx_signatures.signature_models(model, max_length=max_length, checks=checks, opset=opset,
                                                read_bucket=decoder_trace.READ_BUCKET)
    return _tf2onnx_models(model, max_length=max_length, opset=opset, checks=checks)


def _tf2onnx_models(model, *, max_length, opset, checks):
    import onnx
    import tf2onnx

    fns = signature_functions(model, max_length=max_length, checks=checks)
    protos = {}
    for name in [n for n in ("prefill", "decode", "decode_step") if n in fns]:
        concrete = fns[name].get_concrete_function()
        specs = [tf.TensorSpec(t.shape, t.dtype, name=t.name.split(":")[0])
                 for t in concrete.inputs if t.dtype != tf.resource]
        out_names = sorted(concrete.structured_outputs)

        flat_fn = tf.function(_flattened(fns[name], out_names), input_signature=specs,
                              autograph=False)
        proto, _ = tf2onnx.convert.from_function(flat_fn, input_signature=specs, opset=opset)
        bad = sorted({n.op_type for n in proto.graph.node
                      if not onnx.defs.has(n.op_type, n.domain or "")})
        if bad:
            raise ValueError(f"tf2onnx left non-ONNX ops in `{name}`: {bad}")
        input_names = {spec.name for spec in specs}
        for output, out_name in zip(list(proto.graph.output), out_names):
            # ONNX names are unique per graph: `cache` in, `cache_out` out.
            rename_value(proto.graph, output.name, out_name + "_out" if out_name in input_names
                    else out_name)
        for graph_input, spec in zip(list(proto.graph.input), specs):
            if graph_input.name != spec.name:
                rename_value(proto.graph, graph_input.name, spec.name)
        protos[name] = proto
    return protos


def _ort_runner(session):
    """An onnxruntime session as a callable over NumPy dicts (`cache_out` -> `cache`)."""
    names = [o.name for o in session.get_outputs()]

    def run(**kwargs):
        values = session.run(None, kwargs)
        return {n.removesuffix("_out"): v for n, v in zip(names, values)}

    return run


def _ort_file_runner(path, keep, shared=None):
    """`_ort_runner` of the model at `path`, its session opened at the first
    call and, unless `keep`, closed after each; `run.release()` closes it
    (verification holds one session's copy of the weights at a time).

    `shared` (`{initializer name: array}`: weights the model holds in
    memory, checked equal to the file's by the caller): the session runs on
    those arrays, unpacked, instead of mapping and packing a second copy."""
    held = []

    def run(**kwargs):
        if not held:
            held.append(_ort_runner(onnx_graph.inference_session(path, shared, prepack=not shared)))
        out = held[0](**kwargs)
        if not keep:
            held.clear()
        return out

    run.release = held.clear
    return run


def export_onnx(model, directory, *, max_length, opset=17, checks="flag", writer="auto"):
    """Writes `prefill.onnx`, `decode.onnx` and `decode_step.onnx` into `directory`.

    (No `decode_step.onnx` for a ring-buffer cache: see the module docstring.)
    `writer` as for `onnx_models`. The direct writer streams the models'
    weights, each once, to one external data file beside them
    (`keras_attn.export.onnx_signatures.WEIGHTS_FILE`), so the export holds
    one weight at a time and has no 2 GB limit; tf2onnx's models hold their
    weights inside.

    Returns:
        A `SignatureReport` whose `files` are `{"prefill": path, "decode":
        path, "decode_step": path}` and, from the direct writer, `"weights"`,
        the data file (`report["prefill"]` works, as on the dict returned
        before): the models, run in onnxruntime over a random sequence before
        writing, against the Keras model's logits (a `ParityError` beyond
        1e-4 of the largest logit, and nothing is written).
    """
    _check_onnx_arguments(model, max_length, checks)
    details = {"max_length": max_length, "opset": opset, "checks": checks,
               "writer": onnx_writer(model, max_length=max_length, opset=opset, writer=writer)}
    if details["writer"] == "direct":
        return _export_onnx_direct(model, directory, details)
    import onnxruntime as ort

    protos = _tf2onnx_models(model, max_length=max_length, opset=opset, checks=checks)
    contents = {name: proto.SerializeToString() for name, proto in protos.items()}
    sessions = {name: _ort_runner(ort.InferenceSession(content,
                                                       providers=["CPUExecutionProvider"]))
                for name, content in contents.items()}
    verified = verification.verify_prefill_decode(
        "onnx", model, sessions["prefill"], sessions["decode"], max_length=max_length,
        decode_step=sessions.get("decode_step"))
    os.makedirs(directory, exist_ok=True)
    paths = {}
    for name, content in contents.items():
        paths[name] = os.path.abspath(os.path.join(directory, f"{name}.onnx"))
        with open(paths[name], "wb") as f:
            f.write(content)
    ops = sorted({n.op_type for proto in protos.values() for n in proto.graph.node})
    return verification.signature_report("onnx", directory, verified, ops=ops, files=paths,
                                         details=details)


def _export_onnx_direct(model, directory, details):
    """The direct writer's files, written into a hidden folder inside
    `directory`, verified there, then moved beside whatever `directory`
    holds (nothing is left on an error)."""
    directory = os.path.abspath(os.fspath(directory))
    created = not os.path.exists(directory)
    os.makedirs(directory, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".onnx_signatures.partial-", dir=directory)
    try:
        names = {"prefill": "prefill.onnx", "decode": "decode.onnx",
                 "weights": onnx_signatures.WEIGHTS_FILE}
        if not model.describe().stacked_cache(details["max_length"])[1]:  # not a ring
            names["decode_step"] = "decode_step.onnx"
        staged_paths = {k: os.path.join(staging, n) for k, n in names.items()}
        shared = {}  # the weights written as the model holds them
        protos = onnx_signatures.signature_models(
            model, max_length=details["max_length"], checks=details["checks"], opset=details["opset"],
            read_bucket=decoder_trace.READ_BUCKET, external_data=staged_paths["weights"], shared=shared)
        ops = sorted({n.op_type for proto in protos.values() for n in proto.graph.node})
        runners, checked = {}, {}
        for name, proto in protos.items():
            with open(staged_paths[name], "wb") as f:
                f.write(proto.SerializeToString())
            own = {t.name: shared[t.name] for t in proto.graph.initializer if t.name in shared}
            onnx_graph.check_external_data(staged_paths[name], own, checked)  # each weight's bytes once
            runners[name] = _ort_file_runner(staged_paths[name], keep=name != "prefill", shared=own)
        del protos
        release_memory()
        verified = verification.verify_prefill_decode(
            "onnx", model, runners["prefill"], runners["decode"], max_length=details["max_length"],
            decode_step=runners.get("decode_step"))
        release_memory()
        paths = {k: os.path.join(directory, n) for k, n in names.items()}
        for name in names:
            os.replace(staged_paths[name], paths[name])
    except BaseException:
        if created:
            shutil.rmtree(directory, ignore_errors=True)
        raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return verification.signature_report("onnx", directory, verified, ops=ops, files=paths,
                                         details=details)
