"""A model folder that ONNX Runtime GenAI runs: `model.onnx`, `genai_config.json`
and the tokenizer files.

ONNX Runtime GenAI (`onnxruntime_genai.Model` / `Generator`) drives its own
decoding loop over one graph used for prefill and decode, with Hugging Face's
I/O names: int64 `input_ids` `(B, T)` and `attention_mask` `(B, total)` (1 =
token; `total` = tokens so far, this call's included), per-layer
`past_key_values.%d.key|value` inputs and `present.%d.key|value` outputs
`(B, num_key_value_heads, S, head_dim)` (each layer's own heads and head
size: GenAI sizes each cache from the graph), and `logits` `(B, T, V)`, or
`(B, 1, V)` (each row's last token: the fused graph's `prompt_logits="last"`).

The cache is keras_attn's fixed-size one: `S = max_length`, static in the
graph, which GenAI detects and runs with `past_present_share_buffer` (the
same buffer is past and present; the graph writes this call's keys and
values at `[total - T, total)`, `keras_attn.ops.write_cache`). GenAI allows
greedy search and sampling on such a graph, not beam search.

Positions are `total - T + [0, T)` for every row: exact for batch 1 and for
rows of equal length. A left-padded batch is exact for rotary models (their
attention depends on position differences only) and not for learned
positions (GPT-2), whose padded rows Hugging Face numbers from the mask.

The graph is written one of two ways (`writer=`):

- "direct" (`keras_attn.export.onnx_decoder`): onnxruntime's fused kernels
  (`GroupQueryAttention` with rotary and sliding windows inside,
  `SkipSimplifiedLayerNormalization`, packed Q/K/V, `MatMulNBits` for int8
  and int4 weights) from the Keras weights, as the ONNX Runtime GenAI model
  builder writes its graphs; for rotary, RMSNorm decoders (the Llama-like
  families of `keras_attn.convert`).
- "traced": `call_with_cache` converted by tf2onnx, so anything
  `keras_attn.runtimes.signatures` exports exports here (learned positions,
  LayerNorm, relative bias; a sliding window as a band over the full
  cache); not encoder-decoder models.

"auto" (the default) takes the direct writer where it covers the model and
falls back to tf2onnx with a warning that says why. ("fused" and "tf2onnx",
deprecated, are "direct" and "traced".)
"""

import json
import os

import numpy as np
import tensorflow as tf

from keras_attn import checks
from keras_attn.export import onnx_decoder
from keras_attn.export import onnx_graph
from keras_attn.export.onnx import rename_value
from keras_attn.export.onnx_quantize import matmul_nbits
from keras_attn.export.onnx_quantize import quantize_matmul_weights
from keras_attn.export.report import ParityError
from keras_attn.export.writers import check_writer, direct_or_none
from keras_attn.runtimes import verification
from keras_attn.runtimes.tokenizers import tokenizer_model_type
from keras_attn.runtimes.tokenizers import write_tokenizer
from keras_attn.runtimes.trace import DecoderTrace
from keras_attn.runtimes.trace import check_runtime_decoder
from keras_attn.runtimes.trace import num_caches


def genai_function(model, max_length):
    """The `tf.function` of the GenAI graph and its input signature."""
    # GenAI's caches hold every position: a window is a band over them.
    trace = DecoderTrace(model, max_length=max_length, ring_buffers=False)
    length = trace.cache_length
    specs = [
        tf.TensorSpec((None, None), tf.int64, name="input_ids"),
        tf.TensorSpec((None, None), tf.int64, name="attention_mask"),
    ]
    for i, (heads, head_dim) in enumerate(trace.layer_cache_shapes):
        # Hugging Face's cache layout (B, H_kv, S, d); keras_attn's is (B, S, H_kv, d).
        # Each layer's own (H_kv, d), static: GenAI sizes each layer's cache from them.
        for kind in ("key", "value"):
            specs.append(tf.TensorSpec((None, heads, length, head_dim), tf.float32,
                                       name=f"past_{kind}_{i}"))

    def run(input_ids, attention_mask, *past):
        ids = tf.cast(input_ids, tf.int32)
        new = tf.shape(ids)[1]
        total = tf.shape(attention_mask)[1]
        index = total - new
        cache = trace.cache([tf.transpose(t, (0, 2, 1, 3)) for t in past])
        mask = tf.not_equal(attention_mask, 0)
        mask = tf.pad(mask, [[0, 0], [0, length - total]], constant_values=False)
        logits, cache = trace.decode(ids, cache, index, padding_mask=mask)
        outputs = [tf.cast(logits, tf.float32)]
        outputs += [tf.transpose(t, (0, 2, 1, 3)) for t in trace.keys_values(cache)]
        return outputs

    return tf.function(run, input_signature=specs, autograph=False), specs


def onnx_genai_model(model, *, max_length, opset=17):
    """The GenAI graph as an ONNX `ModelProto` (Hugging Face I/O names)."""
    import onnx
    import tf2onnx

    check_runtime_decoder(model)
    fn, specs = genai_function(model, max_length)
    proto, _ = tf2onnx.convert.from_function(fn, input_signature=specs, opset=opset)
    bad = sorted({n.op_type for n in proto.graph.node if not onnx.defs.has(n.op_type, n.domain or "")})
    if bad:
        raise ValueError(f"tf2onnx left non-ONNX ops in the GenAI graph: {bad}")
    names = ["input_ids", "attention_mask"]
    outputs = ["logits"]
    for i in range(num_caches(model)):
        names += [f"past_key_values.{i}.key", f"past_key_values.{i}.value"]
        outputs += [f"present.{i}.key", f"present.{i}.value"]
    for graph_input, name in zip(list(proto.graph.input), names):
        rename_value(proto.graph, graph_input.name, name)
    for graph_output, name in zip(list(proto.graph.output), outputs):
        rename_value(proto.graph, graph_output.name, name)
    return proto


def genai_config(model, *, max_length, bos_token_id=None, eos_token_id=None,
                 pad_token_id=None, filename="model.onnx"):
    """The `genai_config.json` dict for `model`'s graph (greedy search by default)."""
    pad = getattr(model, "pad_token_id", 0) if pad_token_id is None else pad_token_id
    eos = pad if eos_token_id is None else eos_token_id

    def first(value):
        # With a head size or key/value heads per layer, the first cache's: GenAI
        # reads each layer's cache shape from the graph's past_key_values inputs.
        return value[0] if isinstance(value, list) else value

    decoder = {
        "session_options": {"log_id": "onnxruntime-genai", "provider_options": []},
        "filename": filename,
        "head_size": int(first(model.head_dim)),
        "hidden_size": int(model.hidden_dim),
        "inputs": {
            "input_ids": "input_ids",
            "attention_mask": "attention_mask",
            "past_key_names": "past_key_values.%d.key",
            "past_value_names": "past_key_values.%d.value",
        },
        "outputs": {
            "logits": "logits",
            "present_key_names": "present.%d.key",
            "present_value_names": "present.%d.value",
        },
        "num_attention_heads": int(model.num_heads),
        # GenAI reads it as the number of key/value caches.
        "num_hidden_layers": int(num_caches(model)),
        "num_key_value_heads": int(first(model.num_key_value_heads)),
    }
    return {
        "model": {
            "bos_token_id": int(eos if bos_token_id is None else bos_token_id),
            "context_length": int(max_length),
            "decoder": decoder,
            "eos_token_id": [int(t) for t in np.atleast_1d(eos)],
            "pad_token_id": int(pad),
            "type": "llama",
            "vocab_size": int(model.vocabulary_size),
        },
        "search": {
            "diversity_penalty": 0.0, "do_sample": False, "early_stopping": True,
            "length_penalty": 1.0, "max_length": int(max_length), "min_length": 0,
            "no_repeat_ngram_size": 0, "num_beams": 1, "num_return_sequences": 1,
            "past_present_share_buffer": True, "repetition_penalty": 1.0,
            "temperature": 1.0, "top_k": 1, "top_p": 1.0,
        },
    }


_QUANTIZATIONS = (None, "dynamic", "int8", "int4")
# Float32 weights past this many bytes go to `model.onnx.data`, written
# tensor by tensor as they are made and memory-mapped by onnxruntime (4 KiB
# aligned). Inside the protobuf (2 GB at most) they sit in memory three times
# while the file is written and verified (the proto, its serialization, the
# session's copy): a 268M-parameter Gemma 3 peaked at 7.65 GB that way.
EXTERNAL_DATA_BYTES = 256 << 20


def genai_model_proto(model, *, max_length, quantization=None, writer="auto", accuracy_level=4,
                      opset=17, external_data=None, prompt_logits="last", shared=None, adapters=None):
    """The GenAI graph of `model` as an ONNX `ModelProto`, quantized (see
    `export_onnx_genai` for the arguments; `external_data`, `shared` and
    `adapters`: as `keras_attn.export.onnx_decoder.decoder_model_proto`'s,
    for the fused graph without "dynamic" quantization)."""
    checks.check_choice("quantization", quantization, _QUANTIZATIONS)
    writer = check_writer(writer, ("fused", "tf2onnx"))
    if adapters is not None:
        writer = _adapter_writer(writer, quantization)
    bits = {"int8": 8, "int4": 4}.get(quantization)
    proto, _ = direct_or_none(
        writer, lambda: onnx_decoder.decoder_model_proto(
            model, max_length=max_length, bits=bits, accuracy_level=accuracy_level, opset=opset,
            external_data=None if quantization == "dynamic" else external_data,
            prompt_logits=prompt_logits, shared=None if quantization == "dynamic" else shared,
            adapters=adapters),
        what="export_onnx_genai", direct_name="fused decoder writer",
        traced_name="the tf2onnx graph (slower in onnxruntime)")
    if proto is None:
        proto = onnx_genai_model(model, max_length=max_length, opset=opset)
        if bits is not None:
            proto = matmul_nbits(proto, bits=bits, accuracy_level=accuracy_level)
    if quantization == "dynamic":
        # The scheme bench_int8_schemes.py measured on decoders: every
        # projection int8, one activation scale per tensor (a decoding
        # step's rows are new tokens, not an encoder's first token).
        proto = quantize_matmul_weights(proto, first_token_apart=False, float_after_activation=False,
                                       inplace=True)
    return proto


ADAPTER_FILE = "adapter.onnx_adapter"


def _adapter_writer(writer, quantization):
    """The writer of a graph with its adapters as inputs: the direct one
    (the traced graph has its kernels merged)."""
    if writer == "traced":
        raise ValueError("Received an invalid value for argument `writer`: LoRA adapters as graph inputs "
                         "(adapters=True) are written by the direct writer only; the traced graph merges "
                         "them (adapters=False). Received: writer='traced'")
    if quantization == "dynamic":
        raise ValueError("Received an invalid value for argument `quantization`: with adapters=True, "
                         "None, 'int8' or 'int4' (the adapters stay float32 beside the base weights). "
                         "Received: quantization='dynamic'")
    return "direct"


def _adapters_of(model, max_length):
    """`model`'s LoRA factors by graph input name (`onnx_decoder.adapter_weights`),
    or ValueError when it has none to keep apart."""
    description = onnx_decoder.check_fusable_decoder(model, max_length, adapters=True)
    weights = onnx_decoder.adapter_weights(description)
    if not weights:
        raise ValueError(
            "The model has no LoRA adapter to write apart: enable PEFT-style LoRA "
            "(`model.enable_lora(rank)`, not style='keras', and not merged by `merge_lora`) or "
            "load one (`from_huggingface(..., adapter=...)`); without adapters, export with adapters=False.")
    return weights


def save_onnx_adapter(model, path, folder=None):
    """Writes `model`'s LoRA adapters as an ONNX Runtime adapter file
    (`onnxruntime.AdapterFormat`, `.onnx_adapter`) for a GenAI folder written
    by `export_onnx_genai(base, folder, ..., adapters=True)` from a model
    with the same base weights and the same adapted projections (any ranks
    and `lora_alpha`: each file holds its own A `(in, r)` and `(alpha / r)
    * B` `(r, out)`).

    Args:
        model: a `DecoderOnlyLM` with PEFT-style LoRA (`enable_lora`, or a
            PEFT adapter loaded by `from_huggingface(adapter=...)`), unmerged.
        path: the file to write (by convention `*.onnx_adapter`).
        folder: optional GenAI folder to check the adapter against: every
            tensor must be one of its `model.onnx`'s adapter inputs, with
            its input and output sizes (ValueError otherwise).

    Returns:
        `path`. In GenAI: `adapters = og.Adapters(og_model)`,
        `adapters.load(path, "name")`, `generator.set_active_adapter(adapters, "name")`.
    """
    weights = _adapters_of(model, None)
    if folder is not None:
        _check_adapter_inputs(weights, os.path.join(os.fspath(folder), "model.onnx"))
    _write_adapter(weights, path)
    return path


def _write_adapter(weights, path):
    import onnxruntime as ort

    adapter = ort.AdapterFormat()
    adapter.set_adapter_version(1)
    adapter.set_model_version(1)
    adapter.set_parameters({name: ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(value))
                            for name, value in weights.items()})
    adapter.export_adapter(os.fspath(path))


def _check_adapter_inputs(weights, model_path):
    import onnx

    graph = onnx.load(model_path, load_external_data=False).graph
    inputs = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in graph.input}
    for name, value in weights.items():
        if name not in inputs:
            adapter_inputs = sorted(n for n in inputs if ".lora_" in n)
            raise ValueError(f"The adapter tensor {name} is not an input of {model_path}, whose adapter inputs "
                             f"are {adapter_inputs}: adapt the same projections as the exported model.")
        want = [value.shape[i] if d == "lora_r" else d for i, d in enumerate(inputs[name])]
        if list(value.shape) != want:
            raise ValueError(f"The adapter tensor {name} has shape {value.shape}; {model_path} takes "
                             f"{inputs[name]} (lora_r: any rank).")


def export_onnx_genai(model, folder, *, max_length, tokenizer=None,
                      bos_token_id=None, eos_token_id=None, pad_token_id=None, opset=17,
                      quantization=None, writer="auto", accuracy_level=4, prompt_logits="last",
                      adapters=False):
    """Writes an ONNX Runtime GenAI folder for a keras_attn decoder.

    Args:
        model: a `DecoderOnlyLM` (built), e.g. from `keras_attn.convert`.
        folder: output directory (created).
        max_length: the longest sequence (prompt + generated) GenAI may ask
            for: the cache length.
        tokenizer: `tokenizer.json` path (or its folder), a
            `tokenizers.Tokenizer` or a transformers fast tokenizer; None
            writes no tokenizer (token ids only).
        bos_token_id, eos_token_id, pad_token_id: for `genai_config.json`
            (eos may be a list); default the model's `pad_token_id`.
        opset: ONNX opset.
        quantization: None (float32); "dynamic": int8 weights (per
            channel, 7-bit range) for every MatMul with a constant weight,
            activations quantized at run time (`MatMulInteger`); the integer
            arithmetic is exact on every CPU, with or without VNNI
            (`keras_attn.export.onnx_quantize`); "int8" / "int4": weights in
            symmetric blocks of 32 as `MatMulNBits` (what the GenAI model
            builder writes), computed per `accuracy_level`.
        writer: "auto" (the direct writer's fused graph where it covers
            the model, else tf2onnx with a warning), "direct" (raise
            `NotFusableError` where it does not) or "traced" (tf2onnx; see
            the module docstring).
        accuracy_level: `MatMulNBits`' compute precision for "int8"/"int4":
            4 (int8 arithmetic on CPUs with AVX2/AVX-512/ARM dot products,
            float32 elsewhere) or 0 (as the weights: float32).
        prompt_logits: "last" (default): a call returns each row's last
            token's logits `(B, 1, V)`, all that generation reads, so the
            head (a vocabulary-wide MatMul) and the last layer's tail run
            once per row instead of once per prompt token; "all": every
            position's `(B, T, V)` (e.g. to score a prompt through
            `generator.get_output("logits")`). The tf2onnx graph always
            returns every position.
        adapters: False (default): LoRA adapters (`enable_lora`) are merged
            into the weights, by every writer. True: the base weights are
            written without them, each adapted projection taking its A and
            `(alpha / r) * B` as graph inputs (empty by default: with no
            adapter active GenAI runs the base model), and this model's
            adapters go to `adapter.onnx_adapter` in the folder; further
            fine-tunes of the same base: `save_onnx_adapter`. The direct
            writer only; quantization None, "int8" or "int4" (of the base
            weights; the adapters stay float32).

    Returns:
        A `SignatureReport` (`keras_attn.runtimes.verification`; `path` is
        the folder, `files` the model, config and tokenizer files,
        `os.fspath(report)` the folder): `model.onnx`, run in onnxruntime
        as GenAI runs it (a prompt, then one token per call on the shared
        cache) over a random sequence before writing, against the Keras
        model's logits: float32 within 1e-4 of the largest logit (a
        `ParityError` otherwise, and `model.onnx` is removed); quantized
        weights: the share of next tokens equal to Keras's is reported
        (`agreement`), not checked.

    Example (needs `onnxruntime-genai`):

        export_onnx_genai(lm, "lm_genai", max_length=64, tokenizer="tokenizer.json")
        import onnxruntime_genai as og
        og_model = og.Model("lm_genai")
        params = og.GeneratorParams(og_model)
        params.set_search_options(max_length=32)
        generator = og.Generator(og_model, params)
        generator.append_tokens([[5, 6, 7]])
        while not generator.is_done():
            generator.generate_next_token()
        tokens = generator.get_sequence(0)

    With `adapters=True`, before generating:

        adapters = og.Adapters(og_model)
        adapters.load("lm_genai/adapter.onnx_adapter", "mine")
        generator.set_active_adapter(adapters, "mine")
    """
    if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1:
        raise ValueError(f"`max_length` must be a positive int. Received: max_length={max_length!r}")
    checks.check_choice("quantization", quantization, _QUANTIZATIONS)
    writer = check_writer(writer, ("fused", "tf2onnx"), stacklevel=3)
    checks.check_choice("prompt_logits", prompt_logits, onnx_decoder.PROMPT_LOGITS)
    checks.check_bool("adapters", adapters)
    check_runtime_decoder(model)
    adapter_weights = None
    if adapters:
        writer = _adapter_writer(writer, quantization)
        _adapters_of(model, max_length)
        adapter_weights = {}
    os.makedirs(folder, exist_ok=True)
    write_tokenizer(tokenizer, folder)
    if tokenizer_model_type(folder) == "WordPiece":
        raise ValueError(
            "ONNX Runtime GenAI's tokenizer reads BPE and SentencePiece tokenizers, not "
            "WordPiece (a word vocabulary from `word_tokenizer`): use a character or BPE "
            "tokenizer, or tokenizer=None and feed token ids. (LiteRT-LM reads WordPiece: "
            "`export_litertlm`.)")
    path = os.path.join(folder, "model.onnx")
    large = model.count_params() * 4 > EXTERNAL_DATA_BYTES
    if os.path.exists(path + ".data"):
        os.remove(path + ".data")  # an earlier export's weights
    shared = {}  # the weights written as the model holds them
    proto = genai_model_proto(model, max_length=max_length, quantization=quantization,
                              writer=writer, accuracy_level=accuracy_level, opset=opset,
                              external_data=path + ".data" if large else None,
                              prompt_logits=prompt_logits, shared=shared, adapters=adapter_weights)
    with open(path, "wb") as f:
        f.write(proto.SerializeToString())
    try:  # from the file: a large model's weights are in `model.onnx.data`
        verified = verify_genai_model(model, path, max_length=max_length,
                                      quantization=quantization, shared=shared, adapters=adapter_weights)
    except ParityError:
        for written in (path, path + ".data"):
            if os.path.exists(written):
                os.remove(written)
        raise
    if adapters:
        _write_adapter(adapter_weights, os.path.join(folder, ADAPTER_FILE))
    config = genai_config(model, max_length=max_length, bos_token_id=bos_token_id, eos_token_id=eos_token_id,
                          pad_token_id=pad_token_id)
    with open(os.path.join(folder, "genai_config.json"), "w") as f:
        json.dump(config, f, indent=2)
    files = {name: os.path.abspath(os.path.join(folder, name))
             for name in sorted(os.listdir(folder))
             if name in ("model.onnx", "genai_config.json", "tokenizer.json",
                         "tokenizer_config.json", "model.onnx.data", ADAPTER_FILE)}
    return verification.signature_report(
        "onnx_genai", folder, verified, ops=sorted({n.op_type for n in proto.graph.node}),
        files=files, details={"max_length": max_length, "opset": opset,
                              "quantization": quantization, "prompt_logits": prompt_logits,
                              "adapters": adapters})


def verify_genai_model(model, path, *, max_length, quantization=None, shared=None, adapters=None):
    """The GenAI graph at `path` (`model.onnx`) run in onnxruntime as GenAI
    runs it, against Keras (`verification.verify_prefill_decode`).

    `shared` (`{initializer name: array}`, from the writer): weights in
    `model.onnx.data` that are the Keras model's own memory. The session
    runs on those arrays instead of mapping the file (a float32 model would
    be resident twice), and the file's bytes are checked equal to them
    (`ParityError` otherwise), so what was run is what was written.
    `adapters` (`{input name: array}`): the model's LoRA factors, fed as
    GenAI feeds an active adapter (the Keras model computes with them)."""
    if shared:
        onnx_graph.check_external_data(path, shared)
    # No packed copies of float32 weights for a few calls: beside the Keras
    # model they would be a second copy of it. Quantized weights are packed
    # (a fraction of the model): unpacked, MatMulNBits unpacks every weight
    # on every call (4 s a call at 1.5B, int4).
    session = onnx_graph.inference_session(path, shared, prepack=quantization is not None)
    past = [i for i in session.get_inputs() if i.name.startswith("past_key_values.")]
    last_only = session.get_outputs()[0].shape[1] == 1  # logits (B, 1, V): the last token's

    def call(token_ids, total, cache):
        feeds = {"input_ids": token_ids.astype(np.int64),
                 "attention_mask": np.ones((token_ids.shape[0], total), np.int64)}
        feeds.update(zip((i.name for i in past), cache))
        feeds.update(adapters or {})
        logits, *present = session.run(None, feeds)
        return {"logits": logits, "cache": present}

    def prefill(token_ids):
        batch = token_ids.shape[0]
        empty = [np.zeros((batch, *i.shape[1:]), np.float32) for i in past]
        return call(token_ids, token_ids.shape[1], empty)

    def decode(token_ids, index, cache):
        return call(token_ids, int(index) + 1, cache)

    # Two decode calls (the second reads what the first wrote): without
    # prepacked weights each call packs every weight again, 1.5 s per call
    # for a 0.5B float32 model.
    return verification.verify_prefill_decode(
        "onnx_genai", model, prefill, decode, max_length=max_length,
        quantization=quantization, decode_steps=2,
        prefill_logits="last" if last_only else "all")
