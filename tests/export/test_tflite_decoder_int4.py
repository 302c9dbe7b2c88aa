"""int4 weights in the direct TFLite writer (`keras_attn.export.tflite_decoder`,
`quantization="int4"`): the layout ai-edge-quantizer's `dynamic_wi4b32_afp32`
recipe writes, checked against a block quantization written here; next
tokens of a trained decoder against float32 Keras and against the
converter + ai-edge-quantizer path; the bundle in LiteRT-LM's engine from
text; its size beside int8."""

import numpy as np
import pytest

pytest.importorskip("ai_edge_litert")

from keras_attn.export import tflite_decoder  # noqa: E402
from keras_attn.generation import DecoderOnlyLM  # noqa: E402
from keras_attn.runtimes import litertlm  # noqa: E402

from tests.llm_runtime_models import EOS, VOCAB, keras_tokens, trained_dates_decoder  # noqa: E402

BLOCK = 32
INT4, FLOAT16 = 17, 1  # TensorType


def _tiny_lm():
    # Hidden 32 and heads of 8 (one block per row), intermediate 48: the
    # down projection's input is not a multiple of 32 (written int8).
    lm = DecoderOnlyLM(VOCAB, 64, 32, num_layers=2, num_heads=4, num_key_value_heads=1,
                       intermediate_dim=48, pad_token_id=0, position="rotary",
                       normalization="rms_norm", use_gated_feedforward=True, activation="silu",
                       attention_use_bias=True, tie_embeddings=True)
    lm(np.array([[2, 3]], np.int32))
    return lm


def _bfloat16(x):
    """float32 `x` rounded to bfloat16's 8 significant bits (to nearest, ties to even)."""
    bits = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.astype(np.uint32).view(np.float32)


def _reference_blocks(w):
    """Symmetric int4 blocks of 32 along the input axis of `w` `(N, K)`:
    scale max|block| / 7 (bfloat16-rounded, as the quantizer stores it)."""
    n, k = w.shape
    blocks = w.astype(np.float32).reshape(n, k // BLOCK, BLOCK)
    # The quantizer divides in float32, then rounds to bfloat16.
    return _bfloat16(np.abs(blocks).max(-1) / np.float32(7))


def _tensor_bytes(model, content, tensor):
    buffer = model.buffers[tensor.buffer]
    if buffer.offset:
        return np.frombuffer(content, np.uint8, int(buffer.size), int(buffer.offset))
    return np.asarray(buffer.data, np.uint8)


def _unpack_int4(raw, shape):
    """Two signed 4-bit codes per byte, the even element in the low nibble."""
    low = (raw & 0x0F).astype(np.int8)
    high = (raw >> 4).astype(np.int8)
    codes = np.stack([low, high], -1).reshape(shape)
    return np.where(codes > 7, codes - 16, codes)


def _fc_weights(model, content):
    """`{name: (tensor, op name)}` of the constant weights FULLY_CONNECTED and
    EMBEDDING_LOOKUP read in `decode`."""
    from ai_edge_litert.tools import flatbuffer_utils

    graph = model.subgraphs[0]
    found = {}
    for op in graph.operators:
        name = flatbuffer_utils.opcode_to_name(model, op.opcodeIndex)
        if name in ("FULLY_CONNECTED", "EMBEDDING_LOOKUP"):
            tensor = graph.tensors[op.inputs[1]]
            found.setdefault(tensor.name.decode(), (tensor, []))[1].append((name, op))
    return graph, found


def test_int4_weights_in_blocks_of_32_as_ai_edge_quantizer_writes_them(tmp_path):
    """Each FULLY_CONNECTED weight with an input dimension a multiple of 32:
    INT4 `(N, K)`, two codes per byte, `BlockwiseQuantization` (block 32, no
    zero points) naming a float16 `(N, K / 32)` scales tensor; dequantized,
    the codes are the Keras weight rounded to its block's step. The tied
    table is stored once: the head's int4 weight, read by EMBEDDING_LOOKUP."""
    from ai_edge_litert.tools import flatbuffer_utils

    lm = _tiny_lm()
    path = tmp_path / "int4.tflite"
    tflite_decoder.write_decoder_tflite(lm, path, max_length=16, prefill_lengths=(4,),
                                        quantization="int4")
    content = path.read_bytes()
    model = flatbuffer_utils.convert_bytearray_to_object(content)
    graph, weights = _fc_weights(model, content)

    def check(name, want):
        tensor, ops = weights[name]
        n, k = want.shape
        assert tensor.type == INT4 and list(tensor.shape) == [n, k], name
        q = tensor.quantization
        assert q.scale is None and q.zeroPoint is None
        details = q.details
        assert (details.blockSize, details.zeroPoints) == (BLOCK, -1), name
        scales_tensor = graph.tensors[details.scales]
        assert scales_tensor.type == FLOAT16 and list(scales_tensor.shape) == [n, k // BLOCK]
        scales = _tensor_bytes(model, content, scales_tensor).view(np.float16).reshape(n, -1)
        raw = _tensor_bytes(model, content, tensor)
        assert raw.size == n * k // 2
        codes = _unpack_int4(raw, (n, k))
        want_scales = _reference_blocks(want)
        np.testing.assert_array_equal(scales.astype(np.float32), want_scales, err_msg=name)
        step = np.repeat(want_scales, BLOCK, axis=1).astype(np.float64)
        got = codes * step
        # Each value rounded to the nearest step of its block (the largest
        # one lands on +-7: the scale's bfloat16 rounding is < 1/2 step).
        assert np.all(np.abs(got - want) <= step * (0.5 + 1e-6)), name
        assert np.abs(codes).max() == 7
        return ops

    table = lm.embedding.embeddings.numpy()  # (V, hidden): the tied head's (out, in) weight
    ops = check("lm_head/weight", table)
    assert sorted(name for name, _ in ops) == ["EMBEDDING_LOOKUP", "FULLY_CONNECTED"]
    out = lm.blocks[0].self_attention.output_dense.kernel.numpy().reshape(-1, 32).T
    check("layers.0/attn/o/weight", out)
    for name, op in ops:
        if name == "FULLY_CONNECTED":  # as the quantizer leaves it
            assert not op.builtinOptions.asymmetricQuantizeInputs
    # One int4 table in the whole file; a quantized projection per weight.
    assert len([b for b in model.buffers if int(b.size) == VOCAB * 32 // 2]) == 1
    # The down projection (48 inputs: no whole blocks) is int8 per output channel.
    tensor, _ = weights["layers.0/mlp/down/weight"]
    assert tensor.type == 9 and len(tensor.quantization.scale) == 32


def test_int4_file_about_half_of_int8(tmp_path):
    """4 bits and a 16-bit scale per 32 weights (4.5 bits) against int8's 8
    bits and a 32-bit scale per row of 256 (8.125 bits; each signature's
    tensors repeat the scales): 0.55 of the int8 file, with the float
    constants (rotary tables, norms) both have."""
    lm = DecoderOnlyLM(VOCAB, 16, 256, num_layers=2, num_heads=4, num_key_value_heads=1,
                       intermediate_dim=512, position="rotary", normalization="rms_norm",
                       use_gated_feedforward=True, activation="silu", tie_embeddings=True)
    lm(np.array([[2, 3]], np.int32))
    sizes = {}
    for quantization in ("int4", "dynamic"):
        path = tmp_path / f"{quantization}.tflite"
        tflite_decoder.write_decoder_tflite(lm, path, max_length=16, prefill_lengths=(4,),
                                            quantization=quantization)
        sizes[quantization] = path.stat().st_size
    assert 0.5 <= sizes["int4"] / sizes["dynamic"] <= 4.5 / 8.125 + 0.04, sizes


@pytest.fixture(scope="module")
def trained():
    # Every projection's input a multiple of 32 (hidden 64, heads 4 x 16,
    # intermediate 128), so that ai-edge-quantizer quantizes them all too.
    return trained_dates_decoder(num_heads=4, intermediate_dim=128)


def _agreement(content, held_out, answer, keras_next):
    agree, agree_answer = [], []
    for row in range(len(held_out)):
        length = int(np.count_nonzero(held_out[row]))
        logits, first = litertlm.runtime_logits(content, held_out[row, :length])
        same = logits.argmax(-1) == keras_next[row, first:length]
        agree.extend(same)
        agree_answer.extend(same[answer[row, first:length]])
    return float(np.mean(agree)), float(np.mean(agree_answer))


@pytest.mark.slow
def test_int4_keeps_keras_next_tokens_as_the_converter_path_does(trained):
    """The next token under the same prefix (teacher forcing, the runtime's
    schedule, 200 held-out dates) is float32 Keras's at the export's int4
    floor at least, and within 0.015 of what TensorFlow's converter followed
    by ai-edge-quantizer gives: its projections are the same int4 blocks
    (with the table in float32 both agree at the same positions), its token
    table float32 (7x the int4 table's bytes; the int4 table cost 0.006 of
    the positions here)."""
    lm, _, width, held_out, answer, keras_next = trained
    kwargs = dict(max_length=width + 1, prefill_lengths=(8,), quantization="int4")
    direct = _agreement(tflite_decoder.written_bytes(tflite_decoder.write_decoder_tflite, lm, **kwargs),
                        held_out, answer, keras_next)
    pytest.importorskip("ai_edge_quantizer")
    converted = litertlm.litertlm_tflite(lm, writer="traced", **kwargs)
    converter = _agreement(converted, held_out, answer, keras_next)
    # Measured here: 0.914 of 2681 positions (0.931 of the answers), the
    # converter's 0.921 (0.934).
    floor = litertlm.DEFAULT_MIN_AGREEMENT["int4"]
    assert min(direct) >= floor, direct
    assert direct[0] >= converter[0] - 0.015 and direct[1] >= converter[1] - 0.015, (direct, converter)


@pytest.mark.slow
def test_int4_bundle_in_litert_lm_engine_from_text(trained, tmp_path):
    """`export_litertlm(quantization="int4")` takes the direct writer (no
    fallback), passes its own verification, and LiteRT-LM's engine
    generates from text the tokens the TFLite model's own greedy loop
    gives, mostly Keras's characters."""
    litert_lm = pytest.importorskip("litert_lm")
    pytest.importorskip("litert_lm_builder")
    from keras_attn.data.dates import generate_examples

    lm, tok, width, _, _, _ = trained
    path = tmp_path / "int4.litertlm"
    report = litertlm.export_litertlm(lm, path, tokenizer=tok, max_length=width,
                                      prefill_lengths=(8,), quantization="int4",
                                      stop_token_ids=[EOS])
    assert report.writer == "direct" and report.direct_writer_skipped is None
    # 0.83 on the export's verification sequence (the converter path too).
    assert report.agreement >= report.min_agreement == litertlm.DEFAULT_MIN_AGREEMENT["int4"]
    content = tflite_decoder.written_bytes(tflite_decoder.write_decoder_tflite, lm, max_length=width,
                                           prefill_lengths=(8,), quantization="int4")
    engine = litert_lm.Engine(str(path), backend=litert_lm.Backend.CPU())
    same = total = 0
    try:
        for human, _ in generate_examples(6, seed=97):
            text = f"{human}="
            prompt = tok.encode(text).ids
            tokens = list(prompt)
            while len(tokens) < width:  # the TFLite model's greedy tokens
                logits, _ = litertlm.runtime_logits(content, tokens)
                token = int(logits[-1].argmax())
                if token == EOS:
                    break
                tokens.append(token)
            want = tokens[len(prompt):]
            assert len(want) >= 8
            assert litertlm.generate(path, text, engine=engine) == engine.detokenize(want)
            keras = keras_tokens(lm, prompt, width)
            same += sum(a == b for a, b in zip(want, keras))
            total += max(len(want), len(keras))
    finally:
        engine.close()
    # Measured here: 0.91 of the characters of 20 dates are Keras's.
    assert same / total >= 0.8, same / total
