"""LiteRT-LM bundles (`.litertlm`): a keras_attn decoder where apps run LLMs on device.

`litert_lm.Engine(path)` (the `litert-lm-api` package; the same runtime as
the Android/iOS/desktop LiteRT-LM libraries) drives its own loop over a
TFLite model of a fixed shape, the tokenizer and `LlmMetadata` packed in one
file by `litert_lm_builder`. The model's contract, as LiteRT-LM's CPU
executor reads it (`runtime/executor/llm_litert_compiled_model_executor.cc`):

- signatures `prefill_<T>` (one or more chunk lengths `T`) and `decode`;
- inputs `tokens` int32 `(1, T)` and `input_pos` int32 `(T,)`; no `mask`
  input (the model masks by position: key slot <= query position);
- per layer `kv_cache_k_<i>` / `kv_cache_v_<i>` float32
  `(1, max_length, num_key_value_heads, head_dim)` (keras_attn's own cache
  layout, so no transposes per step), inputs and outputs of the same name:
  on CPU the runtime passes one buffer as both, so a call updates the cache
  in place. The runtime takes the sequence axis from the bundle's
  `ExecutorMetadata` (`sequence_axis: 1` per cache, written here); without
  it, it assumes axis 2 and reads the head count as the context size;
- `decode` outputs `logits` `(1, 1, vocabulary_size)`; `prefill_*` output
  only the caches (the runtime samples after `decode`).

The runtime holds back the last prompt token for the first `decode` and
fills a prefill chunk shorter than `T` with token 0 at position 0, so this
call's keys and values are written as one slice at `input_pos[0]`
(`call_with_cache(tokens, cache, input_pos[0])`): the padding lands in
slots past the prompt, masked for every real query and overwritten by the
next calls, and never in slot 0. Slots past `max_length` are dropped
(`keras_attn.ops.write_cache`).

The TFLite model is written from the Keras weights by
`keras_attn.export.tflite_decoder` where that writer covers the model (the
default, `writer="auto"`), else converted by TensorFlow's TFLite converter
from the traced signatures (`litertlm_functions`).

Greedy decoding in LiteRT-LM (`SamplerConfig(top_k=1)`) gives Keras's
`greedy_search` tokens; `generate` runs it from text.

LoRA: `export_litertlm(..., lora_rank=16)` writes the base model with
LoRA weights as inputs of every signature and `save_litertlm_lora` writes
a fine-tune's adapters as a LoRA file that LiteRT-LM binds to them at run
time (`litert_lm.LoraConfig(lora_path=...)`): one bundle, many fine-tunes.
What LiteRT-LM 0.18's CPU executor requires, measured: the inputs on
`decode` and `prefill_<T>` themselves, rank 16 or 32, the file's tensor
data after its flatbuffer (`Buffer.offset/size`) with a `lora_rank`
metadata entry, and its size a multiple of 4096 bytes. Give every session
a file (the all-zero one for the base model): an engine that never loaded
one leaves the inputs unbound (garbage, for that session and the next ones),
and a session without a file after one with a file keeps the previous LoRA.
"""

import dataclasses
import os
import tempfile

import numpy as np
import tensorflow as tf

from keras_attn.export import tflite_decoder
from keras_attn.export.capabilities import NotFusableError
from keras_attn.export.writers import check_writer, direct_or_none
from keras_attn.runtimes.tflite_convert import GENERATION_QUANTIZATIONS
from keras_attn.runtimes.tflite_convert import signatures_to_tflite
from keras_attn.runtimes.tokenizers import write_tokenizer
from keras_attn.runtimes import trace as decoder_trace
from keras_attn.runtimes.trace import DecoderTrace
from keras_attn.runtimes.trace import cache_storage_dtype
from keras_attn.runtimes.trace import check_runtime_decoder
from keras_attn.runtimes.trace import num_caches

RUNTIME = "LiteRT-LM"
# The caches keep keras_attn's layout (1, S, H_kv, d); the bundle's executor
# metadata tells LiteRT-LM where the sequence is (its default is axis 2).
SEQUENCE_AXIS = 1
# One prefill signature of 128 (issue 54). LiteRT-LM's CPU executor never pads
# a chunk up to a larger signature: it cascades the rest of a prompt down to
# the smaller ones (`prefill_chunks`), and every call reads every weight. With
# (32, 128), 97-127 tokens (and every 128 k + 97-127) were four calls of 32
# against one call of 128 in litert-torch's bundle: 0.75-0.86x its prefill at
# Llama-3.2-1B. One signature of 128 makes the calls litert-torch's bundle
# makes, is smaller (one signature's graph less) and peaks lower; short
# prompts pay for it (one padded call of 128 instead of one of 32), which
# `prefill_lengths=(32, 128)` buys back (benchmarks/RESULTS.md,
# "LiteRT-LM prefill by prompt length").
DEFAULT_PREFILL_LENGTHS = (128,)
# The verification's float32 bound, relative to the largest Keras logit:
# the TFLite graph reorders float32 sums (XNNPACK), nothing more.
FLOAT32_RTOL = 1e-4
# Quantized bundles are judged by what they answer: the fraction of
# positions whose next token (argmax) equals Keras's, teacher-forced on the
# verification sequence.
DEFAULT_MIN_AGREEMENT = {"float16": 0.99, "dynamic": 0.9, "int4": 0.8}


def _positive_int(name, value):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"`{name}` must be a positive int. Received: {name}={value!r}")
    return int(value)


def _prefill_lengths(prefill_lengths, max_length):
    if prefill_lengths is None:
        lengths = sorted({min(t, max_length) for t in DEFAULT_PREFILL_LENGTHS})
    else:
        if isinstance(prefill_lengths, (int, np.integer)):
            prefill_lengths = (prefill_lengths,)
        lengths = sorted({_positive_int("prefill_lengths", t) for t in prefill_lengths})
        if not lengths or lengths[-1] > max_length:
            raise ValueError(
                "`prefill_lengths` must be chunk lengths in [1, max_length="
                f"{max_length}]. Received: prefill_lengths={prefill_lengths!r}"
            )
    return tuple(lengths)


def litertlm_functions(model, *, max_length, prefill_lengths=None, cache_dtype="float32"):
    """`{"prefill_<T>": tf.function, ..., "decode": tf.function}` of the LiteRT-LM contract.

    `cache_dtype="float16"` keeps the caches in float16 between calls (half
    the memory per token); each call computes in float32.
    """
    cache_storage_dtype(cache_dtype)  # checked first, before the model is read
    check_runtime_decoder(model, RUNTIME)
    max_length = _positive_int("max_length", max_length)
    lengths = _prefill_lengths(prefill_lengths, max_length)
    # LiteRT-LM's caches hold every position: a window is a band over them.
    # Each call reads the filled part of the caches only and writes a decode
    # step's slot in place (LiteRT-LM passes one buffer as input and output).
    trace = DecoderTrace(model, max_length=max_length, cache_dtype=cache_dtype, ring_buffers=False,
                         read_bucket=decoder_trace.READ_BUCKET, update_slices=True)
    # A prefill chunk of T tokens at position p embeds positions up to
    # p + T - 1 (its padding included), p < max_length.
    reach = max_length + lengths[-1] - 1
    if trace.max_positions is not None and reach > trace.max_positions:
        raise ValueError(
            "A learned position table must cover max_length + max(prefill_lengths) - 1 "
            f"= {reach} positions (the last prefill chunk's padding is embedded too); "
            f"this model has sequence_length={trace.max_positions}. Lower `max_length` "
            f"or `prefill_lengths`. Received: max_length={max_length}, "
            f"prefill_lengths={lengths}")

    def make(length, with_logits):
        specs = [tf.TensorSpec((1, length), tf.int32, name="tokens"),
                 tf.TensorSpec((length,), tf.int32, name="input_pos")]
        for i in range(trace.num_layers):
            # keras_attn's layout, no transposes; each layer its own heads and head size.
            shape = trace.cache_shape(1, trace.cache_length, layer=i)
            specs += [tf.TensorSpec(shape, trace.cache_dtype, name=f"kv_cache_k_{i}"),
                      tf.TensorSpec(shape, trace.cache_dtype, name=f"kv_cache_v_{i}")]

        def run(tokens, input_pos, *caches):
            # A chunk's keys and values are written as one slice at input_pos[0].
            logits, cache = trace.decode(tokens, trace.cache(caches), input_pos[0])
            out = {}
            keys_values = [trace.store(t) for t in trace.keys_values(cache)]
            for i in range(trace.num_layers):
                out[f"kv_cache_k_{i}"], out[f"kv_cache_v_{i}"] = keys_values[2 * i: 2 * i + 2]
            if with_logits:
                out["logits"] = tf.cast(logits, tf.float32)
            return out

        return tf.function(run, input_signature=specs, autograph=False)

    functions = {f"prefill_{t}": make(t, False) for t in lengths}
    functions["decode"] = make(1, True)
    return functions


def litertlm_tflite(model, *, max_length, prefill_lengths=None, quantization=None,
                    cache_dtype="float32", writer="auto"):
    """The bundle's TFLite model (bytes): `prefill_<T>` and `decode` signatures.

    `writer`: "auto", "direct" or "traced" (see `export_litertlm`).
    """
    with tempfile.TemporaryDirectory(prefix="keras_attn_litertlm_") as tmp:
        path = os.path.join(tmp, "model.tflite")
        write_litertlm_tflite(model, path, max_length=max_length, prefill_lengths=prefill_lengths,
                              quantization=quantization, cache_dtype=cache_dtype, writer=writer)
        with open(path, "rb") as f:
            return f.read()


def write_litertlm_tflite(model, path, *, max_length, prefill_lengths=None, quantization=None,
                          cache_dtype="float32", writer="auto", lora_rank=None):
    """Writes the bundle's TFLite model to `path`; returns `(writer, why)`:
    the writer used ("direct" or "converter") and, when "auto" fell back to
    the converter, why the direct writer was skipped (else None)."""
    writer = check_writer(writer, ("converter",))
    cache_storage_dtype(cache_dtype)
    if lora_rank is not None:
        # Only the direct writer takes LoRA weights as inputs: no fallback to
        # a bundle that would ignore the LoRA file.
        if writer == "traced":
            raise ValueError(
                "Received an invalid value for argument `writer`, expected 'auto' or 'direct' "
                "with `lora_rank` (TensorFlow's converter writes no LoRA inputs). "
                f"Received: writer={writer!r}")
        writer = "direct"

    def direct():
        if cache_dtype != "float32":
            raise NotFusableError(f"cache_dtype={cache_dtype!r} (the direct writer keeps float32 caches)")
        check_runtime_decoder(model, RUNTIME)
        length = _positive_int("max_length", max_length)
        tflite_decoder.write_decoder_tflite(
            model, path, max_length=length, prefill_lengths=_prefill_lengths(prefill_lengths, length),
            quantization=quantization, read_bucket=decoder_trace.READ_BUCKET, lora_rank=lora_rank)
        return "direct"

    used, why = direct_or_none(writer, direct, what=f"The LiteRT-LM export of `{model.name}`",
                               direct_name="direct TFLite writer",
                               traced_name="TensorFlow's TFLite converter")
    if used:
        return used, None
    content = signatures_to_tflite(
        litertlm_functions(model, max_length=max_length, prefill_lengths=prefill_lengths,
                           cache_dtype=cache_dtype),
        quantization)
    with open(path, "wb") as f:
        f.write(content)
    return "converter", why


def executor_metadata(*, num_layers, max_length):
    """LiteRT-LM's `ExecutorMetadata` (serialized): each cache's sequence axis (1)."""
    from litert_lm_builder.runtime.proto import executor_metadata_pb2

    meta = executor_metadata_pb2.ExecutorMetadata()
    llm = meta.llm_executor_metadata
    llm.max_history_size = int(max_length)
    kinds = (("k", executor_metadata_pb2.StateBuffer.TYPE_GLOBAL_KEY_CACHE),
             ("v", executor_metadata_pb2.StateBuffer.TYPE_GLOBAL_VALUE_CACHE))
    for i in range(num_layers):
        for letter, kind in kinds:
            name = f"kv_cache_{letter}_{i}"
            buffer = llm.state_buffers.add()
            buffer.prefill_input_name = buffer.prefill_output_name = name
            buffer.decode_input_name = buffer.decode_output_name = name
            buffer.type = kind
            buffer.sequence_axis = SEQUENCE_AXIS
            buffer.maximum_sequence_length = int(max_length)
    return meta.SerializeToString()


def llm_metadata(*, max_length, bos_token_id=None, stop_token_ids=(), prompt_template=None):
    """LiteRT-LM's `LlmMetadata` proto (serialized) for a generic model."""
    from litert_lm_builder.runtime.proto import llm_metadata_pb2

    meta = llm_metadata_pb2.LlmMetadata()
    if bos_token_id is not None:
        meta.start_token.token_ids.ids.append(int(bos_token_id))
    for token in stop_token_ids:
        meta.stop_tokens.add().token_ids.ids.append(int(token))
    meta.max_num_tokens = int(max_length)
    meta.llm_model_type.generic_model.SetInParent()
    if prompt_template is not None:
        meta.jinja_prompt_template = prompt_template
    return meta.SerializeToString()


@dataclasses.dataclass
class LitertLmReport:
    """What `export_litertlm` wrote and how its TFLite model matched Keras.

    Attributes:
        path: the `.litertlm` file.
        size_bytes: its size.
        signatures: `{name: {"inputs": [...], "outputs": [...]}}`.
        quantization: None, "float16", "dynamic" or "int4".
        max_abs_error: largest |LiteRT - Keras| logit on the verification
            sequence (prefill chunks then one decode per token, the runtime's
            schedule).
        atol: the bound it was checked against (float32), else None.
        agreement: fraction of positions whose argmax (next token) equals
            Keras's; checked against `min_agreement` for quantized bundles.
        min_agreement: that threshold (None for float32).
        writer: "direct" (`keras_attn.export.tflite_decoder`) or "converter".
        direct_writer_skipped: why `writer="auto"` fell back to the
            converter, else None.
    """

    path: str
    size_bytes: int
    signatures: dict
    quantization: object
    max_abs_error: float
    atol: object
    agreement: float
    min_agreement: object
    writer: str = "converter"
    direct_writer_skipped: object = None


def prefill_chunks(prefill_lengths, num_tokens, capacity=None):
    """The prefill calls LiteRT-LM's CPU executor makes for `num_tokens` prompt tokens.

    `[(T, n), ...]`: a call of signature `prefill_<T>` with `n <= T` real
    tokens (the rest padding). LiteRT-LM 0.18 on CPU
    (`GetOptimizedPrefillWorkGroups(..., use_greedy_chunking=true)` in
    `runtime/executor/litert_compiled_model_executor_utils.cc`) fills greedily
    from the largest signature down: as many full chunks of each length as fit,
    the remainder cascading to the next smaller length, and what is left after
    the smallest goes into one padded call of the smallest. A chunk is never
    padded up to a larger signature: with (32, 128), 127 tokens are four calls
    of `prefill_32`, each reading every weight. Signatures longer than
    `capacity` (the cache slots left) are not used.
    """
    lengths = sorted({int(t) for t in prefill_lengths}, reverse=True)
    room = float("inf") if capacity is None else int(capacity)
    calls, remaining = [], int(num_tokens)
    for t in lengths:
        if remaining <= 0:
            break
        if t > room:
            continue
        full = int(min(remaining // t, room // t))
        calls += [(t, t)] * full
        room, remaining = room - full * t, remaining - full * t
        if remaining and t == lengths[-1] and t <= room:
            calls.append((t, remaining))
            remaining = 0
    if remaining:
        raise ValueError(f"LiteRT-LM cannot prefill {num_tokens} tokens with prefill_lengths="
                         f"{tuple(sorted(lengths))} in {capacity} cache slots")
    return calls


def runtime_logits(content, tokens, xnnpack=True, lora_weights=None):
    """`tokens` run through a bundle's TFLite model (bytes or a path) on LiteRT-LM's schedule.

    The first half of `tokens` (`n_prefill`) is prefilled in the chunks the
    runtime's CPU executor picks (`prefill_chunks`; a short chunk padded with
    token 0 at position 0), then every remaining token goes through `decode`.
    Returns `(logits, n_prefill)`: the `decode` logits
    `(len(tokens) - n_prefill, V)`, row `i` predicting the token after
    position `n_prefill + i`. `xnnpack=False` runs LiteRT's builtin kernels
    instead of the XNNPACK delegate, which packs a copy of the weights for
    every signature. `lora_weights` (`{input name: array}`) feeds a
    LoRA bundle's LoRA inputs in every call.
    """
    from ai_edge_litert import interpreter as litert

    source = ({"model_content": content} if isinstance(content, bytes)
              else {"model_path": os.fspath(content)})
    if not xnnpack:
        source["experimental_op_resolver_type"] = (
            litert.OpResolverType.BUILTIN_WITHOUT_DEFAULT_DELEGATES)
    interpreter = litert.Interpreter(**source)
    signatures = interpreter.get_signature_list()
    lora = dict(lora_weights or {})
    chunks = {int(k.split("_", 1)[1]): k for k in signatures if k.startswith("prefill_")}
    decode = interpreter.get_signature_runner("decode")
    cache = {name: np.zeros(d["shape"], d["dtype"])
             for name, d in decode.get_input_details().items() if name.startswith("kv_cache_")}
    tokens = [int(t) for t in tokens]
    n_prefill = max(1, len(tokens) // 2)
    capacity = next(iter(cache.values())).shape[SEQUENCE_AXIS] if cache else None
    step = 0
    for length, take in prefill_chunks(chunks, n_prefill, capacity):
        ids = np.zeros((1, length), np.int32)
        pos = np.zeros((length,), np.int32)
        ids[0, :take] = tokens[step:step + take]
        pos[:take] = np.arange(step, step + take)
        cache = interpreter.get_signature_runner(chunks[length])(tokens=ids, input_pos=pos, **cache, **lora)
        step += take
    logits = []
    for position in range(n_prefill, len(tokens)):
        out = decode(tokens=np.array([[tokens[position]]], np.int32),
                     input_pos=np.array([position], np.int32), **cache, **lora)
        logits.append(out.pop("logits")[0, 0])
        cache = out
    return np.stack(logits), n_prefill


def _verify(model, content, max_length, quantization, atol, min_agreement, seed=0,
            cache_dtype="float32", lora_rank=None):
    rng = np.random.default_rng(seed)
    length = min(max_length, 24)
    tokens = rng.integers(0, model.vocabulary_size, size=(1, length)).astype("int32")
    pad = getattr(model, "pad_token_id", None)
    if pad is not None:  # the Keras call masks padding, the cached call does not
        tokens[tokens == pad] = (pad + 1) % model.vocabulary_size
    reference = np.asarray(model(tokens), np.float64)[0]
    # LiteRT's builtin kernels: XNNPACK would pack the weights once per
    # signature (three float copies of a 2 GB model at once). Except int4:
    # the builtin blockwise kernel is a scalar loop, and XNNPACK's packs of
    # int4 weights are small (Llama-3.2-1B's export: 82 s and 10.2 GB peak
    # with XNNPACK, 584 s and 8.4 GB with the builtin kernels).
    # A LoRA bundle runs with the model's own adapters, as its LoRA file holds them.
    lora = None if lora_rank is None else tflite_decoder.lora_weights(model.describe(), lora_rank)
    got, first = runtime_logits(content, tokens[0], xnnpack=quantization == "int4", lora_weights=lora)
    reference = reference[first:]
    error = float(np.max(np.abs(got - reference)))
    agreement = float(np.mean(np.argmax(got, -1) == np.argmax(reference, -1)))
    if quantization is None and cache_dtype == "float32":
        bound = FLOAT32_RTOL * max(1.0, float(np.max(np.abs(reference)))) if atol is None else atol
        if not error <= bound:
            raise ValueError(
                f"The LiteRT-LM model's logits differ from Keras's by {error:.3g} > "
                f"atol={bound:.3g} on the verification sequence; nothing was written.")
        return error, bound, agreement, None
    what = quantization or "float16"
    threshold = DEFAULT_MIN_AGREEMENT[what] if min_agreement is None else min_agreement
    if not agreement >= threshold:
        raise ValueError(
            f"The LiteRT-LM model (quantization={quantization}, cache_dtype={cache_dtype}) "
            f"picks Keras's next token at {agreement:.3f} of the positions < "
            f"min_agreement={threshold} (max logit error {error:.3g}); nothing was "
            "written. Lower `min_agreement` if this "
            "is acceptable, or use quantization=None / 'float16'.")
    return error, None, agreement, threshold


def export_litertlm(model, path, *, tokenizer, max_length, prefill_lengths=None,
                    quantization=None, cache_dtype="float32", bos_token_id=None,
                    stop_token_ids=None,
                    prompt_template=None, atol=None, min_agreement=None, overwrite=True,
                    writer="auto", lora_rank=None):
    """Writes a `.litertlm` bundle that `litert_lm.Engine` loads and generates with.

    Args:
        model: a built `DecoderOnlyLM` (e.g. from `keras_attn.convert`),
            not an encoder-decoder model; sliding windows become a band over
            caches that hold every position.
        path: the `.litertlm` file to write.
        tokenizer: a Hugging Face `tokenizer.json` path (or a folder with
            one), a `tokenizers.Tokenizer` or a transformers fast tokenizer
            (`keras_attn.runtimes.tokenizers` makes one for a character
            or word vocabulary).
        max_length: the context (prompt + generated tokens): the caches'
            length and the bundle's `max_num_tokens`.
        prefill_lengths: prefill chunk lengths, one `prefill_<T>` signature
            each; default (128,), capped at `max_length`. LiteRT-LM's CPU
            executor runs a prompt in as many full chunks of the largest
            length as fit, then of the next ones down, and the rest in one
            padded chunk of the smallest (`prefill_chunks`); every call reads
            all the weights. A smaller length (e.g. `(32, 128)`) makes short
            prompts faster and prompts just under a multiple of the largest
            slower (several small calls where one would do); each signature
            adds its graph to the bundle and its buffers to the memory.
        quantization: None (float32), "float16" (float16 weights),
            "dynamic" (int8 weights, LiteRT's hybrid int8 kernels) or "int4"
            (int4 weights in blocks of 32, the layout of ai-edge-quantizer's
            `dynamic_wi4b32_afp32`, token table included; the converter
            path runs ai-edge-quantizer and keeps the table float32).
        cache_dtype: "float32" or "float16" (the caches between calls: half
            the memory per token; checked like a quantized bundle).
        bos_token_id: the token LiteRT-LM puts before every prompt (its
            `start_token`), or None for none (GPT-2 style prompts).
        stop_token_ids: tokens that end generation (default: the model's
            `pad_token_id`).
        prompt_template: a Jinja chat template for LiteRT-LM's Conversation
            API (None: the model is used on raw text).
        atol: float32 bound on |LiteRT - Keras| logits (default 1e-4 x the
            largest logit, at least 1e-4).
        min_agreement: quantized bundles: the smallest fraction of next
            tokens equal to Keras's (default 0.99 float16, 0.9 dynamic, 0.8
            int4).
        overwrite: replace an existing file.
        writer: "auto" (default): the direct writer
            (`keras_attn.export.tflite_decoder`: the TFLite model written
            from the Keras weights, float32, "dynamic" int8 or "int4",
            float32 caches) where it covers the model, else TensorFlow's TFLite
            converter, with a warning naming why; "direct" (a
            `NotFusableError` where it does not cover the model) or
            "traced" (the converter; "converter", deprecated, is "traced").
            The report's `writer` says which wrote the bundle ("direct" or
            "converter").
        lora_rank: None, or 16 or 32 (the LoRA ranks LiteRT-LM runs): a
            bundle for LoRA files (`save_litertlm_lora`) loaded at run time
            (`litert_lm.LoraConfig(lora_path=...)`, or `generate(...,
            lora_path=...)`). Its `decode` and `prefill_<T>` signatures hold
            the base model (each adapted projection's frozen kernel) and
            take `lora_atten_(q|k|v|o)_(a|b)_prime_weight_<layer>` inputs
            for every attention projection, LiteRT-LM's LoRA input names;
            the model's own adapters (PEFT-style, on attention projections,
            of rank up to `lora_rank`) are what the export is verified with.
            Give every LiteRT-LM session a LoRA file: in an engine that
            never loaded one, LiteRT-LM 0.18's CPU executor leaves these
            inputs unbound (garbage); a model without adapters writes the
            all-zero file, the base model. Direct writer only.

    Returns:
        A `LitertLmReport`.

    Example (needs `litert-lm-builder`; generating needs `litert-lm-api`):

        report = export_litertlm(lm, "lm.litertlm", tokenizer="tokenizer.json",
                                 max_length=256, bos_token_id=1, stop_token_ids=[2])
        text = keras_attn.runtimes.litertlm.generate("lm.litertlm", "Once upon")
    """
    try:
        from litert_lm_builder import litertlm_builder as builder_lib
    except ImportError as error:
        raise ImportError(
            "export_litertlm writes bundles with `litert-lm-builder`: pip install "
            "'keras-attn[llm-runtimes]' (or litert-lm-builder).") from error
    check_runtime_decoder(model, RUNTIME)
    max_length = _positive_int("max_length", max_length)
    if quantization not in GENERATION_QUANTIZATIONS:
        raise ValueError(
            "Received an invalid value for argument `quantization`, expected one of "
            f"{list(GENERATION_QUANTIZATIONS)}. Received: quantization={quantization!r}")
    if tokenizer is None:
        raise ValueError("`tokenizer` is required: a LiteRT-LM bundle generates from text.")
    path = os.path.abspath(os.fspath(path))
    if os.path.exists(path) and not overwrite:
        raise FileExistsError(f"{path} exists; pass overwrite=True to replace it.")
    if stop_token_ids is None:
        stop_token_ids = (model.pad_token_id,)
    stop_token_ids = tuple(np.atleast_1d(stop_token_ids).tolist())
    writer = check_writer(writer, ("converter",), stacklevel=3)
    with tempfile.TemporaryDirectory(prefix="keras_attn_litertlm_") as tmp:
        # The model is written to a file and read from it (LiteRT maps the
        # weights after the flatbuffer): never whole in Python memory.
        model_path = os.path.join(tmp, "model.tflite")
        used, skipped = write_litertlm_tflite(
            model, model_path, max_length=max_length, prefill_lengths=prefill_lengths,
            quantization=quantization, cache_dtype=cache_dtype, writer=writer, lora_rank=lora_rank)
        error, bound, agreement, threshold = _verify(model, model_path, max_length, quantization,
                                                     atol, min_agreement, cache_dtype=cache_dtype,
                                                     lora_rank=lora_rank)
        # Only the signature list: no XNNPACK delegate (it would pack a
        # second copy of the weights).
        from ai_edge_litert import interpreter as litert

        signatures = litert.Interpreter(
            model_path=model_path,
            experimental_op_resolver_type=litert.OpResolverType.BUILTIN_WITHOUT_DEFAULT_DELEGATES,
        ).get_signature_list()
        meta_path = os.path.join(tmp, "llm_metadata.pb")
        with open(meta_path, "wb") as f:
            f.write(llm_metadata(max_length=max_length, bos_token_id=bos_token_id,
                                 stop_token_ids=stop_token_ids,
                                 prompt_template=prompt_template))
        executor_path = os.path.join(tmp, "executor_metadata.pb")
        with open(executor_path, "wb") as f:
            f.write(executor_metadata(num_layers=num_caches(model), max_length=max_length))
        write_tokenizer(tokenizer, tmp)
        builder = builder_lib.LitertLmFileBuilder()
        builder.add_llm_metadata(meta_path)
        builder.add_executor_metadata(executor_path)
        builder.add_tflite_model(model_path, builder_lib.TfLiteModelType.PREFILL_DECODE)
        builder.add_hf_tokenizer(os.path.join(tmp, "tokenizer.json"))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        partial = path + ".partial"
        with open(partial, "wb") as f:
            builder.build(f)
        os.replace(partial, path)
    return LitertLmReport(path=path, size_bytes=os.path.getsize(path), signatures=signatures,
                          quantization=quantization, max_abs_error=error, atol=bound,
                          agreement=agreement, min_agreement=threshold, writer=used,
                          direct_writer_skipped=skipped)


def save_litertlm_lora(model, path, *, lora_rank):
    """Writes `model`'s LoRA adapters as a LiteRT-LM LoRA file for a bundle
    that `export_litertlm(..., lora_rank=lora_rank)` wrote from the same
    base model; returns `path`.

    The file is what LiteRT-LM's `LoraData` reads: a TFLite flatbuffer whose
    tensors are named as the bundle's LoRA inputs, each attention
    projection's `a' = (alpha / r) * A` `(in, lora_rank)` and `b' = B`
    `(lora_rank, out)` (ai-edge-torch's split of the scale; an adapter of a
    smaller rank zero-padded, zeros for a projection without one), stored
    after the flatbuffer, with a `lora_rank` metadata entry. A model
    without adapters writes the all-zero file (the base model).

    Args:
        model: a `DecoderOnlyLM` whose adapters (`enable_lora`, PEFT style,
            not merged) are on attention projections only.
        path: the file to write (`.tflite` by convention).
        lora_rank: the bundle's LoRA rank (16 or 32).
    """
    path = os.fspath(path)
    tflite_decoder.write_lora_tflite(model, path, lora_rank=lora_rank)
    return path


def generate(path, text, *, max_new_tokens=None, engine=None, apply_prompt_template=False,
             verbose=None, lora_path=None):
    """Greedy generation from `text` in `litert_lm.Engine` (CPU); returns the text.

    `engine`: an open `litert_lm.Engine` on `path` to reuse (loading one
    takes a while); `max_new_tokens` caps the output (default: up to the
    bundle's `max_num_tokens`). LiteRT-LM's C++ log lines (about forty INFO
    and WARNING lines per call with a new engine: accelerators registered,
    sections not found) are hidden unless `verbose=True` or the environment
    variable `KERAS_ATTN_VERBOSE=1` (the `keras-attn` CLI's switch); errors
    are always shown. The log level is LiteRT-LM's, for the whole process.
    `lora_path`: a LoRA file (`save_litertlm_lora`) for a bundle exported
    with `lora_rank`.
    """
    import litert_lm

    if verbose is None:
        verbose = os.environ.get("KERAS_ATTN_VERBOSE", "") not in ("", "0")
    litert_lm.set_min_log_severity(
        litert_lm.LogSeverity.INFO if verbose else litert_lm.LogSeverity.ERROR)
    own = engine is None
    if own:
        engine = litert_lm.Engine(os.fspath(path), backend=litert_lm.Backend.CPU())
    try:
        lora = {} if lora_path is None else {
            "lora_config": litert_lm.LoraConfig(lora_path=os.fspath(lora_path))}
        session = engine.create_session(
            apply_prompt_template=apply_prompt_template,
            sampler_config=litert_lm.SamplerConfig(top_k=1),
            max_output_tokens=max_new_tokens, **lora)
        try:
            session.run_prefill([text])
            return "".join(session.run_decode().texts)
        finally:
            session.close()
    finally:
        if own:
            engine.close()
