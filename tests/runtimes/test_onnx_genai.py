"""ONNX Runtime GenAI runs our exported folders: from text (its own
tokenizer over our tokenizer.json) to the tokens Keras's greedy search gives,
for a keras_attn decoder and for converted GPT-2 and Llama models."""

import json

import numpy as np
import pytest

og = pytest.importorskip("onnxruntime_genai")
tokenizers = pytest.importorskip("tokenizers")

from keras_attn.generation import DecoderOnlyLM  # noqa: E402
from keras_attn.runtimes.onnx_genai import export_onnx_genai  # noqa: E402
from tests.llm_runtime_models import (  # noqa: E402
    EOS, HF_FAMILIES, MAX_LEN, hf_family, hf_model, hf_tokens, keras_tokens, scaled_lm,
    trained_dates_decoder, word_tokenizer)


def genai_tokens(folder, prompt_ids, max_length):
    model = og.Model(str(folder))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=max_length, do_sample=False)
    generator = og.Generator(model, params)
    generator.append_tokens(np.array([prompt_ids], np.int32))
    while not generator.is_done():
        generator.generate_next_token()
    return list(np.asarray(generator.get_sequence(0))[len(prompt_ids):]), model


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    lm = scaled_lm(num_key_value_heads=2, position="rotary", normalization="rms_norm",
                   use_gated_feedforward=True, activation="silu")
    folder = tmp_path_factory.mktemp("genai")
    export_onnx_genai(lm, folder, max_length=MAX_LEN, tokenizer=word_tokenizer(), eos_token_id=EOS)
    return lm, folder


@pytest.mark.slow
def test_batch_of_right_padded_prompts_generates_each_rows_tokens(tmp_path):
    """GenAI right-pads the shorter prompt of a batch and masks its pads; the
    graph computes each row's last token's logits only (`prompt_logits`
    "last", the default), taken at that row's own last token: every row
    continues as it would alone. (The GenAI model builder's
    `prune_lm_head=true` takes the batch's last position, a pad in the
    shorter row, and that row's tokens go wrong: benchmarks/RESULTS.md.)"""
    import onnx

    pytest.importorskip("transformers")
    from keras_attn.convert import from_huggingface

    lm = from_huggingface(hf_family("llama"))
    folder = tmp_path
    export_onnx_genai(lm, folder, max_length=MAX_LEN, tokenizer=word_tokenizer(), eos_token_id=EOS,
                      writer="direct")

    logits = onnx.load(str(folder / "model.onnx")).graph.output[0]
    assert logits.type.tensor_type.shape.dim[1].dim_value == 1  # GenAI reads it as last-token only
    prompts = [word_tokenizer().encode(text).ids
               for text in ("a small dog ran in the big box then", "the cat sat")]
    width = max(len(p) for p in prompts)
    model = og.Model(str(folder))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=MAX_LEN, do_sample=False, batch_size=len(prompts))
    generator = og.Generator(model, params)
    generator.append_tokens(np.array([p + [0] * (width - len(p)) for p in prompts], np.int32))
    while not generator.is_done():
        generator.generate_next_token()
    for row, prompt in enumerate(prompts):
        want = keras_tokens(lm, prompt, MAX_LEN)
        got = [int(t) for t in np.asarray(generator.get_sequence(row))[width:]]
        n = min(len(want), len(got))
        assert n >= 4, (want, got)
        assert got[:n] == want[:n], (row, got, want)


def test_folder_layout(exported):
    lm, folder = exported
    config = json.loads((folder / "genai_config.json").read_text())
    decoder = config["model"]["decoder"]
    assert decoder["num_key_value_heads"] == 2 and decoder["head_size"] == lm.head_dim
    assert config["search"]["past_present_share_buffer"] is True
    import onnx

    graph = onnx.load(str(folder / "model.onnx")).graph
    names = [i.name for i in graph.input]
    assert names[:2] == ["input_ids", "attention_mask"]
    assert "past_key_values.1.value" in names and "present.1.key" in [o.name for o in graph.output]
    dims = [d.dim_value for d in graph.input[2].type.tensor_type.shape.dim[1:]]
    assert dims == [2, MAX_LEN, lm.head_dim]  # key/value heads only, fixed length


def test_generates_keras_greedy_from_text(exported):
    lm, folder = exported
    for text in ("the cat sat on", "a small dog ran in the big box then"):
        want_prompt = word_tokenizer().encode(text).ids
        model = og.Model(str(folder))
        prompt = list(og.Tokenizer(model).encode(text))
        assert prompt == want_prompt
        got, _ = genai_tokens(folder, prompt, MAX_LEN)
        want = keras_tokens(lm, prompt, MAX_LEN)
        assert got == want
        assert len(want) >= 8 and len(set(want)) >= 3, "degenerate generation tests nothing"
        # Text back: GenAI's decoder over our tokenizer.json (the random
        # model's own tokens are arbitrary bytes, not always valid UTF-8).
        assert og.Tokenizer(model).decode(np.array(prompt, np.int32)) == text


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_converted_models_generate_hf_tokens(tmp_path, family):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from keras_attn.convert import from_huggingface

    hf = hf_model(family)
    lm = from_huggingface(hf)
    export_onnx_genai(lm, tmp_path, max_length=MAX_LEN, tokenizer=word_tokenizer(), eos_token_id=EOS)
    prompt = word_tokenizer().encode("the red cat sat on the").ids
    want = hf_tokens(hf, prompt, MAX_LEN)
    got, _ = genai_tokens(tmp_path, prompt, MAX_LEN)
    assert got == want == keras_tokens(lm, prompt, MAX_LEN)


def test_refuses_what_genai_cannot_carry(tmp_path):
    from keras_attn.generation import Seq2SeqLM

    s2s = Seq2SeqLM(20, 16, 16, num_layers=1, num_heads=2, intermediate_dim=16)
    with pytest.raises(ValueError, match="decoder-only"):
        export_onnx_genai(s2s, tmp_path, max_length=8)
    unbuilt = DecoderOnlyLM(20, 16, 16, num_layers=1, num_heads=2, intermediate_dim=16,
                            position="rotary", normalization="rms_norm", head_dim=16)
    export_onnx_genai(unbuilt, tmp_path / "unbuilt", max_length=8)  # built by the export
    assert unbuilt.built and (tmp_path / "unbuilt" / "model.onnx").exists()
    with pytest.raises(ValueError, match="max_length"):
        export_onnx_genai(scaled_lm(), tmp_path, max_length=0)
    from keras_attn.runtimes.tokenizers import word_tokenizer as words_to_tokenizer

    with pytest.raises(ValueError, match="not WordPiece"):
        export_onnx_genai(scaled_lm(), tmp_path / "words", max_length=8,
                          tokenizer=words_to_tokenizer(["", "[UNK]", "cat", "dog"]))


def test_window_through_the_tf2onnx_graph(tmp_path):
    """A windowed model the fused writer does not cover (sinusoidal
    positions, LayerNorm): the tf2onnx graph's cache holds every position
    and the window is a band over it; GenAI gives Keras's tokens (whose
    cache is a ring buffer of the window)."""
    lm = scaled_lm(sliding_window=5)
    with pytest.warns(UserWarning, match="fused decoder writer does not cover"):
        export_onnx_genai(lm, tmp_path, max_length=MAX_LEN, tokenizer=word_tokenizer(), eos_token_id=EOS)
    prompt = word_tokenizer().encode("the cat sat on the big red mat").ids
    got, _ = genai_tokens(tmp_path, prompt, MAX_LEN)
    want = keras_tokens(lm, prompt, MAX_LEN)
    assert got == want and len(want) >= 8


def test_character_tokenizer_ids_are_the_characters():
    from keras_attn.data.dates import INPUT_ALPHABET
    from keras_attn.runtimes.tokenizers import character_tokenizer

    tok = character_tokenizer(INPUT_ALPHABET)
    assert any(ord(c) > 127 for c in INPUT_ALPHABET)  # multi-byte characters included
    for text in ("Mercredi, 3 Février 1999", "ÉTÉ 12.03.1999", "march 3"):
        ids = tok.encode(text).ids
        assert ids == [2 + INPUT_ALPHABET.index(c) for c in text]
        assert tok.decode(ids) == text
    with pytest.raises(ValueError, match="must not repeat"):
        character_tokenizer("abca")


@pytest.fixture(scope="module")
def trained_dates_lm():
    return trained_dates_decoder()


@pytest.mark.slow
def test_model_trained_with_keras_attn_generates_from_text(trained_dates_lm, tmp_path):
    """GenAI, from text, gives Keras's greedy characters."""
    from keras_attn.data.dates import generate_examples

    lm, tok, width, *_ = trained_dates_lm
    export_onnx_genai(lm, tmp_path, max_length=width, tokenizer=tok, eos_token_id=EOS)
    model = og.Model(str(tmp_path))
    for human, _ in generate_examples(3, seed=99):
        text = f"{human}="
        prompt = [int(t) for t in og.Tokenizer(model).encode(text)]
        assert prompt == tok.encode(text).ids
        got, _ = genai_tokens(tmp_path, prompt, width)
        assert got == keras_tokens(lm, prompt, width)
        assert len(got) >= 3


@pytest.mark.slow
def test_weights_past_the_threshold_go_to_external_data(trained_dates_lm, tmp_path, monkeypatch):
    """Past `EXTERNAL_DATA_BYTES` (forced to 0 here; 256 MiB by default, under
    ONNX's 2 GB protobuf limit) the weights are written to model.onnx.data as
    they are made; GenAI loads the folder and gives Keras's tokens."""
    from keras_attn.runtimes import onnx_genai

    monkeypatch.setattr(onnx_genai, "EXTERNAL_DATA_BYTES", 0)
    lm, tok, width, *_ = trained_dates_lm
    export_onnx_genai(lm, tmp_path, max_length=width, tokenizer=tok, eos_token_id=EOS)
    graph_bytes = (tmp_path / "model.onnx").stat().st_size
    assert graph_bytes < 100_000 < (tmp_path / "model.onnx.data").stat().st_size
    assert (tmp_path / "model.onnx.data").stat().st_size >= 4 * lm.count_params()
    prompt = tok.encode("March 3, 1999=").ids
    got, _ = genai_tokens(tmp_path, prompt, width)
    assert got == keras_tokens(lm, prompt, width) and len(got) >= 3


def _next_tokens(path, held_out, quantized_ops):
    """Next-token argmax of the GenAI graph at `path` (exported with
    `prompt_logits="all"`) over the held-out rows, in one call from position 0 (causal: the padding after a row's end does
    not reach its earlier positions); the graph must hold one of
    `quantized_ops`."""
    import onnx
    import onnxruntime as ort

    ops = {n.op_type for n in onnx.load(str(path)).graph.node}
    assert ops & set(quantized_ops), ops
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    feeds = {"input_ids": held_out.astype(np.int64),
             "attention_mask": np.ones(held_out.shape, np.int64)}
    for graph_input in session.get_inputs()[2:]:
        feeds[graph_input.name] = np.zeros((len(held_out),) + tuple(graph_input.shape[1:]), np.float32)
    return session.run(["logits"], feeds)[0].argmax(-1)


@pytest.mark.slow
# Measured here: int8 0.989, int4 0.883 of all positions (7-bit MatMulInteger: 0.980).
@pytest.mark.parametrize("quantization,floor", [("int8", 0.95), ("int4", 0.8)])
def test_nbits_weights_keep_keras_next_tokens(trained_dates_lm, tmp_path, quantization, floor):
    """int8/int4 weights as MatMulNBits (blocks of 32, accuracy level 4, as
    the GenAI model builder writes them) on the fused graph: the next token
    under the same prefix is Keras's float32 one at `floor` of the positions
    at least. The int8 arithmetic of accuracy level 4 adds in int32 (no
    saturating pair sums, tests/export/test_quantized_portability.py)."""
    lm, tok, width, held_out, answer, keras_next = trained_dates_lm
    export_onnx_genai(lm, tmp_path, max_length=width, tokenizer=tok, eos_token_id=EOS,
                      quantization=quantization, writer="direct", prompt_logits="all")
    got = _next_tokens(tmp_path / "model.onnx", held_out, ("MatMulNBits",))
    valid = held_out != 0
    assert (got == keras_next)[valid].mean() >= floor, (got == keras_next)[valid].mean()
    assert (got == keras_next)[answer].mean() >= floor


@pytest.mark.slow
def test_int8_weights_keep_keras_next_tokens_on_any_cpu(trained_dates_lm, tmp_path):
    """int8 weights (MatMulInteger): the next token under the same prefix
    (teacher forcing) is Keras's at nearly every position. The integer
    arithmetic is exact on every CPU (tests/export/test_quantized_portability.py),
    so this agreement does not depend on the machine; full-range int8
    weights fall to ~0.88 on x86 CPUs without VNNI (benchmarks/RESULTS.md)."""
    lm, tok, width, held_out, answer, keras_next = trained_dates_lm
    export_onnx_genai(lm, tmp_path, max_length=width, tokenizer=tok, eos_token_id=EOS,
                      quantization="dynamic", prompt_logits="all")
    int8_next = _next_tokens(tmp_path / "model.onnx", held_out, ("MatMulInteger", "DynamicQuantizeMatMul"))
    valid = held_out != 0
    agreement = (int8_next == keras_next)[valid].mean()
    assert agreement >= 0.95, agreement
    assert (int8_next == keras_next)[answer].mean() >= 0.95
    # GenAI runs the folder greedily from text: Keras's characters at nearly
    # every position.
    from keras_attn.data.dates import generate_examples

    same = total = 0
    for human, _ in generate_examples(10, seed=97):
        prompt = tok.encode(f"{human}=").ids
        want = keras_tokens(lm, prompt, width)
        got, _ = genai_tokens(tmp_path, prompt, width)
        same += sum(a == b for a, b in zip(got, want))
        total += max(len(got), len(want))
    assert same / total >= 0.9, same / total


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(HF_FAMILIES))
def test_fused_graph_generates_hf_tokens(tmp_path, family):
    """From text: GenAI's tokens over the fused graph = transformers'
    `generate(do_sample=False)` = Keras's greedy search."""
    import warnings

    import onnx

    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from keras_attn.convert import from_huggingface

    hf = hf_family(family)
    lm = from_huggingface(hf)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback to tf2onnx
        export_onnx_genai(lm, tmp_path, max_length=MAX_LEN, tokenizer=word_tokenizer(),
                          eos_token_id=EOS, writer="direct")
    ops = {n.op_type for n in onnx.load(str(tmp_path / "model.onnx")).graph.node}
    assert "GroupQueryAttention" in ops and "Transpose" not in ops, ops
    prompt = word_tokenizer().encode("the red cat sat on the big mat then").ids
    want = hf_tokens(hf, prompt, MAX_LEN)
    got, _ = genai_tokens(tmp_path, prompt, MAX_LEN)
    assert got == want == keras_tokens(lm, prompt, MAX_LEN)
    assert len(want) >= 8 and len(set(want)) >= 3, "degenerate generation tests nothing"


def test_writer_falls_back_to_tf2onnx_with_the_reason(tmp_path):
    lm = scaled_lm()  # sinusoidal positions and LayerNorm: not the fused writer's
    with pytest.warns(UserWarning, match="fused decoder writer does not cover this model"):
        export_onnx_genai(lm, tmp_path / "auto", max_length=16)
    from keras_attn.export.capabilities import NotFusableError

    with pytest.raises(NotFusableError, match="position="):
        export_onnx_genai(lm, tmp_path / "fused", max_length=16, writer="direct")
    with pytest.raises(ValueError, match="`writer`"):
        export_onnx_genai(lm, tmp_path / "bad", max_length=16, writer="onnx")
