"""The direct TFLite writer (`keras_attn.export.tflite_decoder`): LiteRT-LM's
model of a decoder written from the Keras weights, run in LiteRT on the
runtime's schedule against Keras's forward pass and greedy search, in
LiteRT-LM's engine from text, int8 against a trained decoder, and the
refusals that send `export_litertlm` back to TensorFlow's converter."""

import numpy as np
import pytest

pytest.importorskip("ai_edge_litert")

from keras_attn.export import tflite_decoder  # noqa: E402
from keras_attn.export.capabilities import NotFusableError  # noqa: E402
from keras_attn.generation import DecoderOnlyLM  # noqa: E402
from keras_attn.runtimes import litertlm  # noqa: E402

from tests import tolerance  # noqa: E402
from tests.llm_runtime_models import (  # noqa: E402
    EOS, VOCAB, keras_tokens, trained_dates_decoder, word_tokenizer)

MAX_LEN = 40
CHUNKS = (4, 16)
# Llama (grouped heads, SwiGLU, untied head, Llama 3.1 rope scaling), Qwen2
# (q/k/v biases, one key/value head, tied table) and Mistral-like (a window
# shorter than the context, linear rope scaling, rotary on half of each
# head) and Gemma-2/3-like
# (QK-norm, sandwich norms, both soft caps, a windowed layer beside a full
# one, a layer without rotary, tanh-GELU, a scaled embedding, key/value
# heads, head sizes and widths per layer as Gemma 4's); a read bucket smaller than the cache makes `decode` read the
# filled slots only (the dynamic-length path real sizes take).
VARIANTS = {
    "llama": dict(num_key_value_heads=2, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16}),
    "qwen2_tied": dict(num_key_value_heads=1, attention_use_bias=True, tie_embeddings=True),
    "windowed": dict(num_key_value_heads=2, sliding_window=6, partial_rotary_factor=0.5,
                     rope_scaling={"rope_type": "linear", "factor": 2.0}),
    "gemma_like": dict(num_key_value_heads=[1, 2], head_dim=[8, 16], intermediate_dim=[48, 64],
                       use_qk_norm=True, use_sandwich_norm=True,
                       attention_logit_soft_cap=3.0, final_logit_soft_cap=5.0,
                       sliding_window=[6, None], rotary_layers=[True, False],
                       activation="gelu_tanh", embedding_scale=8.0),
}


def _lm(name, seed=0):
    options = dict(position="rotary", normalization="rms_norm", use_gated_feedforward=True,
                   activation="silu")
    options.update(VARIANTS[name])
    options.setdefault("intermediate_dim", 48)
    lm = DecoderOnlyLM(VOCAB, 64, 32, num_layers=2, num_heads=4, pad_token_id=0, **options)
    lm(np.array([[2, 3]], np.int32))
    rng = np.random.default_rng(seed)
    for w in lm.weights:  # spread logits: generations that vary
        w.assign(w.numpy() * 3 + rng.standard_normal(w.shape).astype("float32") * 0.05)
    return lm


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def written(request, tmp_path_factory):
    lm = _lm(request.param)
    path = tmp_path_factory.mktemp("direct") / "model.tflite"
    info = tflite_decoder.write_decoder_tflite(lm, path, max_length=MAX_LEN, prefill_lengths=CHUNKS,
                                               read_bucket=8)
    return request.param, lm, path, info


def _interpreter(path):
    from ai_edge_litert import interpreter as litert

    return litert.Interpreter(model_path=str(path))


def test_runtime_schedule_matches_keras_within_float32(written):
    """Chunked prefill (a padded last chunk) then decode, in LiteRT, against
    Keras's full forward pass."""
    _, lm, path, _ = written
    tokens = np.random.default_rng(5).integers(2, VOCAB, size=(1, 38)).astype("int32")
    got, first = litertlm.runtime_logits(str(path), tokens[0])
    want = np.asarray(lm(tokens), np.float64)[0, first:]
    # A block: projections over 64 features, attention over up to 38 keys;
    # two blocks and the head.
    tolerance.assert_close(got, want, scale=tolerance.magnitude(want), ulps=64,
                           terms=4 * tolerance.LAYER_TERMS, err_msg="direct TFLite vs Keras")
    assert (np.argmax(got, -1) == np.argmax(want, -1)).all()


def _greedy(path, prompt, max_length):
    """Greedy decoding with the model's signatures only: the prompt but its
    last token in `prefill_16` chunks, then `decode` (LiteRT-LM's loop)."""
    interpreter = _interpreter(path)
    decode = interpreter.get_signature_runner("decode")
    prefill = interpreter.get_signature_runner("prefill_16")
    cache = {n: np.zeros(d["shape"], d["dtype"])
             for n, d in decode.get_input_details().items() if n.startswith("kv_cache_")}
    for start in range(0, len(prompt) - 1, 16):
        chunk = prompt[start:len(prompt) - 1][:16]
        ids, pos = np.zeros((1, 16), np.int32), np.zeros((16,), np.int32)
        ids[0, :len(chunk)], pos[:len(chunk)] = chunk, np.arange(start, start + len(chunk))
        cache = prefill(tokens=ids, input_pos=pos, **cache)
    tokens, position, out = list(prompt), len(prompt) - 1, []
    while position < max_length - 1:
        result = decode(tokens=np.array([[tokens[position]]], np.int32),
                        input_pos=np.array([position], np.int32), **cache)
        nxt = int(np.argmax(result.pop("logits")[0, 0]))
        cache = result
        if nxt == EOS:
            break
        tokens.append(nxt)
        out.append(nxt)
        position += 1
    return out


def test_greedy_tokens_equal_keras_greedy_search(written):
    name, lm, path, _ = written
    prompt = [EOS] + list(np.random.default_rng(7).integers(2, VOCAB, 19))
    want = keras_tokens(lm, prompt, MAX_LEN)
    assert len(want) >= 8 and len(set(want)) >= 3, "degenerate generation tests nothing"
    assert _greedy(path, prompt, MAX_LEN) == want, name


def test_contract_and_weights_written_once_after_the_flatbuffer(written):
    from ai_edge_litert.tools import flatbuffer_utils

    name, lm, path, info = written
    content = path.read_bytes()
    model = flatbuffer_utils.convert_bytearray_to_object(content)
    signatures = {s.signatureKey.decode(): s for s in model.signatureDefs}
    assert sorted(signatures) == ["decode", "prefill_16", "prefill_4"]
    decode = _interpreter(path).get_signature_runner("decode")
    inputs = decode.get_input_details()
    for i, block in enumerate(lm.blocks):  # each layer's own key/value heads and head size
        attention = block.self_attention
        assert list(inputs[f"kv_cache_v_{i}"]["shape"]) == [
            1, MAX_LEN, attention.num_key_value_heads, attention.key_dim]
    assert list(inputs["tokens"]["shape"]) == [1, 1] and inputs["input_pos"]["dtype"] == np.int32
    assert list(decode.get_output_details()["logits"]["shape"]) == [1, 1, VOCAB]
    # Every sizable constant lies after the flatbuffer, addressed by offset,
    # inside the file; the model's parameters are stored once for the
    # three signatures (a tied table once: lookup and head read one buffer).
    assert not [b for b in model.buffers if b.data is not None and len(b.data) > 64]
    stored = [(int(b.offset), int(b.size)) for b in model.buffers if b.offset]
    assert min(o for o, _ in stored) >= info["flatbuffer_bytes"]
    assert max(o + s for o, s in stored) == len(content)
    parameters = sum(int(np.prod(w.shape)) for w in lm.weights) * 4
    norms = (2 * lm.num_layers + 1) * 64 * 4  # folded into the projections
    rotary = sum(2 * MAX_LEN * b.self_attention.key_dim * 4 for b in lm.blocks)  # cos, sin tables
    indices = 4096  # slot and position numbers, shapes
    assert parameters - norms <= sum(s for _, s in stored) <= parameters + rotary + indices
    ops = {flatbuffer_utils.opcode_to_name(model, op.opcodeIndex)
           for g in model.subgraphs for op in g.operators}
    assert {"FULLY_CONNECTED", "BATCH_MATMUL", "SOFTMAX", "GATHER", "DYNAMIC_UPDATE_SLICE",
            "RSQRT", "MEAN"} <= ops


def test_litert_lm_engine_generates_keras_greedy_from_text(tmp_path):
    """The bundle `export_litertlm` writes by default (the direct writer; a
    tied table, q/k/v biases) in LiteRT-LM's engine: Keras's greedy tokens."""
    litert_lm = pytest.importorskip("litert_lm")
    pytest.importorskip("litert_lm_builder")
    lm = _lm("qwen2_tied")
    path = tmp_path / "lm.litertlm"
    report = litertlm.export_litertlm(lm, path, tokenizer=word_tokenizer(), max_length=MAX_LEN,
                                      prefill_lengths=CHUNKS, bos_token_id=EOS,
                                      stop_token_ids=[EOS])
    # writer="auto" picks the direct writer where it covers the model.
    assert report.writer == "direct" and report.direct_writer_skipped is None
    assert report.max_abs_error <= report.atol
    engine = litert_lm.Engine(str(path), backend=litert_lm.Backend.CPU())
    try:
        for text in ("the cat sat on", "the red cat sat on the mat then the big dog ran"):
            prompt = [EOS] + word_tokenizer().encode(text).ids
            want = keras_tokens(lm, prompt, MAX_LEN)
            assert len(want) >= 4
            assert litertlm.generate(path, text, engine=engine) == engine.detokenize(
                [int(t) for t in want])
    finally:
        engine.close()


def test_int8_weights_per_output_channel(tmp_path):
    """int8 FULLY_CONNECTED weights: symmetric per output channel (zero
    points 0, dimension 0, scale max|row| / 127), checked against the
    Keras kernel; the tied table stored once, as the head's int8 weight."""
    from ai_edge_litert.tools import flatbuffer_utils

    lm = _lm("qwen2_tied")
    path = tmp_path / "int8.tflite"
    tflite_decoder.write_decoder_tflite(lm, path, max_length=MAX_LEN, prefill_lengths=CHUNKS,
                                        quantization="dynamic")
    model = flatbuffer_utils.convert_bytearray_to_object(path.read_bytes())
    content = path.read_bytes()
    graph = model.subgraphs[0]
    weights = {}
    for op in graph.operators:
        if flatbuffer_utils.opcode_to_name(model, op.opcodeIndex) == "FULLY_CONNECTED":
            tensor = graph.tensors[op.inputs[1]]
            buffer = model.buffers[tensor.buffer]
            codes = np.frombuffer(content, np.int8, int(buffer.size), int(buffer.offset))
            weights[tensor.name.decode()] = (tensor, codes.reshape(tensor.shape))
            assert op.builtinOptions.asymmetricQuantizeInputs
    tensor, codes = weights["lm_head/weight"]
    table = lm.embedding.embeddings.numpy()  # (V, hidden): the head's (out, in) weight
    q = tensor.quantization
    assert q.quantizedDimension == 0 and not np.any(q.zeroPoint)
    np.testing.assert_allclose(q.scale, np.abs(table).max(1) / 127, rtol=1e-6)
    # Rounded to the nearest code: within half a step of each row's scale.
    assert np.all(np.abs(codes * q.scale[:, None] - table) <= q.scale[:, None] * (0.5 + 1e-4))
    # The output projection of block 0 (`(H, d, D)` -> `(D, H * d)`).
    out = lm.blocks[0].self_attention.output_dense.kernel.numpy().reshape(-1, 32).T
    tensor, codes = weights["layers.0/attn/o/weight"]
    np.testing.assert_allclose(tensor.quantization.scale, np.abs(out).max(1) / 127, rtol=1e-6)
    # One int8 table of V x hidden codes in the whole file.
    tables = [b for b in model.buffers if int(b.size) == VOCAB * 32]
    assert len(tables) == 1


@pytest.mark.slow
def test_int8_keeps_keras_next_tokens_of_a_trained_decoder():
    """int8 weights (LiteRT's hybrid kernels): the next token under the
    same prefix (teacher forcing, the runtime's schedule) is Keras's float32
    one at nearly every position of held-out dates."""
    lm, _, width, held_out, answer, keras_next = trained_dates_decoder()
    content = tflite_decoder.written_bytes(tflite_decoder.write_decoder_tflite, lm, max_length=width + 1,
                                           prefill_lengths=(8,), quantization="dynamic")
    agree, agree_answer = [], []
    for row in range(40):
        length = int(np.count_nonzero(held_out[row]))
        logits, first = litertlm.runtime_logits(content, held_out[row, :length])
        got = logits.argmax(-1)
        agree.extend(got == keras_next[row, first:length])
        agree_answer.extend((got == keras_next[row, first:length])[answer[row, first:length]])
    # Measured here: 0.995 of 550 positions, 0.998 of the 419 answer characters.
    assert np.mean(agree) >= 0.95 and np.mean(agree_answer) >= 0.95, (np.mean(agree), np.mean(agree_answer))


def _refused(**options):
    kwargs = dict(num_key_value_heads=2, position="rotary", normalization="rms_norm",
                  use_gated_feedforward=True, activation="silu")
    kwargs.update(options)
    lm = DecoderOnlyLM(VOCAB, 16, 16, num_layers=1, num_heads=2, intermediate_dim=16,
                       pad_token_id=0, **kwargs)
    lm(np.array([[2, 3]], np.int32))
    return lm


@pytest.mark.parametrize("options,named", [
    (dict(position="learned"), "position='learned'"),
    (dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0,
                        "original_max_position_embeddings": 8}), "'dynamic'"),
    (dict(normalization="layer_norm"), "normalization='layer_norm'"),
])
def test_refuses_by_name_what_it_does_not_cover(options, named):
    with pytest.raises(NotFusableError, match=named):
        tflite_decoder.check_direct_decoder(_refused(**options))


def test_refuses_longrope_past_its_original_length():
    # LongRoPE switches factors with the call's length: exact only within
    # the original length, where the short factors always apply.
    lm = _refused(rope_scaling={"rope_type": "longrope", "short_factor": [1.0, 1.5, 2.0, 3.0],
                                "long_factor": [2.0] * 4, "original_max_position_embeddings": 16})
    tflite_decoder.check_direct_decoder(lm, max_length=16)
    with pytest.raises(NotFusableError, match="longrope.*max_length=17"):
        tflite_decoder.check_direct_decoder(lm, max_length=17)


def test_refuses_quantizations_it_does_not_write():
    with pytest.raises(NotFusableError, match="quantization='float16'"):
        tflite_decoder.check_direct_decoder(_refused(), "float16")


def test_export_falls_back_to_the_converter_with_a_warning(tmp_path):
    pytest.importorskip("litert_lm_builder")
    lm = _refused(normalization="layer_norm")
    tok = word_tokenizer()
    with pytest.warns(UserWarning, match="direct TFLite writer does not cover this model.*layer_norm"):
        report = litertlm.export_litertlm(lm, tmp_path / "a.litertlm", tokenizer=tok, max_length=8,
                                          prefill_lengths=(4,))
    assert report.writer == "converter" and "layer_norm" in report.direct_writer_skipped
    with pytest.raises(ValueError, match="writer='direct'.*layer_norm"):
        litertlm.export_litertlm(lm, tmp_path / "b.litertlm", tokenizer=tok, max_length=8,
                                 prefill_lengths=(4,), writer="direct")
    with pytest.raises(ValueError, match="writer='direct'.*cache_dtype='float16'"):
        litertlm.export_litertlm(_refused(), tmp_path / "c.litertlm", tokenizer=tok, max_length=8,
                                 prefill_lengths=(4,), writer="direct", cache_dtype="float16")
    with pytest.raises(ValueError, match="argument `writer`"):
        litertlm.export_litertlm(_refused(), tmp_path / "d.litertlm", tokenizer=tok, max_length=8,
                                 writer="tflite")
    assert not (tmp_path / "b.litertlm").exists()
