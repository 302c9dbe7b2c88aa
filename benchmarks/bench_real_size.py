"""Real sizes (issue 36): time, peak memory and artifact size of each stage on
random weights in published model shapes.

Models (the published configurations, written below; random weights, saved
as bfloat16 safetensors the way the published checkpoints are):
BERT-base and BERT-large encoders (`BertModel`), ModernBERT-base
(`ModernBertModel`), EmbeddingGemma-300m's backbone (`Gemma3TextModel`,
bidirectional), Qwen2.5-0.5B, Llama-3.2-1B, Qwen2.5-1.5B (`*ForCausalLM`)
and Gemma 3 270M/1B. `--quick`: one tiny Llama, sharded.

Stages (`STAGES`, one entry each; later stages are added there):

- `checkpoint`: writes the model folder (`config.json` + safetensors
  shards, as `save_pretrained` lays them out). Not ours: it is the input,
  made once and reused from `--work`.
- `convert`: `keras_attn.convert.from_huggingface(folder)`.
- `save_weights`: converts, then times one `model.save_weights(...h5)`.
- `genai_fp32`, `genai_int8`, `genai_int4`: converts, then times `export_onnx_genai`
  (`max_length` 1024; the fused graph, verified against Keras).
- `builder_fp32`, `builder_int8`, `builder_int4`: the peer, ONNX Runtime GenAI's model
  builder, on the same folder (its whole run is the stage).
- `litertlm_int8`, `litertlm_int4`, `litertlm_fp32`: converts, then times
  `export_litertlm(lm, path, tokenizer=folder, max_length=1024,
  quantization="dynamic" / "int4" / None)`, with the export's phases (trace,
  saved_model, convert, int4, verify, bundle). The checkpoints have no
  tokenizer: a byte-level BPE is trained once and put beside symlinks to the
  checkpoint's files (`<work>/<model>/with_tokenizer`).
- `litert_torch_int8`, `litert_torch_fp32`: the peer, litert-torch's
  `export_hf` (its own venv, PEER_PYTHON; see bench_litertlm.py), on that
  folder: cache 1024, one prefill signature of 128.
- `litertlm_speed`: prefill and decode tokens/s in `litert_lm.Engine` of the
  bundles the stages above wrote, ours and the peer's of each precision in
  alternating rounds (`--prompt`, `--new`, `--rounds`).
- `sig_onnx`: converts, then times `keras_attn.runtimes.signatures.export_onnx`
  (prefill.onnx + decode.onnx, `max_length` 1024; the direct writer, weights
  in one shared file), with its phases (write ONNX, serialize, verify).
- `sig_tflite`, `sig_savedmodel`: converts, then times the prefill/decode
  signatures' `runtimes.signatures.export_tflite(max_length=1024,
  batch_size=1, prompt_length=128)` (`writer` says which TFLite writer ran)
  or `export_saved_model(max_length=1024)`, verification included.
- Encoder exports (BERT): `savedmodel`, `tflite`, `onnx` (export_onnx's
  default path), `onnx_fused` (`fused=True`), `onnx_tf2onnx` (forced
  tf2onnx), `export_all`: each converts, then times the export, its
  verification against Keras included; `cli`: `keras-attn export
  model.keras --format all` in a fresh process (the `.keras` file is made
  once by the `keras_file` stage, not ours). The peer `torch_onnx`: the
  transformers model (`BertModel`, `ModernBertModel`, ...)
  `.from_pretrained(folder, float32)` and `torch.onnx.export`
  (TorchScript exporter, dynamic batch and sequence axes) on the same
  folder; its export is timed like ours. The peer `optimum_onnx`:
  `optimum-cli export onnx --task feature-extraction` on the same folder
  (its own venv, OPTIMUM_PYTHON; its run, validation included, is the
  stage); `optimum_onnx_int8`: onnxruntime's `quantize_dynamic` of that
  export (the peer's int8). `tflite` writes encoders with the
  direct writer (`export_tflite`'s default); `tflite_converter` forces
  TensorFlow's converter, `tflite_dynamic` is int8 weights
  (`quantization="dynamic"`), as is `onnx_int8` (`export_onnx(quantization=
  "dynamic")`: int8 MatMul weights, activations quantized at run time).
- `latency`: batch-1 latency at 32, 128 and 512 tokens of the files the
  `onnx`, `onnx_int8`, `tflite`, `tflite_dynamic`, `torch_onnx`,
  `optimum_onnx` and `optimum_onnx_int8` stages left in `--work` and of the transformers model in
  torch eager (onnxruntime, LiteRT and torch, 2 threads, interleaved,
  `--rounds` rounds). The int8 exports' outputs are compared with our
  float32 ONNX export's: the cosine of each token's hidden state, its mean
  over the tokens and its minimum (random weights: their outliers are not a
  trained model's, see `QUANTIZED_LATENCY`).

Each stage runs in a fresh subprocess. The parent samples the child's RSS
with psutil every 20 ms and reads its `ru_maxrss` from `wait4`; the child
times its stage and samples its own RSS per phase (`convert`: reading the
checkpoint, building the Keras model, copying the weights; the phase
boundaries come from wrapping `keras_attn.convert` functions, so the same
script measures an older revision; a phase's peak is sampled by a Python
thread, so a C++ call that holds the GIL, such as the TFLite converter, shows
its peak only in the parent's samples). `--max-rss-gb` kills a child past that
peak (reported as such). `Keras bytes` is the size of the converted
model's variables; `peak / Keras` is the peak RSS over it.

    python benchmarks/bench_real_size.py --models bert-base,qwen2.5-0.5b --stages convert
    python benchmarks/bench_real_size.py --quick
"""

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import _common  # first: it sets the environment
import results_file  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
GB = 1e9

# The published configurations (config.json of each Hub repository).
MODELS = {
    "bert-base": dict(
        architecture="BertModel", model_type="bert",
        config=dict(vocab_size=30522, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                    intermediate_size=3072, max_position_embeddings=512, type_vocab_size=2,
                    hidden_act="gelu", layer_norm_eps=1e-12, pad_token_id=0),
    ),
    "bert-large": dict(
        architecture="BertModel", model_type="bert",
        config=dict(vocab_size=30522, hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                    intermediate_size=4096, max_position_embeddings=512, type_vocab_size=2,
                    hidden_act="gelu", layer_norm_eps=1e-12, pad_token_id=0),
    ),
    "qwen2.5-0.5b": dict(
        architecture="Qwen2ForCausalLM", model_type="qwen2",
        config=dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                    num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                    rope_theta=1000000.0, rms_norm_eps=1e-6, hidden_act="silu", tie_word_embeddings=True,
                    use_sliding_window=False, sliding_window=32768, max_window_layers=24,
                    bos_token_id=151643, eos_token_id=151643),
    ),
    "llama-3.2-1b": dict(
        architecture="LlamaForCausalLM", model_type="llama",
        config=dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                    num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                    max_position_embeddings=131072, rms_norm_eps=1e-5, hidden_act="silu",
                    rope_theta=500000.0, tie_word_embeddings=True, attention_bias=False, mlp_bias=False,
                    rope_scaling=dict(factor=32.0, high_freq_factor=4.0, low_freq_factor=1.0,
                                      original_max_position_embeddings=8192, rope_type="llama3"),
                    bos_token_id=128000, eos_token_id=128001),
    ),
    "qwen2.5-1.5b": dict(
        architecture="Qwen2ForCausalLM", model_type="qwen2",
        config=dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                    num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=131072,
                    rope_theta=1000000.0, rms_norm_eps=1e-6, hidden_act="silu", tie_word_embeddings=True,
                    use_sliding_window=False, sliding_window=131072, max_window_layers=28,
                    bos_token_id=151643, eos_token_id=151643),
    ),
    # Gemma 3 text: five sliding-window (512) layers to one global, two rotary
    # bases, QK-norm, sandwich norms, a 262k vocabulary (most of the 270M).
    "gemma3-270m": dict(
        architecture="Gemma3ForCausalLM", model_type="gemma3_text",
        config=dict(vocab_size=262144, hidden_size=640, intermediate_size=2048, num_hidden_layers=18,
                    num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                    hidden_activation="gelu_pytorch_tanh", max_position_embeddings=32768,
                    query_pre_attn_scalar=256, rms_norm_eps=1e-6, rope_theta=1000000.0,
                    rope_local_base_freq=10000.0, sliding_window=512,
                    layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 3,
                    tie_word_embeddings=True, bos_token_id=2, eos_token_id=1, pad_token_id=0),
    ),
    "gemma3-1b": dict(
        architecture="Gemma3ForCausalLM", model_type="gemma3_text",
        config=dict(vocab_size=262144, hidden_size=1152, intermediate_size=6912, num_hidden_layers=26,
                    num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                    hidden_activation="gelu_pytorch_tanh", max_position_embeddings=32768,
                    query_pre_attn_scalar=256, rms_norm_eps=1e-6, rope_theta=1000000.0,
                    rope_local_base_freq=10000.0, sliding_window=512,
                    layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 4 + ["sliding_attention"] * 2,
                    tie_word_embeddings=True, bos_token_id=2, eos_token_id=1, pad_token_id=0),
    ),
    # Today's encoders. ModernBERT-base (answerdotai/ModernBERT-base's
    # config.json; architecture ModernBertModel, the backbone without the MLM
    # head): alternating attention, a 128-token local window on two layers
    # of three, two rotary bases, no biases, 8192 positions.
    "modernbert-base": dict(
        architecture="ModernBertModel", model_type="modernbert",
        inputs=("input_ids", "attention_mask"),
        config=dict(vocab_size=50368, hidden_size=768, num_hidden_layers=22, num_attention_heads=12,
                    intermediate_size=1152, hidden_activation="gelu", max_position_embeddings=8192,
                    local_attention=128, global_attn_every_n_layers=3, global_rope_theta=160000.0,
                    local_rope_theta=10000.0, norm_eps=1e-5, norm_bias=False, attention_bias=False,
                    mlp_bias=False, pad_token_id=50283, bos_token_id=50281, eos_token_id=50282,
                    cls_token_id=50281, sep_token_id=50282),
    ),
    # EmbeddingGemma-300m's backbone (google/embeddinggemma-300m's
    # config.json: Gemma3TextModel, bidirectional; the published
    # sliding_window 512 is the band |i - j| < 257, see convert/gemma2.py).
    "embeddinggemma-300m": dict(
        architecture="Gemma3TextModel", model_type="gemma3_text",
        # The TorchScript tracer fails on transformers' padding mask
        # (`RuntimeError: unordered_map::at` in its vmap), and the window's
        # `bitwise_and` needs opset 18: the peer takes ids only (no padding).
        inputs=("input_ids",), torch_opset=18,
        config=dict(vocab_size=262144, hidden_size=768, intermediate_size=1152, num_hidden_layers=24,
                    num_attention_heads=3, num_key_value_heads=1, head_dim=256,
                    hidden_activation="gelu_pytorch_tanh", max_position_embeddings=2048,
                    query_pre_attn_scalar=256, rms_norm_eps=1e-6, rope_theta=1000000.0,
                    rope_local_base_freq=10000.0, sliding_window=512, use_bidirectional_attention=True,
                    layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 4,
                    attention_bias=False, bos_token_id=2, eos_token_id=1, pad_token_id=0),
    ),
    # The encoder stages at test size.
    "tiny-bert": dict(
        architecture="BertModel", model_type="bert",
        config=dict(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                    intermediate_size=128, max_position_embeddings=64, type_vocab_size=2,
                    hidden_act="gelu", layer_norm_eps=1e-12, pad_token_id=0),
    ),
    # --quick: small enough for a test, sharded to exercise the index.
    "tiny-llama": dict(
        architecture="LlamaForCausalLM", model_type="llama", shard_bytes=40_000,
        config=dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                    rms_norm_eps=1e-5, hidden_act="silu", tie_word_embeddings=False),
    ),
}

DEFAULT_MODELS = ("bert-base", "qwen2.5-0.5b", "llama-3.2-1b")


# ---------------------------------------------------------------------------
# Measurement inside the child


class Sampler:
    """This process's RSS every `interval` seconds, with named phases: the
    peak within each phase and the RSS at its end."""

    def __init__(self, interval=0.02):
        import psutil

        self._process = psutil.Process()
        self._interval = interval
        self._lock = threading.Lock()
        self._phase_peak = 0
        self.phases = []  # (name, seconds, peak bytes, end bytes)
        self._name, self._start = None, None
        self._stop = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def _rss(self):
        return self._process.memory_info().rss

    def _run(self):
        while not self._stop.is_set():
            rss = self._rss()
            with self._lock:
                self._phase_peak = max(self._phase_peak, rss)
            self._stop.wait(self._interval)

    def mark(self, name):
        """Ends the current phase (if any) and starts `name` (None: stop)."""
        now, rss = time.perf_counter(), self._rss()
        with self._lock:
            if self._name is not None:
                peak = max(self._phase_peak, rss)
                self.phases.append((self._name, now - self._start, peak, rss))
                # Also as it ends: a child killed past --max-rss-gb still
                # reports the phases it finished.
                print("PHASE " + json.dumps(self.phases[-1]), file=sys.stderr, flush=True)
            self._name, self._start, self._phase_peak = name, now, rss
        if name is None:
            self._stop.set()


def _wrap(module, attribute, before=None, after=None, once=False):
    """Calls `before()` / `after()` around `module.attribute` (if it exists)."""
    original = getattr(module, attribute, None)
    if original is None:
        return
    state = {"done": False}

    def wrapper(*args, **kwargs):
        active = not (once and state["done"])
        state["done"] = True
        if active and before:
            before()
        result = original(*args, **kwargs)
        if active and after:
            after()
        return result

    setattr(module, attribute, wrapper)


def _convert(sampler, folder, dtype):
    """`from_huggingface(folder)` with phases: import (keras_attn, Keras,
    TensorFlow), read (from the call to the family converter: torch model or
    checkpoint index, and what they import), build (the Keras model with its
    initial values), copy (the weights)."""
    sampler.mark("import")
    from keras_attn.convert import common
    from keras_attn.convert import from_huggingface
    from keras_attn.convert import registry

    # read: from the call until the family converter starts.
    _wrap(registry, "convert", before=lambda: sampler.mark("build"))
    # build ends at the first weight copied.
    _wrap(common, "assign", before=lambda: sampler.mark("copy"), once=True)
    kwargs = {} if dtype is None else {"dtype": dtype}
    sampler.mark("read")
    start = time.perf_counter()
    model = from_huggingface(folder, **kwargs)
    seconds = time.perf_counter() - start
    sampler.mark(None)
    return model, seconds


def _keras_bytes(model):
    import numpy as np

    return int(sum(np.prod(v.shape) * np.dtype(v.dtype).itemsize for v in model.weights))


def _dir_bytes(path):
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


# ---------------------------------------------------------------------------
# Stages: run(spec, paths, args) -> dict (in the child); `paths` has
# "checkpoint" (the model folder) and "work" (this model's scratch directory).


def _write_published_config(spec, folder):
    """`config.json` as the Hub repository has it: the published keys as
    written in MODELS. (transformers 5's `save_pretrained` rewrites some of
    them, e.g. Gemma 3's `rope_theta`/`rope_local_base_freq` become
    `rope_parameters`, which the GenAI model builder does not read; users
    convert the published files.)"""
    config = dict(spec["config"], architectures=[spec["architecture"]], model_type=spec["model_type"],
                  torch_dtype="bfloat16")
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)


def stage_checkpoint(name, spec, paths, args):
    """Random bfloat16 tensors for the model's parameters, written straight
    into safetensors shards (the model is built on the meta device: no
    float32 copy), with `config.json` and the shard index as `save_pretrained`
    writes them."""
    import numpy as np
    import torch
    import transformers
    from safetensors.torch import save_file

    folder = paths["checkpoint"]
    config = transformers.AutoConfig.for_model(spec["model_type"], **spec["config"])
    config.architectures = [spec["architecture"]]
    if hasattr(config, "dtype"):
        config.dtype = torch.bfloat16
    config.torch_dtype = torch.bfloat16
    with torch.device("meta"):
        model = getattr(transformers, spec["architecture"])(config)
    # named_parameters() drops tied duplicates (lm_head.weight of a tied
    # model), as save_pretrained does.
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    del model
    tmp = folder + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    _write_published_config(spec, tmp)
    generator = torch.Generator().manual_seed(0)
    shard_bytes = spec.get("shard_bytes", args.shard_gb * GB)
    shards, current, size = [], {}, 0
    for n, shape in shapes.items():
        if "norm" in n.lower() and n.endswith("weight"):
            tensor = torch.ones(shape, dtype=torch.bfloat16)
        else:
            tensor = (torch.randn(shape, generator=generator) * 0.02).to(torch.bfloat16)
        nbytes = tensor.numel() * 2
        if current and size + nbytes > shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[n] = tensor
        size += nbytes
    shards.append(current)
    if len(shards) == 1:
        save_file(shards[0], os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
    else:
        weight_map, total = {}, 0
        for i, shard in enumerate(shards):
            file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, os.path.join(tmp, file), metadata={"format": "pt"})
            weight_map.update({n: file for n in shard})
            total += sum(t.numel() * 2 for t in shard.values())
        with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    shutil.rmtree(folder, ignore_errors=True)
    os.rename(tmp, folder)
    info = {"parameters": int(sum(np.prod(s) for s in shapes.values())), "artifact_bytes": _dir_bytes(folder)}
    with open(os.path.join(paths["work"], "checkpoint.json"), "w") as f:
        json.dump(info, f)
    return info


def stage_convert(name, spec, paths, args):
    sampler = Sampler()
    model, seconds = _convert(sampler, paths["checkpoint"], args.dtype)
    return {"seconds": seconds, "keras_bytes": _keras_bytes(model), "phases": sampler.phases}


def stage_save_weights(name, spec, paths, args):
    sampler = Sampler()
    model, _ = _convert(sampler, paths["checkpoint"], args.dtype)
    path = os.path.join(paths["work"], "model.weights.h5")
    sampler.mark("save")
    start = time.perf_counter()
    model.save_weights(path)
    seconds = time.perf_counter() - start
    sampler.mark(None)
    return {"seconds": seconds, "keras_bytes": _keras_bytes(model), "phases": sampler.phases[-1:],
            "artifact_bytes": _dir_bytes(path)}


GENAI_MAX_LENGTH = 1024


def _genai_stage(quantization):
    def stage(name, spec, paths, args):
        """Converts, then times `export_onnx_genai` (the fused graph, its
        verification against Keras included)."""
        from keras_attn.runtimes import export_onnx_genai

        sampler = Sampler()
        model, _ = _convert(sampler, paths["checkpoint"], args.dtype)
        folder = os.path.join(paths["work"], f"genai_{quantization or 'fp32'}")
        shutil.rmtree(folder, ignore_errors=True)
        sampler.mark("export")
        start = time.perf_counter()
        export_onnx_genai(model, folder, max_length=GENAI_MAX_LENGTH, quantization=quantization)
        seconds = time.perf_counter() - start
        sampler.mark(None)
        return {"seconds": seconds, "keras_bytes": _keras_bytes(model), "phases": sampler.phases,
                "artifact_bytes": _dir_bytes(folder)}
    return stage


def _builder_command(precision):
    def command(name, paths):
        """The ONNX Runtime GenAI model builder on the same folder (the peer;
        with a tokenizer beside it: without one the builder tries to make it
        from a slow tokenizer, which Llama's needs sentencepiece for)."""
        folder = os.path.join(paths["work"], f"builder_{precision}")
        shutil.rmtree(folder, ignore_errors=True)
        return folder, [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", _with_tokenizer(paths),
                        "-o", folder, "-p", precision, "-e", "cpu",
                        "-c", os.path.join(paths["work"], "builder_cache")]
    return command


LITERTLM_MAX_LENGTH = 1024
# The peer's one prefill signature; ours keeps its defaults (32, 128).
LITERTLM_PEER_PREFILL = 128
PEER_PYTHON = os.environ.get("PEER_PYTHON", "/work/venv-litert-torch/bin/python")


def _with_tokenizer(paths):
    """The checkpoint folder plus a tokenizer (the random checkpoints have
    none; both LiteRT-LM exporters pack one): a sibling folder of symlinks to
    the checkpoint's files and a byte-level BPE trained here
    (bench_genai.trained_tokenizer), made once."""
    folder = os.path.join(paths["work"], "with_tokenizer")
    if os.path.exists(os.path.join(folder, "tokenizer.json")):
        return folder
    import transformers
    from bench_genai import trained_tokenizer

    tmp = folder + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    for file in os.listdir(paths["checkpoint"]):
        os.symlink(os.path.join(paths["checkpoint"], file), os.path.join(tmp, file))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=trained_tokenizer(32000),
                                                eos_token="<eos>", pad_token="<pad>",
                                                bos_token="<eos>")
    fast.save_pretrained(tmp)
    shutil.rmtree(folder, ignore_errors=True)
    os.rename(tmp, folder)
    return folder


def _litertlm_phases(sampler):
    """Marks the export's phases by wrapping what it calls: trace (the
    tf.functions and their concrete graphs), freeze (variables to constants,
    where a revision does that), saved_model (writing the graph for the
    converter), convert (the TFLite converter, its quantizer included), int4
    (ai-edge-quantizer), verify (LiteRT against Keras), bundle (the
    `.litertlm` file)."""
    import tensorflow as tf
    from tensorflow.lite.python import lite
    from tensorflow.python.framework import convert_to_constants

    from keras_attn.runtimes import litertlm
    from keras_attn.runtimes import tflite_convert

    _wrap(convert_to_constants, "convert_variables_to_constants_v2",
          before=lambda: sampler.mark("freeze"), once=True)
    _wrap(tf.saved_model, "save", before=lambda: sampler.mark("saved_model"), once=True)
    _wrap(lite.TFLiteSavedModelConverterV2, "_convert_from_saved_model",
          before=lambda: sampler.mark("convert"),
          once=True)
    _wrap(tflite_convert, "_int4_weights", before=lambda: sampler.mark("int4"), once=True)
    _wrap(litertlm, "_verify", before=lambda: sampler.mark("verify"),
          after=lambda: sampler.mark("bundle"), once=True)


def _litertlm_path(paths, quantization):
    return os.path.join(paths["work"], f"litertlm_{quantization or 'fp32'}.litertlm")


def _litertlm_stage(quantization):
    def stage(name, spec, paths, args):
        """Converts, then times `export_litertlm(lm, path, tokenizer=folder,
        max_length=1024, quantization=...)` (verification included; the
        agreement threshold is 0: random weights give near-flat logits)."""
        from keras_attn.runtimes import export_litertlm

        folder = _with_tokenizer(paths)
        sampler = Sampler()
        model, _ = _convert(sampler, folder, args.dtype)
        _litertlm_phases(sampler)
        path = _litertlm_path(paths, quantization)
        sampler.mark("trace")
        start = time.perf_counter()
        report = export_litertlm(model, path, tokenizer=folder, max_length=LITERTLM_MAX_LENGTH,
                                 quantization=quantization, stop_token_ids=[1], min_agreement=0.0)
        seconds = time.perf_counter() - start
        sampler.mark(None)
        return {"seconds": seconds, "keras_bytes": _keras_bytes(model), "phases": sampler.phases,
                "artifact_bytes": _dir_bytes(path), "writer": report.writer}
    return stage


PEER_RECIPES = {"int8": "dynamic_wi8_afp32", "fp32": "none"}


def _peer_folder(paths, precision):
    return os.path.join(paths["work"], f"litert_torch_{precision}")


def _litert_torch_command(precision):
    def command(name, paths):
        """litert-torch's Hugging Face exporter on the same folder (the peer;
        its own venv, PEER_PYTHON), as bench_litertlm.py drives it."""
        folder = _peer_folder(paths, precision)
        shutil.rmtree(folder, ignore_errors=True)
        return folder, [PEER_PYTHON, "-m", "litert_torch.generative.export_hf",
                        "--model", _with_tokenizer(paths), "--output_dir", folder,
                        f"--prefill_lengths=[{LITERTLM_PEER_PREFILL}]",
                        f"--cache_length={LITERTLM_MAX_LENGTH}",
                        f"--quantization_recipe={PEER_RECIPES[precision]}"]
    return command


def stage_litertlm_speed(name, spec, paths, args):
    """Prefill and decode tokens/s in `litert_lm.Engine` (CPU) of ours and
    litert-torch's bundle of each precision present (written by the stages
    above), in alternating rounds (bench_litertlm.run_bundle: the engine's
    own counters); one precision's pair loaded at a time."""
    import glob

    results = {}
    for precision, ours_q in (("int8", "dynamic"), ("fp32", None)):
        bundles = {}
        if os.path.exists(_litertlm_path(paths, ours_q)):
            bundles["keras_attn"] = _litertlm_path(paths, ours_q)
        found = glob.glob(os.path.join(_peer_folder(paths, precision), "**", "*.litertlm"),
                          recursive=True)
        if found:
            bundles["litert-torch"] = found[0]
        if bundles:
            results.update(_engine_speeds({f"{n} {precision}": p for n, p in bundles.items()},
                                          paths, args))
    return {"speeds": results, "load": os.getloadavg()}


def _engine_speeds(bundles, paths, args):
    """`{name: {"prefill_tps", "decode_tps", "tokens", "bundle_bytes"}}` of
    `bundles` (`{name: path}`) in `litert_lm.Engine` (CPU), loaded together
    and run in alternating rounds on one random prompt (median of the
    rounds, after a warm-up)."""
    import statistics

    import litert_lm
    import numpy as np
    import tokenizers
    from bench_litertlm import run_bundle

    folder = _with_tokenizer(paths)
    tok = tokenizers.Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))
    rng = np.random.default_rng(1)
    text = tok.decode([int(t) for t in rng.integers(300, tok.get_vocab_size(), args.prompt)])
    engines = {n: litert_lm.Engine(p, backend=litert_lm.Backend.CPU(), enable_benchmark=True)
               for n, p in bundles.items()}
    speeds = {n: {"prefill": [], "decode": [], "tokens": None} for n in bundles}
    try:
        for engine in engines.values():  # warm-up
            run_bundle(engine, text, args.new)
        for r in range(args.rounds):
            for n in (list(engines) if r % 2 == 0 else list(reversed(engines))):
                prefill, decode, _, info = run_bundle(engines[n], text, args.new)
                speeds[n]["prefill"].append(prefill)
                speeds[n]["decode"].append(decode)
                speeds[n]["tokens"] = (info.last_prefill_token_count, info.last_decode_token_count)
    finally:
        for engine in engines.values():
            engine.close()
    return {n: {"prefill_tps": statistics.median(s["prefill"]),
                "decode_tps": statistics.median(s["decode"]), "tokens": s["tokens"],
                "bundle_bytes": os.path.getsize(bundles[n])} for n, s in speeds.items()}


def stage_litertlm_speed_int4(name, spec, paths, args):
    """Prefill and decode tokens/s in `litert_lm.Engine` (CPU) of our int4
    bundle (`litertlm_int4`) beside our int8 one (`litertlm_int8`) and
    litert-torch's int8 one (`litert_torch_int8`), the three loaded together
    and run in alternating rounds."""
    import glob

    bundles = {}
    for label, path in (("keras_attn int4", _litertlm_path(paths, "int4")),
                        ("keras_attn int8", _litertlm_path(paths, "dynamic"))):
        if os.path.exists(path):
            bundles[label] = path
    found = glob.glob(os.path.join(_peer_folder(paths, "int8"), "**", "*.litertlm"), recursive=True)
    if found:
        bundles["litert-torch int8"] = found[0]
    if "keras_attn int4" not in bundles:
        raise RuntimeError("no int4 bundle: run the litertlm_int4 stage first")
    return {"speeds": _engine_speeds(bundles, paths, args), "load": os.getloadavg()}


# The prefill/decode signatures (keras_attn.runtimes.signatures) at a
# LiteRT-LM bundle's sizes: cache 1024, one row, prompts of 128.
SIGNATURES_PROMPT = 128


def _signature_phases(sampler):
    """Marks the signature exports' steps (looked up at call time)."""
    import tensorflow as tf

    from keras_attn.runtimes import signatures, tflite_convert, verification

    mark = sampler.mark
    _wrap(signatures, "signature_functions", before=lambda: mark("trace"))
    _wrap(tflite_convert, "signatures_to_tflite", before=lambda: mark("TFLite converter"))
    try:
        from keras_attn.export import tflite_signatures
    except ImportError:  # a revision without the direct writer
        pass
    else:
        _wrap(tflite_signatures, "write_signatures_tflite", before=lambda: mark("write .tflite"))
    _wrap(tf.saved_model, "save", before=lambda: mark("write SavedModel"),
          after=lambda: mark("check written"))
    _wrap(verification, "verify_prefill_decode", before=lambda: mark("verify"))


def _signatures_stage(fmt):
    def stage(name, spec, paths, args):
        """Converts, then times `runtimes.signatures.export_tflite(max_length=1024,
        batch_size=1, prompt_length=128)` or `export_saved_model(max_length=1024)`
        (verification against Keras included)."""
        from keras_attn.runtimes import signatures

        sampler = Sampler()
        model, _ = _convert(sampler, paths["checkpoint"], args.dtype)
        _signature_phases(sampler)
        out = os.path.join(paths["work"], f"sig_{fmt}")
        shutil.rmtree(out, ignore_errors=True)
        os.makedirs(out)
        sampler.mark("export")
        start = time.perf_counter()
        if fmt == "tflite":
            report = signatures.export_tflite(model, os.path.join(out, "lm.tflite"),
                                              max_length=LITERTLM_MAX_LENGTH, batch_size=1,
                                              prompt_length=SIGNATURES_PROMPT)
        else:
            report = signatures.export_saved_model(model, os.path.join(out, "lm"),
                                                   max_length=LITERTLM_MAX_LENGTH)
        seconds = time.perf_counter() - start
        sampler.mark(None)
        return {"seconds": seconds, "keras_bytes": _keras_bytes(model), "phases": sampler.phases,
                "artifact_bytes": _dir_bytes(out), "writer": report.details.get("writer"),
                "max_abs_error": report.max_abs_error}
    return stage


# Encoder exports: the phases are marked by wrapping the exporters' steps
# (looked up at call time), so an older revision is measured the same way.
def _export_phases(sampler):
    from keras_attn.export import onnx as onnx_lib
    from keras_attn.export import onnx_fused
    from keras_attn.export import saved_model as saved_model_lib
    from keras_attn.export import tflite as tflite_lib
    from keras_attn.export import verify

    mark = sampler.mark
    _wrap(saved_model_lib, "write_saved_model", before=lambda: mark("write SavedModel"),
          after=lambda: mark("load SavedModel"))
    _wrap(tflite_lib, "convert", before=lambda: mark("TFLite convert"),
          after=lambda: mark("write .tflite"))
    import tensorflow as tf

    _wrap(tf.lite.TFLiteConverter, "from_saved_model", before=lambda: mark("TFLite converter"))
    _wrap(onnx_lib, "convert", before=lambda: mark("tf2onnx"),
          after=lambda: mark("serialize ONNX"))
    _wrap(onnx_fused, "fused_model_proto", before=lambda: mark("write ONNX graph"),
          after=lambda: mark("serialize ONNX"))
    for module in (onnx_fused, onnx_lib):
        for attribute in ("write_graph", "direct_model_proto"):
            _wrap(module, attribute, before=lambda: mark("write ONNX graph"),
                  after=lambda: mark("serialize ONNX"))
    # export_onnx(quantization=...): the float32 graph in memory, then int8.
    _wrap(onnx_lib, "quantized_proto", before=lambda: mark("quantize int8"),
          after=lambda: mark("serialize ONNX"))
    _wrap(verify, "verify_artifact", before=lambda: mark("verify"))
    try:  # the direct TFLite writer of encoders (absent before it was written)
        from keras_attn.export import tflite_encoder

        _wrap(tflite_encoder, "write_encoder_tflite", before=lambda: mark("TFLite direct writer"),
              after=lambda: mark("LiteRT interpreter"))
    except ImportError:
        pass
    for module, attribute, label in ((saved_model_lib, "export_saved_model", "SavedModel"),
                                     (tflite_lib, "export_tflite", "TFLite"),
                                     (onnx_lib, "export_onnx", "ONNX")):
        _wrap(module, attribute, before=lambda label=label: mark(f"[{label}]"))


def _export_stage(fmt, **kwargs):
    def stage(name, spec, paths, args):
        """Converts, then times one export (its verification included)."""
        import keras_attn.export as export
        from keras_attn.export import all_formats

        sampler = Sampler()
        model, _ = _convert(sampler, paths["checkpoint"], args.dtype)
        sampler.mark("export")
        _export_phases(sampler)
        out = os.path.join(paths["work"], f"export_{fmt}")
        shutil.rmtree(out, ignore_errors=True)
        os.makedirs(out)
        start = time.perf_counter()
        if fmt == "savedmodel":
            report = export.export_saved_model(model, out, model_name="bert", **kwargs)
            artifact = report.path
        elif fmt.startswith("tflite"):
            report = export.export_tflite(model, os.path.join(out, "bert.tflite"), **kwargs)
            artifact = report.path
        elif fmt.startswith("onnx"):
            report = export.export_onnx(model, os.path.join(out, "bert.onnx"), **kwargs)
            artifact = report.path
        else:
            # export_all's own module functions, so the per-format phases show.
            report = all_formats.export_all(model, out, name="bert", verbose=False, **kwargs)
            artifact = out
        seconds = time.perf_counter() - start
        sampler.mark(None)
        result = {"seconds": seconds, "keras_bytes": _keras_bytes(model), "phases": sampler.phases,
                  "artifact_bytes": _dir_bytes(artifact)}
        reports = report if fmt == "export_all" else {fmt: report}
        result["max_abs_error"] = {k: r.max_abs_error for k, r in reports.items()}
        # Which writer ran, and why "auto" skipped the direct one.
        result["writer"] = "; ".join(
            f"{k}: " + " ".join(str(r.details[d]) for d in ("writer", "direct_writer_skipped") if d in r.details)
            for k, r in reports.items() if "writer" in r.details)
        return result
    return stage


def stage_sig_onnx(name, spec, paths, args):
    """Converts, then times `keras_attn.runtimes.signatures.export_onnx`
    (`max_length` 1024; the direct writer where it covers the model, its
    verification in onnxruntime against Keras included)."""
    from keras_attn.export import onnx_signatures
    from keras_attn.runtimes import signatures, verification

    sampler = Sampler()
    model, _ = _convert(sampler, paths["checkpoint"], args.dtype)
    folder = os.path.join(paths["work"], "sig_onnx")
    shutil.rmtree(folder, ignore_errors=True)
    sampler.mark("export")
    _wrap(onnx_signatures, "signature_models", before=lambda: sampler.mark("write ONNX"),
          after=lambda: sampler.mark("serialize"))
    _wrap(verification, "verify_prefill_decode", before=lambda: sampler.mark("verify"),
          after=lambda: sampler.mark("move"))
    start = time.perf_counter()
    report = signatures.export_onnx(model, folder, max_length=GENAI_MAX_LENGTH)
    seconds = time.perf_counter() - start
    sampler.mark(None)
    return {"seconds": seconds, "keras_bytes": _keras_bytes(model), "phases": sampler.phases,
            "artifact_bytes": _dir_bytes(folder), "writer": report.details["writer"],
            "max_abs_error": report.max_abs_error, "atol": report.atol}


def stage_keras_file(name, spec, paths, args):
    """The converted model saved as `.keras`, the CLI's input (not ours)."""
    sampler = Sampler()
    model, _ = _convert(sampler, paths["checkpoint"], args.dtype)
    path = os.path.join(paths["work"], "model.keras")
    model.save(path)
    return {"artifact_bytes": _dir_bytes(path)}


def _cli_command(name, paths):
    """`keras-attn export model.keras --format all` (a fresh process: the user's run)."""
    out = os.path.join(paths["work"], "export_cli")
    shutil.rmtree(out, ignore_errors=True)
    return out, [sys.executable, "-c", "import sys, keras_attn_cli; sys.exit(keras_attn_cli.main())",
                 "export", os.path.join(paths["work"], "model.keras"), "--out", out]


BERT_INPUTS = ("input_ids", "attention_mask", "token_type_ids")


def stage_torch_onnx(name, spec, paths, args):
    """The peer: the transformers model of `spec["architecture"]` from the
    same folder (float32, its default attention), then `torch.onnx.export`
    (TorchScript exporter: onnxscript, which the dynamo exporter needs, is
    not installed), dynamic batch and sequence axes."""
    sampler = Sampler()
    sampler.mark("import")
    import torch
    import transformers

    sampler.mark("read")
    model = getattr(transformers, spec["architecture"]).from_pretrained(
        paths["checkpoint"], dtype=torch.float32, **spec.get("torch_kwargs", {})).eval()
    keras_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    path = os.path.join(paths["work"], "torch_onnx", "model.onnx")
    shutil.rmtree(os.path.dirname(path), ignore_errors=True)
    os.makedirs(os.path.dirname(path))
    names = list(spec.get("inputs", BERT_INPUTS))
    ids = torch.ones((2, 8), dtype=torch.int64)
    example = tuple(torch.zeros_like(ids) if n == "token_type_ids" else ids for n in names)
    outputs = ["last_hidden_state"] + (["pooler_output"] if spec["architecture"] == "BertModel" else [])
    axes = {n: {0: "batch", 1: "sequence"} for n in names + ["last_hidden_state"]}
    axes.update({n: {0: "batch"} for n in outputs[1:]})

    class Positional(torch.nn.Module):
        # transformers 5's forward takes keyword-only extras the tracer would
        # fill positionally: the inputs by position, a tuple out.
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, *inputs):
            out = self.inner(**dict(zip(names, inputs)))
            return tuple(getattr(out, n) for n in outputs)

    sampler.mark("export")
    start = time.perf_counter()
    with torch.no_grad():
        torch.onnx.export(Positional(model), example, path, input_names=names, output_names=outputs,
                          dynamic_axes=axes, opset_version=spec.get("torch_opset", 17), dynamo=False)
    seconds = time.perf_counter() - start
    sampler.mark(None)
    return {"seconds": seconds, "keras_bytes": keras_bytes, "phases": sampler.phases,
            "artifact_bytes": _dir_bytes(path)}


OPTIMUM_PYTHON = os.environ.get("OPTIMUM_PYTHON", "/work/venv-optimum/bin/python")


def _optimum_command(name, paths):
    """The peer: Optimum's ONNX export of the same folder (`optimum-cli
    export onnx --task feature-extraction`, float32, its validation against
    transformers included), from its own venv (OPTIMUM_PYTHON, made by
    install_peers.sh; it pins its own transformers)."""
    folder = os.path.join(paths["work"], "optimum_onnx")
    shutil.rmtree(folder, ignore_errors=True)
    cli = os.path.join(os.path.dirname(OPTIMUM_PYTHON), "optimum-cli")
    return folder, ["env", "HF_HUB_OFFLINE=1", cli, "export", "onnx", "-m", paths["checkpoint"],
                    "--task", "feature-extraction", folder]


def stage_optimum_onnx_int8(name, spec, paths, args):
    """The peer's int8: onnxruntime's `quantize_dynamic` (int8 weights,
    activations quantized at run time, Optimum's `onnxruntime quantize`
    default) of the `optimum_onnx` export, timed; the latency stage measures
    its cosine like ours, so a loss of signal that both int8 exports show is
    the weights', not our writer's."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    source = os.path.join(paths["work"], "optimum_onnx", "model.onnx")
    out = os.path.join(paths["work"], "optimum_onnx_int8")
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    sampler = Sampler()
    sampler.mark("export")
    start = time.perf_counter()
    quantize_dynamic(source, os.path.join(out, "model.onnx"), weight_type=QuantType.QInt8)
    seconds = time.perf_counter() - start
    sampler.mark(None)
    return {"seconds": seconds, "phases": sampler.phases, "artifact_bytes": _dir_bytes(out)}


LATENCY_LENGTHS = (32, 128, 512)
LATENCY_THREADS = 2


def _feed_value(input_name, ids, mask):
    """The value of an export's input by its name: the padding mask, zero
    segment ids, else the token ids."""
    import numpy as np

    if "mask" in input_name:
        return mask
    if "position" in input_name:
        return np.broadcast_to(np.arange(ids.shape[1]), ids.shape)
    return np.zeros_like(ids) if "type" in input_name or "segment" in input_name else ids


def _torch_eager_runner(spec, paths):
    """The transformers model (float32, its default attention, 2 threads)
    as `run(ids, mask) -> last_hidden_state`: the peer without an export."""
    import torch
    import transformers

    torch.set_num_threads(LATENCY_THREADS)
    model = getattr(transformers, spec["architecture"]).from_pretrained(
        paths["checkpoint"], dtype=torch.float32, **spec.get("torch_kwargs", {})).eval()
    names = list(spec.get("inputs", BERT_INPUTS))

    def run(ids, mask):
        with torch.inference_mode():
            feeds = {n: torch.from_numpy(_feed_value(n, ids, mask).astype("int64")) for n in names}
            return model(**feeds).last_hidden_state.numpy()
    return run


def _latency_runners(spec, paths):
    """The artifacts the `onnx`, `tflite`, `torch_onnx` and `optimum_onnx`
    stages left in the work folder (those present), and the transformers
    model in torch eager, each as `run(ids, mask) -> output`."""
    import numpy as np

    runners = {}
    for label, path in (("ours ONNX", ("export_onnx", "bert.onnx")),
                        ("ours ONNX int8", ("export_onnx_int8", "bert.onnx")),
                        ("peer ONNX (torch.onnx.export)", ("torch_onnx", "model.onnx")),
                        ("peer ONNX (Optimum)", ("optimum_onnx", "model.onnx")),
                        ("peer ONNX int8 (Optimum + quantize_dynamic)", ("optimum_onnx_int8", "model.onnx"))):
        path = os.path.join(paths["work"], *path)
        if not os.path.exists(path):
            continue
        session = _common.ort_session(path, LATENCY_THREADS)
        inputs = [(i.name, np.int64 if "int64" in i.type else np.int32) for i in session.get_inputs()]

        def run(ids, mask, session=session, inputs=inputs):
            return session.run(None, {n: _feed_value(n, ids, mask).astype(t) for n, t in inputs})[0]
        runners[label] = run
    for label, folder in (("ours TFLite", "export_tflite"), ("ours TFLite dynamic", "export_tflite_dynamic")):
        path = os.path.join(paths["work"], folder, "bert.tflite")
        if os.path.exists(path):
            runners[label] = _tflite_runner(path)
    runners["peer torch eager (transformers)"] = _torch_eager_runner(spec, paths)
    return runners


def _tflite_runner(path):
    """A `.tflite` file in LiteRT (2 threads) as `run(ids, mask) -> output`,
    resized when the shape changes."""
    from ai_edge_litert import interpreter as litert

    interpreter = litert.Interpreter(model_path=path, num_threads=LATENCY_THREADS)
    details = interpreter.get_input_details()
    shape = [None]

    def run_tflite(ids, mask):
        if shape[0] != ids.shape:
            for d in details:
                interpreter.resize_tensor_input(d["index"], ids.shape)
            interpreter.allocate_tensors()
            shape[0] = ids.shape
        for d in details:
            interpreter.set_tensor(d["index"], _feed_value(d["name"], ids, mask).astype(d["dtype"]))
        interpreter.invoke()
        return interpreter.get_tensor(interpreter.get_output_details()[0]["index"])
    return run_tflite


# The int8 exports (int8 weights, activations quantized at run time), whose
# outputs are measured against our float32 ONNX export's by cosine rather
# than counted in the float exports' max abs difference. On random weights
# their activations have none of a trained model's outliers (the first
# token's "massive activations"): the data-dependent loss is measured on the
# real all-MiniLM-L6-v2 (tests/export/test_onnx_quantization.py,
# bench_quantization.py).
QUANTIZED_LATENCY = ("ours ONNX int8", "ours TFLite dynamic", "peer ONNX int8 (Optimum + quantize_dynamic)")


def _token_cosines(got, want):
    """The cosine of each token's vector (last axis) of `got` to `want`'s."""
    import numpy as np

    a = np.asarray(got, np.float64).reshape(-1, np.shape(want)[-1])
    b = np.asarray(want, np.float64).reshape(-1, np.shape(want)[-1])
    return (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


def stage_latency(name, spec, paths, args):
    """Batch-1 latency of the exports the `onnx`, `onnx_int8`, `tflite`,
    `tflite_dynamic`, `torch_onnx` and `optimum_onnx` stages wrote, and of
    torch eager, at each of LATENCY_LENGTHS tokens (random ids, no
    padding), interleaved (`_common.interleaved`, `--rounds` rounds of 2
    calls after 2 warm-up calls); onnxruntime and LiteRT with 2 threads.
    The TFLite interpreter is resized once per length, before its warm-up.
    The int8 exports (`QUANTIZED_LATENCY`): the per-token cosine of their
    output to our float32 ONNX export's, mean and min."""
    import numpy as np

    runners = _latency_runners(spec, paths)
    if not runners:
        raise FileNotFoundError(f"no export of {name} in {paths['work']}: run onnx, tflite, torch_onnx first")
    rng = np.random.default_rng(0)
    latency, agreement, cosine, failed = {}, {}, {}, {}
    for length in LATENCY_LENGTHS:
        if length > spec["config"].get("max_position_embeddings", length):
            continue
        ids = rng.integers(0, spec["config"]["vocab_size"], size=(1, length)).astype(np.int64)
        mask = np.ones_like(ids)
        # An export that does not run at this length is a finding, not the stage's end.
        for label, run in list(runners.items()):
            try:
                run(ids, mask)
            except Exception as e:  # noqa: BLE001 (onnxruntime's and LiteRT's own errors)
                failed[label] = f"{length} tokens: {type(e).__name__}: {str(e)[:300]}"
                del runners[label]
        if not runners:
            break
        fns = {label: (lambda run=run: run(ids, mask)) for label, run in runners.items()}
        medians = _common.interleaved(fns, repeats=args.rounds, calls=2)
        latency[str(length)] = {label: seconds * 1e3 for label, seconds in medians.items()}
        # The float exports agree (a trace that froze the example's length
        # would not); the int8 ones are measured by cosine to our float32 ONNX.
        outputs = {label: np.asarray(run(ids, mask), np.float64) for label, run in runners.items()}
        floats = {label: o for label, o in outputs.items() if label not in QUANTIZED_LATENCY}
        first = next(iter(floats.values()))
        agreement[str(length)] = max(float(np.max(np.abs(o - first))) for o in floats.values())
        if "ours ONNX" in outputs:
            cosine[str(length)] = {
                label: [float(c.mean()), float(c.min())]
                for label in QUANTIZED_LATENCY if label in outputs
                for c in [_token_cosines(outputs[label], outputs["ours ONNX"])]}
    return {"latency_ms": latency, "load": list(os.getloadavg()), "max_abs_difference": agreement,
            "int8_cosine": cosine,
            "scale": float(np.max(np.abs(first))) if latency else None, "failed": failed}


@dataclasses.dataclass(frozen=True)
class Stage:
    """One row kind of the table: `run` in a fresh child (or, for a peer,
    `command(name, paths) -> (artifact folder, argv)` run as the child);
    `ours` False for a stage that is not a measurement of keras_attn;
    `needs`: a stage whose artifact this one reads, run first when missing."""

    run: object
    what: str
    ours: bool = True
    command: object = None
    needs: str = None


STAGES = {
    "checkpoint": Stage(stage_checkpoint, "random bf16 safetensors (input, not ours)", ours=False),
    "convert": Stage(stage_convert, "from_huggingface(folder)"),
    "save_weights": Stage(stage_save_weights, "model.save_weights(.weights.h5)"),
    "genai_fp32": Stage(_genai_stage(None), "convert + export_onnx_genai fp32"),
    "genai_int8": Stage(_genai_stage("int8"), "convert + export_onnx_genai int8 (MatMulNBits)"),
    "genai_int4": Stage(_genai_stage("int4"), "convert + export_onnx_genai int4 (MatMulNBits)"),
    "builder_fp32": Stage(None, "GenAI model builder -p fp32 (peer)", ours=False,
                          command=_builder_command("fp32")),
    "builder_int8": Stage(None, "GenAI model builder -p int8 (peer)", ours=False,
                          command=_builder_command("int8")),
    "builder_int4": Stage(None, "GenAI model builder -p int4 (peer)", ours=False,
                          command=_builder_command("int4")),
    "litertlm_int8": Stage(_litertlm_stage("dynamic"),
                           "convert + export_litertlm dynamic (int8 weights), max_length 1024"),
    "litertlm_int4": Stage(_litertlm_stage("int4"),
                           "convert + export_litertlm int4 (blocks of 32), max_length 1024"),
    "litertlm_fp32": Stage(_litertlm_stage(None), "convert + export_litertlm float32, max_length 1024"),
    "litert_torch_int8": Stage(None, "litert-torch export_hf dynamic_wi8_afp32 (peer)", ours=False,
                               command=_litert_torch_command("int8")),
    "litert_torch_fp32": Stage(None, "litert-torch export_hf float32 (peer)", ours=False,
                               command=_litert_torch_command("fp32")),
    "litertlm_speed": Stage(stage_litertlm_speed,
                            "LiteRT-LM prefill/decode tokens/s of the bundles above"),
    "litertlm_speed_int4": Stage(stage_litertlm_speed_int4,
                                 "LiteRT-LM prefill/decode tokens/s: our int4 and int8, litert-torch's int8"),
    "sig_tflite": Stage(_signatures_stage("tflite"),
                        "convert + runtimes.signatures.export_tflite, max_length 1024, batch 1, "
                        "prompt 128"),
    "sig_savedmodel": Stage(_signatures_stage("saved_model"),
                            "convert + runtimes.signatures.export_saved_model, max_length 1024"),
    "savedmodel": Stage(_export_stage("savedmodel"), "convert + export_saved_model"),
    "tflite": Stage(_export_stage("tflite"), "convert + export_tflite (float32)"),
    "tflite_converter": Stage(_export_stage("tflite_converter", writer="traced"),
                              "convert + export_tflite(writer='traced') (float32)"),
    # The int8 stages check nothing (`threshold=0`): on random weights an
    # int8 export can fall below the default cosine threshold (EmbeddingGemma's
    # did), and the latency stage measures its cosine to the float32 export.
    "tflite_dynamic": Stage(_export_stage("tflite_dynamic", quantization="dynamic", threshold=0.0),
                            "convert + export_tflite(quantization='dynamic', threshold=0)"),
    "onnx": Stage(_export_stage("onnx"), "convert + export_onnx (default)"),
    "onnx_fused": Stage(_export_stage("onnx_fused", fused=True), "convert + export_onnx(fused=True)"),
    "onnx_int8": Stage(_export_stage("onnx_int8", quantization="dynamic", threshold=0.0),
                       "convert + export_onnx(quantization='dynamic', threshold=0)"),
    "export_all": Stage(_export_stage("export_all"), "convert + export_all (SavedModel, TFLite, ONNX)"),
    "sig_onnx": Stage(stage_sig_onnx, "convert + runtimes.signatures.export_onnx, max_length 1024"),
    "keras_file": Stage(stage_keras_file, "convert + model.save(.keras) (CLI input, not ours)",
                        ours=False),
    "cli": Stage(None, "keras-attn export model.keras --format all", command=_cli_command,
                 needs="keras_file"),
    "torch_onnx": Stage(stage_torch_onnx, "transformers model + torch.onnx.export (peer)", ours=False),
    "optimum_onnx": Stage(None, "optimum-cli export onnx --task feature-extraction (peer)", ours=False,
                          command=_optimum_command),
    "optimum_onnx_int8": Stage(stage_optimum_onnx_int8, "onnxruntime quantize_dynamic of optimum_onnx (peer)",
                               ours=False, needs="optimum_onnx"),
    "latency": Stage(stage_latency, "batch-1 latency (ms) of the onnx, onnx_int8, tflite, tflite_dynamic, "
                                    "torch_onnx, optimum_onnx and optimum_onnx_int8 exports and of torch eager"),
}


# ---------------------------------------------------------------------------
# The parent: one child per (model, stage)


def _paths(args, name):
    work = os.path.join(args.work, name)
    return {"work": work, "checkpoint": os.path.join(work, "checkpoint")}


def _needed_path(args, name, stage):
    return os.path.join(_paths(args, name)["work"],
                        {"keras_file": "model.keras", "optimum_onnx": "optimum_onnx/model.onnx"}[stage])


def run_child(args, name, stage):
    """Runs `stage` of `name` in a fresh subprocess; its result with the
    parent's sampled peak RSS and the child's ru_maxrss."""
    import psutil

    os.makedirs(_paths(args, name)["work"], exist_ok=True)
    artifact = None
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        if STAGES[stage].command is not None:
            artifact, cmd = STAGES[stage].command(name, _paths(args, name))
        else:
            cmd = [sys.executable, os.path.abspath(__file__), "--child", stage, "--models", name,
                   "--work", args.work, "--shard-gb", str(args.shard_gb),
                   "--prompt", str(args.prompt), "--new", str(args.new), "--rounds", str(args.rounds)]
            if args.dtype:
                cmd += ["--dtype", args.dtype]
        start = time.perf_counter()
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [os.path.dirname(HERE)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
        child = subprocess.Popen(cmd, stdout=out, stderr=err, cwd=HERE, env=env)
        process = psutil.Process(child.pid)
        peak, killed = 0, False
        while True:
            pid, status, usage = os.wait4(child.pid, os.WNOHANG)
            if pid:
                break
            try:
                peak = max(peak, process.memory_info().rss)
            except psutil.Error:
                pass
            if peak > args.max_rss_gb * GB and not killed:
                child.kill()
                killed = True
            time.sleep(0.02)
        child.returncode = os.waitstatus_to_exitcode(status)
        wall = time.perf_counter() - start
        out.seek(0)
        err.seek(0)
        lines = out.read().strip().splitlines()
        # CPU seconds too: on a shared machine the wall time says more about the load.
        result = {"model": name, "stage": stage, "child_seconds": wall, "sampled_peak": peak,
                  "ru_maxrss": usage.ru_maxrss * 1024,
                  "cpu_seconds": usage.ru_utime + usage.ru_stime}
        phases = [json.loads(line[6:]) for line in err.read().splitlines() if line.startswith("PHASE ")]
        err.seek(0)
        if killed:
            result["error"] = f"killed past {args.max_rss_gb} GB"
            result["phases"] = phases
        elif artifact is not None and child.returncode == 0:
            result["artifact_bytes"] = _dir_bytes(artifact)
        elif child.returncode != 0 or not lines:
            result["error"] = (err.read().strip().splitlines() or ["?"])[-1][:200]
        else:
            result.update(json.loads(lines[-1]))
        return result


def _gb(x):
    return "" if x is None else f"{x / GB:.2f}"


def table(results):
    header = ["model", "params", "stage", "seconds", "child CPU s", "peak RSS sampled (GB)", "ru_maxrss (GB)",
              "artifact (GB)", "Keras bytes (GB)", "peak / Keras", "phases: s, peak GB -> end GB"]
    rows = []
    params = {r["model"]: r["parameters"] for r in results if "parameters" in r}
    for r in results:
        if "error" in r:
            phases = "; ".join(f"{p[0]} {p[1]:.1f} s, {p[2] / GB:.2f} -> {p[3] / GB:.2f}"
                               for p in r.get("phases", []))
            rows.append([r["model"], "", r["stage"], f"{r['child_seconds']:.1f}",
                         f"{r.get('cpu_seconds', 0):.0f}", _gb(r["sampled_peak"]),
                         _gb(r["ru_maxrss"]), "", "", "", f"failed: {r['error']}; {phases}"])
            continue
        keras_bytes = r.get("keras_bytes")
        ratio = f"{r['ru_maxrss'] / keras_bytes:.2f}" if keras_bytes else ""
        phases = "; ".join(f"{p[0]} {p[1]:.1f} s, {p[2] / GB:.2f} -> {p[3] / GB:.2f}"
                           for p in r.get("phases", []))
        if r.get("writer"):
            phases += f"; writer {r['writer']}"
        seconds = r.get("seconds", r["child_seconds"])
        n = params.get(r["model"])
        cpu = r.get("cpu_seconds")
        rows.append([r["model"], f"{n / 1e6:.{0 if n > 1e7 else 2}f}M" if n else "", r["stage"], f"{seconds:.1f}",
                     "" if cpu is None else f"{cpu:.0f}", _gb(r["sampled_peak"]), _gb(r["ru_maxrss"]), _gb(r.get("artifact_bytes")),
                     _gb(keras_bytes), ratio, phases])
    text = _common.markdown_table(header, rows)
    speed_rows = [[r["model"], n, f"{v['bundle_bytes'] / GB:.3f}", f"{v['prefill_tps']:.1f}",
                   f"{v['decode_tps']:.2f}", v["tokens"],
                   "/".join(f"{x:.1f}" for x in r["load"])]
                  for r in results if "speeds" in r for n, v in r["speeds"].items()]
    if speed_rows:
        text += "\n" + _common.markdown_table(
            ["model", "bundle", "size (GB)", "prefill tok/s", "decode tok/s",
             "tokens (prefill, decode)", "load average after"], speed_rows)
    latency = [r for r in results if "latency_ms" in r]
    if latency:
        labels = list(dict.fromkeys(label for r in latency for by in r["latency_ms"].values() for label in by))
        # Each peer's time over ours ONNX's: > 1 means ours is faster.
        peers = [label for label in labels if label.startswith("peer")]
        quantized = [label for label in QUANTIZED_LATENCY if label in labels]
        # Each int8 export's speed-up over its own float32 export.
        speedups = [(f, q) for f, q in (("ours ONNX", "ours ONNX int8"), ("ours TFLite", "ours TFLite dynamic"),
                                        ("peer ONNX (Optimum)", "peer ONNX int8 (Optimum + quantize_dynamic)"))
                    if f in labels and q in labels]
        rows = [[r["model"], length] + [f"{by[label]:.1f}" if label in by else "" for label in labels]
                + [f"{by[p] / by['ours ONNX']:.2f}" if p in by and "ours ONNX" in by else "" for p in peers]
                + [f"{by[f] / by[q]:.2f}" if f in by and q in by else "" for f, q in speedups]
                + [f"{r['max_abs_difference'][length]:.2g} (outputs up to {r['scale']:.2g})"]
                + ["{:.4f} / {:.4f}".format(*r.get("int8_cosine", {}).get(length, {})[q])
                   if q in r.get("int8_cosine", {}).get(length, {}) else "" for q in quantized]
                + ["/".join(f"{x:.1f}" for x in r["load"])]
                for r in latency for length, by in r["latency_ms"].items()]
        text += "\nBatch-1 latency, ms (median of the rounds; onnxruntime, LiteRT and torch, 2 threads):\n\n"
        text += _common.markdown_table(
            ["model", "tokens"] + labels + [f"{p} / ours ONNX" for p in peers]
            + [f"{f} / {q}" for f, q in speedups]
            + ["max abs difference between the float32 exports"]
            + [f"{q}: per-token cosine to ours ONNX float32, mean / min" for q in quantized]
            + ["load average after"], rows)
        text += "".join(f"\n- {r['model']}, {label} failed at {why}\n"
                        for r in latency for label, why in r.get("failed", {}).items())
    return text


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(DEFAULT_MODELS),
                        help=f"comma-separated, of {list(MODELS)}")
    parser.add_argument("--stages", default="convert",
                        help=f"comma-separated, of {list(STAGES)} (the checkpoint is made when missing)")
    parser.add_argument("--dtype", default=None, help="from_huggingface(dtype=...) (default: not passed)")
    parser.add_argument("--work", default=os.path.join(tempfile.gettempdir(), "keras_attn_real_size"),
                        help="where checkpoints are written and reused")
    parser.add_argument("--shard-gb", type=float, default=5.0, help="max shard size of the checkpoints")
    parser.add_argument("--prompt", type=int, default=100, help="litertlm_speed: prompt tokens")
    parser.add_argument("--new", type=int, default=64, help="litertlm_speed: new tokens")
    parser.add_argument("--rounds", type=int, default=3, help="litertlm_speed, latency: alternating rounds")
    parser.add_argument("--max-rss-gb", type=float, default=9.0, help="kill a child past this RSS")
    parser.add_argument("--quick", action="store_true", help="the tiny model through checkpoint, save_weights and genai_int4, in a temporary --work")
    parser.add_argument("--markdown", help="write the table here")
    parser.add_argument("--json", help="write the raw results here")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    results_file.add_argument(parser)
    args = parser.parse_args(argv)
    results_file.start(args)
    models = args.models.split(",")
    if args.child:
        name = models[0]
        result = STAGES[args.child].run(name, MODELS[name], _paths(args, name), args)
        print(json.dumps(result))
        return
    if args.quick:
        # One stage of each kind of ours (the peers are not installed by the
        # test extra; each stage is a fresh process importing TensorFlow).
        models, stages = ["tiny-llama"], ["checkpoint", "save_weights", "genai_int4"]
        args.work = tempfile.mkdtemp(prefix="real_size_")
    else:
        stages = args.stages.split(",")
    _common.check_known(parser, ((models, MODELS, "--models"), (stages, STAGES, "--stages")))
    results = []
    try:
        for name in models:
            checkpoint = _paths(args, name)["checkpoint"]
            if "checkpoint" in stages or not os.path.isdir(checkpoint):
                results.append(run_child(args, name, "checkpoint"))
                if "error" in results[-1]:
                    continue
            else:
                with open(os.path.join(_paths(args, name)["work"], "checkpoint.json")) as f:
                    info = json.load(f)
                results.append({"model": name, "stage": "checkpoint (reused)", "child_seconds": 0.0,
                                "sampled_peak": None, "ru_maxrss": None, **info})
            for stage in stages:
                needs = STAGES[stage].needs
                if needs and needs not in stages and not os.path.exists(_needed_path(args, name, needs)):
                    results.append(run_child(args, name, needs))
                if stage != "checkpoint":
                    results.append(run_child(args, name, stage))
    finally:
        if args.quick:
            shutil.rmtree(args.work, ignore_errors=True)
    lines = [f"Conditions: {_common.conditions()}; dtype={args.dtype or 'default'}; "
             f"max RSS per child {args.max_rss_gb} GB", "", table(results)]
    _common.emit("\n".join(lines), args, results=results)
    if any("error" in r for r in results):
        sys.exit(1)


if __name__ == "__main__":
    main()
