"""The prefill/decode signatures' TFLite model written from the Keras weights
(`keras_attn.export.tflite_signatures`, `tflite_bytes(writer="direct")`):
Keras's and transformers' greedy tokens through `greedy_loop`, logits within
the float32 bound, the converter's names and shapes, the `valid` flag, ring
buffers past their window, int8 weights, and the fallback to the converter."""

import warnings

import numpy as np
import pytest

pytest.importorskip("tensorflow")
litert = pytest.importorskip("ai_edge_litert.interpreter")

from keras_attn.convert import from_huggingface  # noqa: E402
from keras_attn.generation import DecoderOnlyLM, greedy_search  # noqa: E402
from keras_attn.runtimes import signatures  # noqa: E402
from keras_attn.runtimes.loop import greedy_loop  # noqa: E402
from tests import tolerance  # noqa: E402
from tests.llm_runtime_models import (  # noqa: E402
    VOCAB, hf_family, hf_greedy, scaled_lm, trained_dates_decoder)

MAX_LEN = 24
LLAMA = dict(num_key_value_heads=2, position="rotary", normalization="rms_norm",
             use_gated_feedforward=True, activation="silu")
# Right-padded rows of 5, 3 and 1 prompt tokens (pad id 0).
PROMPTS = np.array([[5, 6, 7, 8, 9], [10, 11, 12, 0, 0], [13, 0, 0, 0, 0]], np.int32)


def _runners(content):
    interpreter = litert.Interpreter(model_content=content)
    ops = {d["op_name"] for d in interpreter._get_ops_details()}
    assert not [o for o in ops if o.startswith("Flex") or o == "CUSTOM"], ops
    return (interpreter, interpreter.get_signature_runner("prefill"),
            interpreter.get_signature_runner("decode"))


def _direct(lm, **kwargs):
    options = dict(max_length=MAX_LEN, batch_size=PROMPTS.shape[0], prompt_length=PROMPTS.shape[1])
    options.update(kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # the direct writer, no fallback
        return signatures.tflite_bytes(lm, writer="direct", **options)


@pytest.fixture(scope="module")
def llama():
    return scaled_lm(**LLAMA)


@pytest.fixture(scope="module")
def llama_direct(llama):
    return _direct(llama)


def test_greedy_loop_gives_keras_tokens_on_right_padded_rows(llama, llama_direct):
    _, prefill, decode = _runners(llama_direct)
    got = greedy_loop(prefill, decode, PROMPTS, MAX_LEN)
    want = np.asarray(greedy_search(llama, PROMPTS, MAX_LEN, pad_token_id=0))
    np.testing.assert_array_equal(got, want)
    assert len(np.unique(got[:, 5:])) > 3, "degenerate generation tests nothing"


def test_decode_step_generates_keras_tokens_from_the_filled_slots(llama, llama_direct, monkeypatch):
    """`decode_step` takes the first `L` slots of the caller's cache (a dynamic
    axis: the runner resizes it) and returns the new slot: the loop's cache
    lengths 8, 16 and 24 (bucket 8) give Keras's tokens."""
    import keras_attn.runtimes.loop as loop

    interpreter, prefill, _ = _runners(llama_direct)
    step = interpreter.get_signature_runner("decode_step")
    details = step.get_input_details()["cache"]
    assert details["shape_signature"].tolist() == [2, 2, 3, -1, 2, 8]
    assert step.get_output_details()["new_cache"]["shape"].tolist() == [2, 2, 3, 1, 2, 8]
    monkeypatch.setattr(loop, "STEP_BUCKET", 8)
    seen = []

    def run(**kwargs):
        seen.append(kwargs["cache"].shape[3])
        return step(**kwargs)

    got = greedy_loop(prefill, run, PROMPTS, MAX_LEN, step=True)
    want = np.asarray(greedy_search(llama, PROMPTS, MAX_LEN, pad_token_id=0))
    np.testing.assert_array_equal(got, want)
    assert sorted(set(seen)) == [8, 16, 24]
    cache = prefill(token_ids=PROMPTS)["cache"]
    for index, slots, ok in ((4, 5, True), (5, 5, False), (-1, 5, False), (MAX_LEN - 1, MAX_LEN, True)):
        out = step(token_ids=PROMPTS[:, :1], cache=np.ascontiguousarray(cache[:, :, :, :slots]),
                   index=np.array(index, np.int32))
        assert bool(out["valid"]) is ok, (index, slots)


def test_logits_within_the_float32_bound_of_keras(llama, llama_direct):
    """Teacher-forced: prefill the prompt, decode the rest of a sequence one
    token at a time; every position's logits against Keras's forward pass."""
    _, prefill, decode = _runners(llama_direct)
    ids = np.random.default_rng(1).integers(1, VOCAB, size=(3, 12)).astype(np.int32)
    out = prefill(token_ids=ids[:, :5])
    assert out["valid"]
    got = [out["logits"]]
    cache = out["cache"]
    for i in range(5, 12):
        out = decode(token_ids=ids[:, i:i + 1], cache=cache, index=np.array(i, np.int32))
        assert out["valid"]
        cache = out["cache"]
        got.append(out["logits"])
    want = np.asarray(llama(ids))
    tolerance.assert_close(np.concatenate(got, axis=1), want, terms=tolerance.LAYER_TERMS,
                           err_msg="direct TFLite logits")


@pytest.mark.slow
def test_names_shapes_and_order_are_the_converters(llama, llama_direct):
    converted = signatures.tflite_bytes(llama, max_length=MAX_LEN, batch_size=3, prompt_length=5,
                                        writer="traced")
    models = [litert.Interpreter(model_content=c) for c in (llama_direct, converted)]
    assert models[0].get_signature_list() == models[1].get_signature_list()
    for name in ("prefill", "decode", "decode_step"):
        for kind in ("get_input_details", "get_output_details"):
            details = [getattr(m.get_signature_runner(name), kind)() for m in models]
            assert list(details[0]) == list(details[1])
            for key in details[0]:
                assert details[0][key]["dtype"] == details[1][key]["dtype"], (name, key)
                # Inputs: the dynamic axes too. Outputs: the direct `new_cache`
                # says its one slot statically where the converter's is dynamic.
                shape = "shape_signature" if kind == "get_input_details" else "shape"
                np.testing.assert_array_equal(details[0][key][shape], details[1][key][shape])
    # Subgraph 0 (decode) in order, as a runner without signatures sees it:
    # token_ids, cache, index in; valid, logits, cache out.
    for kind in ("get_input_details", "get_output_details"):
        direct, converter = ([(d["shape"].tolist(), d["dtype"]) for d in getattr(m, kind)()]
                             for m in models)
        assert direct == converter, kind


def test_flag_marks_clamped_requests_invalid(llama, llama_direct):
    _, prefill, decode = _runners(llama_direct)
    good = prefill(token_ids=PROMPTS)
    assert good["valid"]
    bad = PROMPTS.copy()
    bad[1, 2] = VOCAB  # one id past the vocabulary
    assert not prefill(token_ids=bad)["valid"]
    step = PROMPTS[:, :1]
    cache = good["cache"]
    assert decode(token_ids=step, cache=cache, index=np.array(MAX_LEN - 1, np.int32))["valid"]
    for index, ids in ((MAX_LEN, step), (-1, step), (5, np.full_like(step, -1))):
        out = decode(token_ids=ids, cache=cache, index=np.array(index, np.int32))
        assert not out["valid"], (index, ids)
    # "none": no `valid` output.
    _, prefill, decode = _runners(_direct(llama, checks="none"))
    assert sorted(prefill(token_ids=PROMPTS)) == ["cache", "logits"]


def test_ring_buffer_runs_past_its_window_and_max_length():
    """One window on every layer: the cache is a ring of the window's slots,
    and the loop runs past the export's max_length (rotary angles from the
    position, not a table)."""
    window = 4
    # A tied head too: the table is stored once, as the head's weight.
    lm = DecoderOnlyLM(VOCAB, 64, 32, num_layers=2, num_heads=4, intermediate_dim=48, pad_token_id=0,
                       tie_embeddings=True, sliding_window=window, **LLAMA)
    lm(np.array([[2, 3]], np.int32))
    for w in lm.weights:  # spread logits: generations that vary
        w.assign(w.numpy() * 3)
    content = _direct(lm, max_length=12)
    interpreter, prefill, decode = _runners(content)
    assert tuple(decode.get_input_details()["cache"]["shape"]) == (2, 2, 3, window, 2, 8)
    assert "decode_step" not in interpreter.get_signature_list()  # a ring: its window's slots
    # Full rows only: a ring cannot step back over a prefilled right-padded prompt.
    full = np.array([[5, 6, 7, 8, 9], [10, 11, 12, 13, 14], [15, 16, 17, 18, 19]], np.int32)
    got = greedy_loop(prefill, decode, full, 30, sliding_window=window)
    want = np.asarray(greedy_search(lm, full, 30, pad_token_id=0))
    np.testing.assert_array_equal(got, want)
    assert len(np.unique(got[:, 5:])) > 3


@pytest.mark.parametrize("name", ["qwen2", "gemma2", "mistral"])
def test_converted_families_give_transformers_tokens(name):
    """Converted checkpoints: Qwen2's biases and one key/value head, Gemma
    2's soft caps, sandwich norms and windows on some layers (a band over
    full caches), Mistral's window on every layer (a ring)."""
    hf = hf_family(name)
    lm = from_huggingface(hf)
    prompts = np.random.default_rng(4).integers(3, VOCAB, size=(2, 6)).astype("int32")
    want = hf_greedy(hf, prompts, 20)
    _, prefill, decode = _runners(_direct(lm, max_length=20, batch_size=2, prompt_length=6))
    window = getattr(hf.config, "sliding_window", None) if name == "mistral" else None
    got = greedy_loop(prefill, decode, prompts, 20, sliding_window=window)
    np.testing.assert_array_equal(got, want)
    assert len(np.unique(got[:, 6:])) > 3, "degenerate generation tests nothing"


@pytest.mark.slow
def test_int8_keeps_keras_next_tokens_of_a_trained_decoder():
    """int8 weights (per output channel, LiteRT's hybrid kernels): the next
    token of held-out dates, teacher-forced, is Keras's float32 one."""
    lm, _, width, held_out, answer, keras_next = trained_dates_decoder()
    rows = held_out[:16]
    width = rows.shape[1]
    content = _direct(lm, max_length=width, batch_size=len(rows), prompt_length=width,
                      quantization="dynamic", checks="none")
    interpreter, prefill, _ = _runners(content)
    assert any(d["dtype"] == np.int8 for d in interpreter.get_tensor_details())
    got = prefill(token_ids=rows)["logits"].argmax(-1)
    real = rows > 0
    agree = (got == keras_next[:16])[real].mean()
    agree_answer = (got == keras_next[:16])[answer[:16]].mean()
    assert agree >= 0.95 and agree_answer >= 0.95, (agree, agree_answer)


@pytest.mark.slow
def test_int4_keeps_keras_next_tokens_of_a_trained_decoder():
    """int4 weights in blocks of 32 (the LiteRT-LM writer's layout, XNNPACK's
    blockwise kernels) written directly, not by the converter and
    ai-edge-quantizer: the next token of held-out dates, teacher-forced, is
    Keras's float32 one at the int4 floor of the LiteRT-LM bundles."""
    from ai_edge_litert import interpreter as litert

    lm, _, width, held_out, answer, keras_next = trained_dates_decoder(num_heads=4, intermediate_dim=128)
    rows = held_out[:16]
    content = _direct(lm, max_length=rows.shape[1], batch_size=len(rows), prompt_length=rows.shape[1],
                      quantization="int4", checks="none")
    interpreter = litert.Interpreter(model_content=content)  # XNNPACK
    got = interpreter.get_signature_runner("prefill")(token_ids=rows)["logits"].argmax(-1)
    real = rows > 0
    agree = (got == keras_next[:16])[real].mean()
    agree_answer = (got == keras_next[:16])[answer[:16]].mean()
    assert agree >= 0.8 and agree_answer >= 0.8, (agree, agree_answer)
    int8 = _direct(lm, max_length=rows.shape[1], batch_size=len(rows), prompt_length=rows.shape[1],
                   quantization="dynamic", checks="none")
    assert len(content) < 0.7 * len(int8)  # four bits, not eight, for most weights


def test_auto_falls_back_to_the_converter_naming_why(llama):
    kwargs = dict(max_length=8, batch_size=1, prompt_length=2, cache_dtype="float16")
    with pytest.raises(ValueError, match="cache_dtype='float16'"):
        signatures.tflite_bytes(llama, writer="direct", **kwargs)
    with pytest.warns(UserWarning, match="cache_dtype='float16'"):
        content = signatures.tflite_bytes(llama, **kwargs)
    _, prefill, _ = _runners(content)
    assert prefill.get_output_details()["cache"]["dtype"] == np.float16
    # Caches of other shapes per layer (stacked padded): the converter's.
    mixed = DecoderOnlyLM(VOCAB, 16, 16, num_layers=2, num_heads=2, intermediate_dim=16,
                          head_dim=[8, 16], **{k: v for k, v in LLAMA.items() if k != "num_key_value_heads"})
    mixed(np.array([[2, 3]], np.int32))
    with pytest.raises(ValueError, match="other shapes per layer"):
        signatures.tflite_bytes(mixed, writer="direct", max_length=8, batch_size=1, prompt_length=2)
    with pytest.raises(ValueError, match="writer"):
        signatures.tflite_bytes(llama, writer="fast", max_length=8, batch_size=1, prompt_length=2)


def test_an_unbuilt_model_is_built_before_the_direct_writer_reads_it():
    """A model never called has no weights yet: the writer builds it first
    (it used to read the blocks' attention layers before they existed)."""
    lm = DecoderOnlyLM(VOCAB, 32, 16, num_layers=1, num_heads=2, intermediate_dim=32, **LLAMA)
    assert not lm.built
    _, prefill, decode = _runners(_direct(lm, max_length=8, batch_size=1, prompt_length=2))
    prompt = np.array([[3, 4]], np.int32)
    got = greedy_loop(prefill, decode, prompt, 8)
    np.testing.assert_array_equal(got, np.asarray(greedy_search(lm, prompt, 8, pad_token_id=0)))
