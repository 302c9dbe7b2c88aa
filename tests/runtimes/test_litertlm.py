"""LiteRT-LM runs our `.litertlm` bundles: from text (its own tokenizer and
loop over our prefill/decode signatures) to the tokens Keras's greedy search
gives, for a keras_attn decoder and for converted GPT-2 and Llama models
(checked against transformers' `generate`)."""

import numpy as np
import pytest

litert_lm = pytest.importorskip("litert_lm")
pytest.importorskip("litert_lm_builder")
pytest.importorskip("tokenizers")

from keras_attn.generation import DecoderOnlyLM  # noqa: E402
from keras_attn.runtimes import litertlm  # noqa: E402
from keras_attn.runtimes.litertlm import export_litertlm  # noqa: E402

from tests import tolerance  # noqa: E402
from tests.llm_runtime_models import (  # noqa: E402
    EOS, VOCAB, hf_model, hf_tokens, keras_tokens, scaled_lm, word_tokenizer)

MAX_LEN = 40
CHUNKS = (4, 16)


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    lm = scaled_lm(num_key_value_heads=2, position="rotary", normalization="rms_norm",
                   use_gated_feedforward=True, activation="silu")
    path = tmp_path_factory.mktemp("litertlm") / "lm.litertlm"
    lm.tflite_content = litertlm.litertlm_tflite(lm, max_length=MAX_LEN, prefill_lengths=CHUNKS)
    report = export_litertlm(lm, path, tokenizer=word_tokenizer(), max_length=MAX_LEN,
                             prefill_lengths=CHUNKS, bos_token_id=EOS, stop_token_ids=[EOS])
    engine = litert_lm.Engine(str(path), backend=litert_lm.Backend.CPU())
    yield lm, path, report, engine
    engine.close()


def test_bundle_follows_the_runtime_contract(bundle):
    lm, _, report, _ = bundle
    assert sorted(report.signatures) == ["decode", "prefill_16", "prefill_4"]
    decode = report.signatures["decode"]
    caches = [f"kv_cache_{kv}_{i}" for kv in "kv" for i in range(lm.num_layers)]
    assert sorted(decode["inputs"]) == sorted(caches + ["input_pos", "tokens"])
    assert sorted(decode["outputs"]) == sorted(caches + ["logits"])
    from ai_edge_litert import interpreter as litert

    details = litert.Interpreter(model_content=lm.tflite_content).get_signature_runner(
        "decode").get_input_details()
    # Key/value heads only, the sequence on axis 1 (the executor metadata says so).
    assert list(details["kv_cache_k_0"]["shape"]) == [1, MAX_LEN, 2, lm.head_dim]
    assert list(details["tokens"]["shape"]) == [1, 1]
    assert report.max_abs_error <= report.atol and report.agreement == 1.0


def test_weights_are_written_once_after_the_flatbuffer(bundle):
    # Three signatures (prefill_4, prefill_16, decode) read one set of
    # weights: the model holds them once, and every sizable constant lies
    # after the flatbuffer, addressed by offset (the layout that lifts
    # TFLite's 2 GB flatbuffer limit, taken at every size).
    from ai_edge_litert.tools import flatbuffer_utils

    lm = bundle[0]
    model = flatbuffer_utils.convert_bytearray_to_object(lm.tflite_content)
    names = [m.name.decode() for m in model.metadata or []]
    assert "buffer_location" in names
    inline = [len(b.data) for b in model.buffers if b.data is not None and len(b.data) > 64]
    assert inline == []
    stored = sum(int(b.size) for b in model.buffers if b.offset)
    weights = sum(int(np.prod(w.shape)) * 4 for w in lm.weights)
    assert weights <= stored < 1.5 * weights


@pytest.mark.parametrize("text", [
    "the cat sat on",  # one prefill chunk, padded
    "the red cat sat on the mat then the big dog ran",  # two chunks, the second padded
])
def test_generates_keras_greedy_from_text(bundle, text):
    lm, path, _, engine = bundle
    prompt = word_tokenizer().encode(text).ids
    assert engine.tokenize(text) == prompt
    want = keras_tokens(lm, [EOS] + prompt, MAX_LEN)  # LiteRT-LM puts the start token first
    assert len(want) >= 8 and len(set(want)) >= 3, "degenerate generation tests nothing"
    got = litertlm.generate(path, text, engine=engine)
    assert got == engine.detokenize([int(t) for t in want])


def test_runtime_schedule_in_the_interpreter_matches_keras(bundle):
    """The chunked prefill (padding at position 0) then decode, run here in the
    LiteRT interpreter, against Keras's full forward pass (NumPy comparison)."""
    lm, _, _, _ = bundle
    rng = np.random.default_rng(5)
    # 19 prefilled tokens: a full 16-token chunk, then 3 in a padded 4-token one.
    tokens = rng.integers(2, VOCAB, size=(1, 38)).astype("int32")
    got, first = litertlm.runtime_logits(lm.tflite_content, tokens[0])
    want = np.asarray(lm(tokens))[0, first:]
    scale = np.max(np.abs(want))
    assert np.max(np.abs(got - want)) <= 1e-5 * scale
    assert (np.argmax(got, -1) == np.argmax(want, -1)).all()


@pytest.mark.parametrize("lengths, tokens, capacity, want", [
    # LiteRT-LM's own cases (litert_compiled_model_executor_utils_test.cc,
    # CpuGreedyChunking and CpuGreedyCascadesRemainder).
    ((128, 1024), 512, None, [(128, 128)] * 4),
    ((32, 128, 512), 768, None, [(512, 512), (128, 128), (128, 128)]),
    # Issue 54: (32, 128) prefills 107 tokens in four calls of 32, (128,) in one.
    ((32, 128), 107, None, [(32, 32)] * 3 + [(32, 11)]),
    ((128,), 107, None, [(128, 107)]),
    ((128,), 1000, 1024, [(128, 128)] * 7 + [(128, 104)]),
    ((32, 128), 1020, 1024, [(128, 128)] * 7 + [(32, 32)] * 3 + [(32, 28)]),
])
def test_prefill_chunks_are_the_cpu_executors(lengths, tokens, capacity, want):
    assert litertlm.prefill_chunks(lengths, tokens, capacity) == want


def test_prefill_chunks_refuse_what_the_cache_cannot_hold():
    with pytest.raises(ValueError, match="cannot prefill 1000 tokens"):
        litertlm.prefill_chunks((128,), 1000, capacity=900)


@pytest.mark.parametrize("max_length", [256, 1024])
def test_default_prefill_never_costs_more_than_one_signature_of_128(max_length):
    # Every call streams all the weights and computes its padded length, so
    # a prompt is never slower than in a bundle with the one signature of 128
    # (litert-torch's) when it makes no more calls and pads no more slots:
    # ceil(n / 128) calls and 128 ceil(n / 128) slots.
    def calls_and_slots(lengths, n):
        chunks = litertlm.prefill_chunks(lengths, n, max_length)
        return len(chunks), sum(t for t, _ in chunks)

    def peer(n):
        return -(-n // 128), 128 * -(-n // 128)

    default = litertlm._prefill_lengths(None, max_length)
    assert [n for n in range(1, max_length + 1)
            if any(a > b for a, b in zip(calls_and_slots(default, n), peer(n)))] == []
    # (32, 128) pads as many slots at 97-127 tokens (and 128 more) in more calls.
    worse = [n for n in range(1, max_length + 1)
             if calls_and_slots((32, 128), n)[0] > peer(n)[0]
             and calls_and_slots((32, 128), n)[1] >= peer(n)[1]]
    assert worse == [n for n in range(1, max_length + 1) if 97 <= n % 128 <= 127]


def test_default_prefill_is_one_signature_of_128_capped_at_max_length():
    assert litertlm.DEFAULT_PREFILL_LENGTHS == (128,)
    lm = scaled_lm(position="rotary")
    assert sorted(litertlm.litertlm_functions(lm, max_length=12)) == ["decode", "prefill_12"]
    assert sorted(litertlm.litertlm_functions(lm, max_length=256)) == ["decode", "prefill_128"]


def test_dynamic_int8_bundle_generates(bundle, tmp_path):
    lm, _, _, _ = bundle
    path = tmp_path / "lm_int8.litertlm"
    report = export_litertlm(lm, path, tokenizer=word_tokenizer(), max_length=MAX_LEN,
                             prefill_lengths=CHUNKS, bos_token_id=EOS, stop_token_ids=[EOS],
                             quantization="dynamic", min_agreement=0.5)
    assert report.quantization == "dynamic" and report.agreement >= 0.5
    # int8 weights: the bundle shrinks by ~3/4 of the float32 weight bytes
    # (the tokenizer and metadata stay).
    weights = sum(w.numpy().nbytes for w in lm.weights)
    assert report.size_bytes < bundle[2].size_bytes - 0.5 * weights
    text = "the cat sat on"
    engine = litert_lm.Engine(str(path), backend=litert_lm.Backend.CPU())
    try:
        got = litertlm.generate(path, text, engine=engine)
        assert len(engine.tokenize(got)) >= 4
    finally:
        engine.close()


def test_float16_cache_bundle_halves_cache_memory_and_generates(bundle, tmp_path):
    lm, _, _, _ = bundle
    path = tmp_path / "lm_f16cache.litertlm"
    report = export_litertlm(lm, path, tokenizer=word_tokenizer(), max_length=MAX_LEN,
                             prefill_lengths=CHUNKS, bos_token_id=EOS, stop_token_ids=[EOS],
                             cache_dtype="float16")
    assert report.agreement >= report.min_agreement
    content = litertlm.litertlm_tflite(lm, max_length=MAX_LEN, prefill_lengths=CHUNKS,
                                       cache_dtype="float16")
    from ai_edge_litert import interpreter as litert

    details = litert.Interpreter(model_content=content).get_signature_runner(
        "decode").get_input_details()["kv_cache_v_1"]
    assert details["dtype"] == np.float16  # 2 bytes per value: half of float32's
    text = "the cat sat on"
    engine = litert_lm.Engine(str(path), backend=litert_lm.Backend.CPU())
    try:
        prompt = [EOS] + word_tokenizer().encode(text).ids
        want = keras_tokens(lm, prompt, MAX_LEN)
        got = litertlm.generate(path, text, engine=engine)
        if got != engine.detokenize([int(t) for t in want]):
            # float16 keys/values move the logits by a few float16 roundings
            # of their scale: the generations may part only where Keras's two
            # best tokens are that close. The first Keras step whose text the
            # engine's does not continue is where they part.
            step = next(k for k in range(len(want))
                        if not got.startswith(engine.detokenize([int(t) for t in want[:k + 1]])))
            logits = np.asarray(lm(np.array([prompt + list(want[:step])], np.int32)))[0, -1]
            top = np.sort(logits)[-2:]
            margin = top[1] - top[0]
            bound = tolerance.bound(np.abs(logits).max(), ulps=16, dtype="float16")
            assert step >= 8 and margin <= bound, (step, margin, bound)
    finally:
        engine.close()


def test_verification_refuses_a_model_that_is_not_the_keras_one(bundle):
    lm, _, _, _ = bundle
    other = scaled_lm(num_key_value_heads=2, position="rotary", normalization="rms_norm",
                      use_gated_feedforward=True, activation="silu")
    other.set_weights([w * 1.01 for w in lm.get_weights()])
    content = litertlm.litertlm_tflite(other, max_length=MAX_LEN, prefill_lengths=CHUNKS)
    with pytest.raises(ValueError, match="differ from Keras"):
        litertlm._verify(lm, content, MAX_LEN, None, None, None)


def test_refuses_what_litertlm_cannot_carry(tmp_path):
    from keras_attn.generation import Seq2SeqLM

    tok = word_tokenizer()
    s2s = Seq2SeqLM(20, 16, 16, num_layers=1, num_heads=2, intermediate_dim=16)
    with pytest.raises(ValueError, match="decoder-only"):
        export_litertlm(s2s, tmp_path / "a.litertlm", tokenizer=tok, max_length=8)
    learned = DecoderOnlyLM(20, 16, 16, num_layers=1, num_heads=2, intermediate_dim=16,
                            position="learned")
    with pytest.raises(ValueError, match="max_length \\+ max\\(prefill_lengths\\) - 1 = 23"):
        export_litertlm(learned, tmp_path / "a.litertlm", tokenizer=tok, max_length=12,
                        prefill_lengths=(12,))
    with pytest.raises(ValueError, match="prefill_lengths"):
        export_litertlm(scaled_lm(), tmp_path / "a.litertlm", tokenizer=tok, max_length=8,
                        prefill_lengths=(16,))
    with pytest.raises(ValueError, match="quantization"):
        export_litertlm(scaled_lm(), tmp_path / "a.litertlm", tokenizer=tok, max_length=8,
                        quantization="int4")
    assert not (tmp_path / "a.litertlm").exists()


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_converted_models_generate_hf_tokens(tmp_path, family):
    """GPT-2 (learned positions, no start token) and Llama (rotary, GQA,
    start token): LiteRT-LM's text = transformers' greedy `generate`."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from keras_attn.convert import from_huggingface

    hf = hf_model(family)
    bos = None if family == "gpt2" else EOS  # GPT-2 prompts have no start token
    lm = from_huggingface(hf)
    path = tmp_path / "hf.litertlm"
    export_litertlm(lm, path, tokenizer=word_tokenizer(), max_length=MAX_LEN,
                    prefill_lengths=(8, 16), bos_token_id=bos, stop_token_ids=[EOS])
    text = "the red cat sat on the"
    prompt = ([] if bos is None else [bos]) + word_tokenizer().encode(text).ids
    want = hf_tokens(hf, prompt, MAX_LEN)
    assert want == keras_tokens(lm, prompt, MAX_LEN) and len(want) >= 4
    engine = litert_lm.Engine(str(path), backend=litert_lm.Backend.CPU())
    try:
        assert litertlm.generate(path, text, engine=engine) == engine.detokenize(want)
    finally:
        engine.close()


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gemma2", "gemma3", "mistral", "phi3", "qwen3", "smollm3"])
def test_families_generate_hf_tokens(tmp_path, family):
    """The families beyond Llama and GPT-2 (tests/llm_runtime_models.HF_FAMILIES):
    sliding windows shorter than the generation on every layer (Mistral) or
    on some layers beside full ones (Gemma 2/3, Qwen3: the bundle's caches
    hold every position and the window is a band over them), QK-norm,
    sandwich norms, soft caps, two rotary bases, rotary-free layers, partial
    rotary with LongRoPE; LiteRT-LM's text = transformers' greedy `generate`.
    The bundle's TFLite model, driven here by a NumPy loop over its
    prefill/decode signatures (LiteRT's interpreter), predicts the same
    tokens."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from keras_attn.convert import from_huggingface
    from tests.llm_runtime_models import hf_family

    hf = hf_family(family)
    lm = from_huggingface(hf)
    path = tmp_path / "windowed.litertlm"
    written = []  # the bundle's TFLite model, kept as export_litertlm makes it
    write_tflite = litertlm.write_litertlm_tflite

    def keep(model, tflite_path, **kwargs):
        result = write_tflite(model, tflite_path, **kwargs)
        written.append(open(tflite_path, "rb").read())
        return result

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(litertlm, "write_litertlm_tflite", keep)
        export_litertlm(lm, path, tokenizer=word_tokenizer(), max_length=MAX_LEN,
                        prefill_lengths=(8, 16), bos_token_id=EOS, stop_token_ids=[EOS])
    text = "the red cat sat on the big mat then"
    prompt = [EOS] + word_tokenizer().encode(text).ids
    want = hf_tokens(hf, prompt, MAX_LEN)
    assert want == keras_tokens(lm, prompt, MAX_LEN) and len(want) >= 8
    sequence = prompt + want
    logits, first = litertlm.runtime_logits(written[0], sequence)
    # Row i predicts position first + i + 1: compare where that is a generated token.
    rows = [i for i in range(len(logits)) if len(prompt) <= first + i + 1 < len(sequence)]
    assert len(rows) >= 8
    assert [int(np.argmax(logits[i])) for i in rows] == [sequence[first + i + 1] for i in rows]
    engine = litert_lm.Engine(str(path), backend=litert_lm.Backend.CPU())
    try:
        assert litertlm.generate(path, text, engine=engine) == engine.detokenize(want)
    finally:
        engine.close()


NUMBERS = "one two three four five six seven eight nine ten eleven twelve".split()


@pytest.mark.slow
def test_word_vocabulary_model_trained_with_keras_attn(tmp_path):
    """A decoder trained here on a TextVectorization word vocabulary (counting
    sentences): `word_tokenizer` gives the runtime the same ids, and the
    bundle generates Keras's greedy words from text."""
    import keras

    from keras_attn.runtimes.tokenizers import word_tokenizer as words_to_tokenizer

    rng = np.random.default_rng(0)
    sentences = []
    for _ in range(600):
        start, length = rng.integers(0, 6), rng.integers(3, 7)
        sentences.append(" ".join(NUMBERS[start:start + length]) + " end")
    vectorize = keras.layers.TextVectorization(standardize="lower_and_strip_punctuation")
    vectorize.adapt(sentences)
    vocab = vectorize.get_vocabulary()
    tok = words_to_tokenizer(vocab)
    for text in ("Three four, FIVE!", "two zebra nine"):
        assert tok.encode(text).ids == [int(i) for i in np.asarray(vectorize([text]))[0]]
    ids = np.asarray(vectorize(sentences)).astype("int32")
    keras.utils.set_random_seed(0)
    lm = DecoderOnlyLM(len(vocab), 16, 32, num_layers=1, num_heads=2, intermediate_dim=64,
                       position="rotary")
    lm.compile(keras.optimizers.Adam(1e-2),
               keras.losses.SparseCategoricalCrossentropy(from_logits=True, ignore_class=0))
    history = lm.fit(ids[:, :-1], ids[:, 1:], epochs=8, batch_size=32, verbose=0)
    assert history.history["loss"][-1] < 0.5 * history.history["loss"][0]
    end = vocab.index("end")
    path = tmp_path / "numbers.litertlm"
    export_litertlm(lm, path, tokenizer=tok, max_length=12, prefill_lengths=(4,),
                    stop_token_ids=[end])
    engine = litert_lm.Engine(str(path), backend=litert_lm.Backend.CPU())
    try:
        for text in ("two three", "five six seven"):
            prompt = tok.encode(text).ids
            assert engine.tokenize(text) == prompt
            want = keras_tokens(lm, prompt, 12, eos=end)
            assert len(want) >= 2
            got = litertlm.generate(path, text, engine=engine)
            assert got == engine.detokenize(want) == tok.decode(want)
    finally:
        engine.close()
