"""Exported prefill/decode artifacts reproduce Keras greedy decoding token for token.

Each artifact is driven by `_artifact_greedy` below, a NumPy-only loop that
knows nothing of Keras or keras_attn: it sees only the runtime's callables.
"""

import numpy as np
import pytest
import tensorflow as tf

from keras_attn.generation import DecoderOnlyLM, Seq2SeqLM, greedy_search
from keras_attn.runtimes import signatures as gen_export

MAX_LEN = 12
PROMPTS = np.array([[5, 6, 7, 0], [3, 4, 0, 0], [9, 8, 7, 6]], np.int32)
ENC = np.array([[5, 6, 7, 8, 0, 0], [3, 4, 5, 6, 7, 9]], np.int32)
START = np.array([[1], [1]], np.int32)


def _artifact_greedy(prefill, decode, prompt, max_length, encoder_ids=None, pad=0):
    """Greedy decoding with only the exported `prefill` / `decode` callables."""
    batch, width = prompt.shape
    tokens = np.full((batch, max_length), pad, np.int32)
    tokens[:, :width] = prompt
    lengths = (prompt != pad).sum(1)
    inputs = {"token_ids": prompt}
    if encoder_ids is not None:
        inputs["encoder_ids"] = encoder_ids
    out = prefill(**inputs)
    state = {k: out[k] for k in ("cache", "cross_cache", "encoder_padding_mask") if k in out}
    for i in range(lengths.min(), max_length):
        out = decode(token_ids=tokens[:, i - 1:i], index=np.array(i - 1, np.int32), **state)
        state["cache"] = out["cache"]
        chosen = np.argmax(out["logits"][:, 0], axis=-1)
        tokens[:, i] = np.where(i < lengths, tokens[:, i], chosen)
    return tokens


@pytest.fixture(scope="module")
def decoder_only():
    lm = DecoderOnlyLM(23, 32, 16, num_layers=2, num_heads=4, intermediate_dim=32,
                       num_key_value_heads=2, position="rotary")
    lm(PROMPTS)
    return lm, greedy_search(lm, PROMPTS, MAX_LEN).numpy()


@pytest.fixture(scope="module")
def encoder_decoder():
    model = Seq2SeqLM(23, 32, 16, num_layers=1, num_heads=4, intermediate_dim=32,
                      num_key_value_heads=2)
    model((ENC, START))
    return model, greedy_search(model, START, 8, encoder_ids=ENC).numpy()


def _tf_runner(fn):
    def run(**kwargs):
        return {k: v.numpy() for k, v in fn(**{k: tf.constant(v) for k, v in kwargs.items()}).items()}

    return run


@pytest.mark.slow
def test_saved_model_prefill_decode_generate(tmp_path, decoder_only, encoder_decoder):
    lm, expected = decoder_only
    path = gen_export.export_saved_model(lm, str(tmp_path / "lm"), max_length=MAX_LEN)
    loaded = tf.saved_model.load(path)
    assert set(loaded.signatures) == {"prefill", "decode", "decode_step", "generate"}
    got = _artifact_greedy(_tf_runner(loaded.signatures["prefill"]),
                           _tf_runner(loaded.signatures["decode"]), PROMPTS, MAX_LEN)
    np.testing.assert_array_equal(got, expected)
    generated = loaded.signatures["generate"](prompt_ids=tf.constant(PROMPTS))["tokens"]
    np.testing.assert_array_equal(generated.numpy(), expected)
    # A second batch size through the same signatures.
    one = _artifact_greedy(_tf_runner(loaded.signatures["prefill"]),
                           _tf_runner(loaded.signatures["decode"]), PROMPTS[2:, :], MAX_LEN)
    np.testing.assert_array_equal(one, expected[2:])

    model, expected = encoder_decoder
    path = gen_export.export_saved_model(model, str(tmp_path / "s2s"), max_length=8)
    loaded = tf.saved_model.load(path)
    got = _artifact_greedy(_tf_runner(loaded.signatures["prefill"]),
                           _tf_runner(loaded.signatures["decode"]), START, 8, ENC)
    np.testing.assert_array_equal(got, expected)
    generated = loaded.signatures["generate"](prompt_ids=tf.constant(START),
                                              encoder_ids=tf.constant(ENC))["tokens"]
    np.testing.assert_array_equal(generated.numpy(), expected)


def _litert(content):
    from ai_edge_litert import interpreter as litert

    interpreter = litert.Interpreter(model_content=content)
    ops = {d["op_name"] for d in interpreter._get_ops_details()}
    return interpreter, ops


@pytest.mark.slow
def test_tflite_signatures_builtins_only(tmp_path, decoder_only, encoder_decoder):
    lm, expected = decoder_only
    content = gen_export.tflite_bytes(lm, max_length=MAX_LEN, batch_size=3, prompt_length=4)
    interpreter, ops = _litert(content)
    assert set(interpreter.get_signature_list()) == {"prefill", "decode", "decode_step"}
    assert not [o for o in ops if o.startswith("Flex") or o == "CUSTOM" or "VAR" in o], ops
    got = _artifact_greedy(interpreter.get_signature_runner("prefill"),
                           interpreter.get_signature_runner("decode"), PROMPTS, MAX_LEN)
    np.testing.assert_array_equal(got, expected)
    # The packaged NumPy loop gives the same tokens.
    again = gen_export.greedy_loop(interpreter.get_signature_runner("prefill"),
                                   interpreter.get_signature_runner("decode"), PROMPTS, MAX_LEN)
    np.testing.assert_array_equal(again, expected)

    model, expected = encoder_decoder
    path = gen_export.export_tflite(model, str(tmp_path / "s2s.tflite"), max_length=8,
                                    batch_size=2, prompt_length=1, encoder_length=ENC.shape[1])
    interpreter, ops = _litert(open(path, "rb").read())
    assert not [o for o in ops if o.startswith("Flex") or o == "CUSTOM"], ops
    got = _artifact_greedy(interpreter.get_signature_runner("prefill"),
                           interpreter.get_signature_runner("decode"), START, 8, ENC)
    np.testing.assert_array_equal(got, expected)


def _ort_runner(session):
    def run(**kwargs):
        names = [o.name for o in session.get_outputs()]
        values = session.run(None, kwargs)
        return {n.removesuffix("_out"): v for n, v in zip(names, values)}

    return run


@pytest.mark.slow
def test_onnx_prefill_decode(tmp_path, decoder_only, encoder_decoder):
    import onnxruntime as ort

    for (model, expected), prompt, max_len, enc in (
        (decoder_only, PROMPTS, MAX_LEN, None),
        (encoder_decoder, START, 8, ENC),
    ):
        paths = gen_export.export_onnx(model, str(tmp_path / model.name), max_length=max_len)
        sessions = {k: ort.InferenceSession(p, providers=["CPUExecutionProvider"])
                    for k, p in paths.files.items() if k != "weights"}
        got = _artifact_greedy(_ort_runner(sessions["prefill"]), _ort_runner(sessions["decode"]),
                               prompt, max_len, enc)
        np.testing.assert_array_equal(got, expected)


def test_greedy_loop_checks_the_exported_cache_length(decoder_only):
    lm, expected = decoder_only
    fns = gen_export.signature_functions(lm, max_length=MAX_LEN)
    prefill, decode = _tf_runner(fns["prefill"]), _tf_runner(fns["decode"])
    got = gen_export.greedy_loop(prefill, decode, PROMPTS.tolist(), MAX_LEN)
    np.testing.assert_array_equal(got, expected)
    # Steps past the cache would be dropped (wrong tokens): rejected up front.
    with pytest.raises(ValueError, match=rf"holds {MAX_LEN} positions.*max_length={MAX_LEN + 2}"):
        gen_export.greedy_loop(prefill, decode, PROMPTS, MAX_LEN + 2)
    with pytest.raises(ValueError, match=r"prompt_ids.*2-D.*shape=\(4,\)"):
        gen_export.greedy_loop(prefill, decode, PROMPTS[0], MAX_LEN)
    with pytest.raises(ValueError, match="max_length"):
        gen_export.greedy_loop(prefill, decode, PROMPTS, 0)


def test_greedy_loop_ring_buffer_runs_past_its_cache():
    lm = DecoderOnlyLM(23, 8, 16, num_layers=1, num_heads=2, intermediate_dim=32,
                       position="rotary", sliding_window=3)
    lm(PROMPTS)
    fns = gen_export.signature_functions(lm, max_length=8)
    prefill, decode = _tf_runner(fns["prefill"]), _tf_runner(fns["decode"])
    got = gen_export.greedy_loop(prefill, decode, PROMPTS, 10, sliding_window=3)
    for row, prompt in zip(got, PROMPTS):
        seq = [int(t) for t in prompt if t]  # recomputed with the windowed full pass
        while len(seq) < 10:
            seq.append(int(np.argmax(np.asarray(lm(np.array([seq])))[0, -1])))
        np.testing.assert_array_equal(row, seq)
    # Without the window a 3-slot cache cannot be told from a too-short one.
    for window in (None, 5):
        with pytest.raises(ValueError, match=r"holds 3 positions.*sliding_window=3"):
            gen_export.greedy_loop(prefill, decode, PROMPTS, 10, sliding_window=window)


def test_signature_functions_check_learned_positions():
    lm = DecoderOnlyLM(23, 8, 16, num_layers=1, num_heads=2, intermediate_dim=32,
                       position="learned")
    with pytest.raises(ValueError, match=r"max_positions=8.*max_length=9"):
        gen_export.signature_functions(lm, max_length=9)
    s2s = Seq2SeqLM(23, 8, 16, num_layers=1, num_heads=2, intermediate_dim=32,
                    position="learned")
    with pytest.raises(ValueError, match=r"encoder_ids.*max_positions=8.*length=10"):
        gen_export.signature_functions(s2s, max_length=8, encoder_length=10)


def test_tflite_float16_cache_stores_rounded_keys_and_values(decoder_only):
    """`cache_dtype="float16"`: the cache travels as float16, and each call is
    Keras's float32 call on the float16-rounded cache (NumPy rounding here is
    the reference), so decode logits match Keras given that rounded cache."""
    from tests import tolerance

    lm, _ = decoder_only
    content = gen_export.tflite_bytes(lm, max_length=MAX_LEN, batch_size=3, prompt_length=4,
                                      checks="none", cache_dtype="float16")
    interpreter, _ = _litert(content)
    prefill = interpreter.get_signature_runner("prefill")
    decode = interpreter.get_signature_runner("decode")
    assert decode.get_input_details()["cache"]["dtype"] == np.float16
    out = prefill(token_ids=PROMPTS)
    keras_logits, keras_cache = lm.call_with_cache(PROMPTS, lm.init_cache(3, MAX_LEN), 0)
    full = np.asarray(gen_export.cache_lib.stack_cache(keras_cache))
    # Keras's float32 keys/values rounded to float16 (1 float16 ulp: float32
    # sums in another order may round the other way).
    ulp16 = np.spacing(np.abs(full).astype(np.float16)).astype(np.float32)
    assert np.all(np.abs(out["cache"].astype(np.float32) - full) <= ulp16 + 1e-6)
    rounded = out["cache"].astype(np.float32)
    step = np.array([[3], [4], [5]], np.int32)
    got = decode(token_ids=step, cache=out["cache"], index=np.array(4, np.int32))
    want, _ = lm.call_with_cache(step, gen_export.cache_lib.unstack_cache(rounded), 4)
    want = np.asarray(want)
    tolerance.assert_close(got["logits"], want, terms=lm.hidden_dim, scale=np.abs(want).max())
    assert got["cache"].dtype == np.float16


def test_tflite_int8_and_int4_weights_generation_export():
    """`quantization="dynamic"`: int8 weights (a smaller flatbuffer, the
    hybrid FULLY_CONNECTED kernels) and next tokens close to Keras's. (The
    converter leaves tensors under 1024 values in float: hidden 64 here.)"""
    lm = DecoderOnlyLM(64, 32, 64, num_layers=1, num_heads=4, intermediate_dim=128,
                       num_key_value_heads=2, position="rotary")
    lm(PROMPTS)
    kwargs = dict(max_length=MAX_LEN, batch_size=3, prompt_length=4, checks="none")
    float_content = gen_export.tflite_bytes(lm, **kwargs)
    content = gen_export.tflite_bytes(lm, quantization="dynamic", **kwargs)
    assert len(content) < len(float_content)
    from ai_edge_litert import interpreter as litert

    details = litert.Interpreter(model_content=content).get_tensor_details()
    assert any(d["dtype"] == np.int8 for d in details)
    interpreter, _ = _litert(content)
    out = interpreter.get_signature_runner("prefill")(token_ids=PROMPTS)
    want = np.asarray(lm.call_with_cache(PROMPTS, lm.init_cache(3, MAX_LEN), 0)[0])
    agree = np.mean(np.argmax(out["logits"], -1) == np.argmax(want, -1))
    assert agree >= 0.75, agree
    pytest.importorskip("ai_edge_quantizer")
    int4 = gen_export.tflite_bytes(lm, quantization="int4", **kwargs)
    assert len(int4) < len(content)  # 4-bit blocks (with a scale per 32) below 8-bit
    interpreter, _ = _litert(int4)
    out = interpreter.get_signature_runner("prefill")(token_ids=PROMPTS)
    assert np.mean(np.argmax(out["logits"], -1) == np.argmax(want, -1)) >= 0.5
    with pytest.raises(ValueError, match="quantization"):
        gen_export.tflite_bytes(lm, quantization="int2", **kwargs)
    with pytest.raises(ValueError, match="cache_dtype"):
        gen_export.tflite_bytes(lm, cache_dtype="bfloat16", **kwargs)
