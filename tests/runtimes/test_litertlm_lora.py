"""A fine-tune shipped as a LoRA file that LiteRT-LM binds at run time: one
base bundle (`export_litertlm(..., lora_rank=16)`), the adapters in a
separate file (`save_litertlm_lora`), generation in `litert_lm.Engine` on
CPU equal to the Keras LoRA model's greedy tokens and different from the
base model's (an adapter that loads and changes nothing, LiteRT-LM issue
#3173, fails here). The merged export of the same LoRA model is checked too."""

import re

import numpy as np
import pytest

litert_lm = pytest.importorskip("litert_lm")
pytest.importorskip("litert_lm_builder")
pytest.importorskip("tokenizers")

from keras_attn.generation.lora import adapted_layers  # noqa: E402
from keras_attn.runtimes import litertlm  # noqa: E402
from keras_attn.runtimes.litertlm import export_litertlm, save_litertlm_lora  # noqa: E402

from tests import tolerance  # noqa: E402
from tests.llm_runtime_models import EOS, keras_tokens, scaled_lm, word_tokenizer  # noqa: E402

MAX_LEN = 40
CHUNKS = (4, 16)
RANK = 4  # the adapters' rank, zero-padded to the bundle's
BUNDLE_RANK = 16
TEXT = "the cat sat on the mat then"
TARGETS = ("query", "key", "value", "attention_output")
# LiteRT-LM's `IsLoRAInputName` (runtime/util/lora_util.cc): the inputs its
# CPU executor fills from a LoRA file.
LORA_INPUT = re.compile(r"lora_atten_(?:q|k|v|o)_(?:a|b)_prime_weight_\d+")


def _lm():
    return scaled_lm(num_key_value_heads=2, position="rotary", normalization="rms_norm",
                     use_gated_feedforward=True, activation="silu")


@pytest.fixture(scope="module")
def lora(tmp_path_factory):
    folder = tmp_path_factory.mktemp("litertlm_lora")
    lm = _lm()
    prompt = [EOS] + word_tokenizer().encode(TEXT).ids  # LiteRT-LM puts the start token first
    base_tokens = keras_tokens(lm, prompt, MAX_LEN)
    tokens = np.random.default_rng(5).integers(2, lm.vocabulary_size, size=(1, 30)).astype("int32")
    base_logits = np.asarray(lm(tokens))[0]
    # Before `enable_lora`: no adapters, an all-zero LoRA file (the base model).
    zero_path = save_litertlm_lora(lm, folder / "zero.tflite", lora_rank=BUNDLE_RANK)
    lm.enable_lora(RANK, target_names=TARGETS)
    rng = np.random.default_rng(3)
    for layer in adapted_layers(lm):  # B nonzero: the adapters change the model
        layer.lora_kernel_a.assign(rng.uniform(-0.3, 0.3, layer.lora_kernel_a.shape).astype("float32"))
        layer.lora_kernel_b.assign(rng.standard_normal(layer.lora_kernel_b.shape).astype("float32"))
    path = folder / "base.litertlm"
    report = export_litertlm(lm, path, tokenizer=word_tokenizer(), max_length=MAX_LEN,
                             prefill_lengths=CHUNKS, bos_token_id=EOS, stop_token_ids=[EOS],
                             lora_rank=BUNDLE_RANK)
    lora_path = save_litertlm_lora(lm, folder / "lora.tflite", lora_rank=BUNDLE_RANK)
    # The bundle's TFLite model, for LiteRT's interpreter.
    model_path = folder / "model.tflite"
    litertlm.write_litertlm_tflite(lm, model_path, max_length=MAX_LEN, prefill_lengths=CHUNKS,
                                   lora_rank=BUNDLE_RANK)
    return dict(lm=lm, path=path, report=report, lora_path=lora_path, zero_path=zero_path,
                model_path=model_path, prompt=prompt, base_tokens=base_tokens, tokens=tokens,
                base_logits=base_logits)


def _file_tensors(path):
    """`{name: (tensor, buffer, array)}` of a LoRA file, read as LiteRT-LM's
    `LoraData` reads it: each tensor's bytes at its buffer's offset."""
    from ai_edge_litert.tools import flatbuffer_utils

    content = open(path, "rb").read()
    model = flatbuffer_utils.convert_bytearray_to_object(content)
    out = {}
    for tensor in model.subgraphs[0].tensors:
        buffer = model.buffers[tensor.buffer]
        array = np.frombuffer(content, np.float32, int(buffer.size) // 4, int(buffer.offset))
        out[tensor.name.decode()] = (tensor, buffer, array.reshape(tensor.shape))
    return model, content, out


def _generate(path, lora_paths, *token_lists):
    """LiteRT-LM's greedy texts from `TEXT`, one session per LoRA file of
    `lora_paths` in one engine, and the engine's text of each of `token_lists`."""
    engine = litert_lm.Engine(str(path), backend=litert_lm.Backend.CPU())
    try:
        got = [litertlm.generate(path, TEXT, engine=engine, lora_path=p) for p in lora_paths]
        return got, [engine.detokenize([int(t) for t in tokens]) for tokens in token_lists]
    finally:
        engine.close()


def test_bundle_takes_lora_weights_as_litertlm_names_them(lora):
    from ai_edge_litert import interpreter as litert

    lm, report = lora["lm"], lora["report"]
    assert sorted(report.signatures) == ["decode", "prefill_16", "prefill_4"]
    for name, signature in report.signatures.items():
        adapters = [n for n in signature["inputs"] if LORA_INPUT.fullmatch(n)]
        assert len(adapters) == 2 * 4 * lm.num_layers, name  # a', b' of q, k, v, o per layer
    details = litert.Interpreter(model_path=str(lora["model_path"])).get_signature_runner(
        "decode").get_input_details()
    heads, kv, head_dim = 4, 2, lm.head_dim
    assert list(details["lora_atten_q_a_prime_weight_0"]["shape"]) == [lm.hidden_dim, BUNDLE_RANK]
    assert list(details["lora_atten_k_b_prime_weight_1"]["shape"]) == [BUNDLE_RANK, kv * head_dim]
    assert list(details["lora_atten_o_a_prime_weight_0"]["shape"]) == [heads * head_dim, BUNDLE_RANK]


def test_lora_file_holds_the_scaled_adapters_where_litertlm_reads_them(lora):
    """The file against the layers' variables (NumPy): `a' = (alpha / r) A`
    zero-padded to the bundle's rank, `b' = B`; every tensor's data after the
    flatbuffer (LiteRT-LM's `LoraData` reads `Buffer.offset/size` only), a
    `lora_rank` metadata entry holding the rank, the size a multiple of 4096."""
    model, content, tensors = _file_tensors(lora["lora_path"])
    assert len(content) % 4096 == 0
    metadata = {m.name.decode(): m.buffer for m in model.metadata}
    assert metadata["lora_rank"] == BUNDLE_RANK
    inputs = lora["report"].signatures["decode"]["inputs"]
    assert sorted(tensors) == sorted(n for n in inputs if LORA_INPUT.fullmatch(n))
    lm = lora["lm"]
    for i, block in enumerate(lm.blocks):
        attention = block.self_attention
        for letter, layer in zip("qkvo", (attention.query_dense, attention.key_dense,
                                          attention.value_dense, attention.output_dense)):
            scale = layer.lora_alpha / layer.lora_rank
            want_a = np.zeros((layer.lora_kernel_a.shape[0], BUNDLE_RANK), np.float32)
            want_a[:, :RANK] = layer.lora_kernel_a.numpy() * scale
            want_b = np.zeros((BUNDLE_RANK, layer.lora_kernel_b.shape[1]), np.float32)
            want_b[:RANK] = layer.lora_kernel_b.numpy()
            for part, want in (("a", want_a), ("b", want_b)):
                tensor, buffer, got = tensors[f"lora_atten_{letter}_{part}_prime_weight_{i}"]
                assert buffer.data is None and buffer.offset > 0 and buffer.size == want.nbytes
                np.testing.assert_allclose(got, want, rtol=1e-6, atol=0)


@pytest.mark.parametrize("adapters", ["lora", "zero"])
def test_signatures_fed_a_lora_file_match_keras(lora, adapters):
    """The bundle's TFLite model on LiteRT-LM's schedule, fed a LoRA file's
    tensors, against Keras: the LoRA model for the fine-tune's file, the
    model before `enable_lora` for the all-zero one."""
    lm, tokens = lora["lm"], lora["tokens"]
    weights = {name: array for name, (_, _, array) in _file_tensors(lora[f"{adapters}_path"])[2].items()}
    got, first = litertlm.runtime_logits(str(lora["model_path"]), tokens[0], lora_weights=weights)
    want = np.asarray(lm(tokens))[0, first:] if adapters == "lora" else lora["base_logits"][first:]
    # The scale is the logits' largest (the stop token's -1e4 bias): the
    # residual stream reaches ~750 on this model, so its roundings, carried
    # through the final norm, are not bounded by the other logits' ~13.
    tolerance.assert_close(got, want)
    if adapters == "lora":  # the adapters move the logits far beyond that bound
        columns = np.arange(lm.vocabulary_size) != EOS
        assert np.max(np.abs(want - lora["base_logits"][first:])[:, columns]) > 1.0


def test_engine_with_the_lora_file_generates_the_keras_lora_tokens(lora):
    lm, prompt = lora["lm"], lora["prompt"]
    want = keras_tokens(lm, prompt, MAX_LEN)
    base = lora["base_tokens"]
    # The adapters change the greedy tokens: a run that ignored them would fail.
    assert want != base and len(want) >= 8 and len(set(want)) >= 3
    (got,), (want_text, base_text) = _generate(lora["path"], [lora["lora_path"]], want, base)
    assert got == want_text and got != base_text


def test_each_session_takes_its_own_lora_file(lora):
    """The all-zero file gives the base model's tokens, and one engine
    switches between files from one session to the next."""
    lm, prompt = lora["lm"], lora["prompt"]
    files = [lora["zero_path"], lora["lora_path"], lora["zero_path"]]
    got, (base_text, want_text) = _generate(lora["path"], files, lora["base_tokens"],
                                            keras_tokens(lm, prompt, MAX_LEN))
    assert got == [base_text, want_text, base_text]


def test_merged_export_of_a_lora_model_generates_the_keras_lora_tokens(lora, tmp_path):
    """Without `lora_rank` the adapters are merged into the kernels: the
    bundle is the fine-tuned model, no LoRA file needed."""
    lm, prompt = lora["lm"], lora["prompt"]
    path = tmp_path / "merged.litertlm"
    report = export_litertlm(lm, path, tokenizer=word_tokenizer(), max_length=MAX_LEN,
                             prefill_lengths=CHUNKS, bos_token_id=EOS, stop_token_ids=[EOS])
    assert report.max_abs_error <= report.atol
    assert not any(LORA_INPUT.fullmatch(n) for n in report.signatures["decode"]["inputs"])
    want = keras_tokens(lm, prompt, MAX_LEN)
    (got,), (want_text, base_text) = _generate(path, [None], want, lora["base_tokens"])
    assert got == want_text and got != base_text


def test_refuses_what_litertlm_lora_cannot_carry(lora, tmp_path):
    lm = lora["lm"]
    kwargs = dict(tokenizer=word_tokenizer(), max_length=MAX_LEN, prefill_lengths=CHUNKS)
    with pytest.raises(ValueError, match="lora_rank.*16, 32.*Received: lora_rank=4"):
        export_litertlm(lm, tmp_path / "a.litertlm", lora_rank=4, **kwargs)
    with pytest.raises(ValueError, match="writer.*Received: writer='traced'"):
        export_litertlm(lm, tmp_path / "a.litertlm", lora_rank=16, writer="traced", **kwargs)
    with pytest.raises(ValueError, match="lora_rank.*16, 32.*Received: lora_rank=8"):
        save_litertlm_lora(lm, tmp_path / "a.tflite", lora_rank=8)
    wide = _lm()
    wide.enable_lora(20, target_names=("query",))
    with pytest.raises(ValueError, match="adapters' rank \\(20 .*Received: lora_rank=16"):
        save_litertlm_lora(wide, tmp_path / "b.tflite", lora_rank=16)
    ffn = _lm()
    ffn.enable_lora(4, target_names=("query", "feedforward_output_dense"))
    with pytest.raises(ValueError, match="feedforward_output_dense` has a LoRA adapter"):
        save_litertlm_lora(ffn, tmp_path / "c.tflite", lora_rank=16)
    # Merged or Keras-style adapters: the frozen kernel would carry the fine-tune.
    merged = _lm()
    merged.enable_lora(4, target_names=("query",))
    merged.merge_lora()
    keras_style = _lm()
    keras_style.enable_lora(4, target_names=("query",), style="keras")
    for model in (merged, keras_style):
        with pytest.raises(ValueError, match="query` has a merged or Keras-style"):
            export_litertlm(model, tmp_path / "d.litertlm", lora_rank=16, **kwargs)
