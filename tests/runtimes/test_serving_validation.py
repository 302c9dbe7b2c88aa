"""Bad requests to exported prefill/decode artifacts: every row of the table in
docs/guides/serving_validation.md, measured again (benchmarks/bench_serving_requests.py).

With checks (the exporters' defaults) no bad request returns unflagged
numbers: SavedModel raises InvalidArgumentError naming the argument,
TFLite/ONNX either raise or set `valid=False`. Without checks ("none") the
rows marked garbage really are garbage (a negative id gives the logits of the
id it wraps to). TFLite and ONNX Runtime probes run in subprocesses, so a
crash would show as one.
"""

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

from keras_attn.generation import DecoderOnlyLM, Seq2SeqLM
from keras_attn.runtimes import signatures as gen_export
from tests import tolerance

ROOT = Path(__file__).resolve().parents[2]

_spec = importlib.util.spec_from_file_location(
    "bench_serving_requests", ROOT / "benchmarks" / "bench_serving_requests.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)

# (runtime, checks, request) -> (outcome, substring of the detail)
SM = "InvalidArgumentError"
EXPECTED = {
    ("saved_model", "assert", "negative id"): ("error", "`token_ids` must hold token ids in [0, vocabulary_size=20)"),
    ("saved_model", "assert", "id >= vocab"): ("error", "`token_ids` must hold token ids in [0, vocabulary_size=20)"),
    ("saved_model", "assert", "index = max_length"): ("error", "`index` must be in [0, max_length=8)"),
    ("saved_model", "assert", "negative index"): ("error", "`index` must be in [0, max_length=8)"),
    ("saved_model", "assert", "wrong dtype"): ("error", "expected to be a int32 tensor"),
    ("saved_model", "assert", "wrong rank"): ("error", SM),
    ("saved_model", "assert", "prompt > max_length"): ("error", "`token_ids` must hold 1 to 8 tokens"),
    ("saved_model", "none", "negative id"): ("garbage", "logits equal those of id 17"),
    ("saved_model", "none", "id >= vocab"): ("error", "indices[0,1] = 20 is not in [0, 20)"),
    ("saved_model", "none", "index = max_length"): ("garbage", ""),
    ("saved_model", "none", "negative index"): ("garbage", ""),
    ("saved_model", "none", "wrong dtype"): ("error", "expected to be a int32 tensor"),
    ("saved_model", "none", "wrong rank"): ("error", SM),
    ("saved_model", "none", "prompt > max_length"): ("garbage", ""),
    ("tflite", "flag", "negative id"): ("flagged", "valid=False"),
    ("tflite", "flag", "id >= vocab"): ("flagged", "valid=False"),
    ("tflite", "flag", "index = max_length"): ("flagged", "valid=False"),
    ("tflite", "flag", "negative index"): ("flagged", "valid=False"),
    ("tflite", "flag", "wrong dtype"): ("error", "Got value of type FLOAT32 but expected type INT32"),
    ("tflite", "flag", "wrong rank"): ("error", "RuntimeError"),
    ("tflite", "flag", "prompt > max_length"): ("error", "RuntimeError"),
    ("tflite", "none", "negative id"): ("garbage", "logits equal those of id 17"),
    ("tflite", "none", "id >= vocab"): ("error", "gather index out of bounds"),
    ("tflite", "none", "index = max_length"): ("garbage", ""),
    ("tflite", "none", "negative index"): ("garbage", ""),
    ("tflite", "none", "wrong dtype"): ("error", "Got value of type FLOAT32 but expected type INT32"),
    ("tflite", "none", "wrong rank"): ("error", "RuntimeError"),
    ("tflite", "none", "prompt > max_length"): ("error", "RuntimeError"),
    ("onnx", "flag", "negative id"): ("flagged", "valid=False"),
    ("onnx", "flag", "id >= vocab"): ("flagged", "valid=False"),
    ("onnx", "flag", "index = max_length"): ("flagged", "valid=False"),
    ("onnx", "flag", "negative index"): ("flagged", "valid=False"),
    ("onnx", "flag", "wrong dtype"): ("error", "Unexpected input data type"),
    ("onnx", "flag", "wrong rank"): ("error", "Invalid rank for input: token_ids"),
    ("onnx", "flag", "prompt > max_length"): ("flagged", "valid=False"),
    ("onnx", "none", "negative id"): ("garbage", "logits equal those of id 17"),
    ("onnx", "none", "id >= vocab"): ("error", "INVALID_ARGUMENT"),
    ("onnx", "none", "index = max_length"): ("garbage", ""),
    ("onnx", "none", "negative index"): ("garbage", ""),
    ("onnx", "none", "wrong dtype"): ("error", "Unexpected input data type"),
    ("onnx", "none", "wrong rank"): ("error", "Invalid rank for input: token_ids"),
    ("onnx", "none", "prompt > max_length"): ("garbage", ""),
}


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    return bench.build_artifacts(str(tmp_path_factory.mktemp("bad_requests")))


@pytest.fixture(scope="module")
def table(artifacts):
    return bench.probe_all(artifacts)


def test_the_table_covers_every_runtime_and_request():
    assert set(EXPECTED) == {(r, c, q) for r in bench.RUNTIMES for c in (bench.CHECKS[r], "none")
                             for q in bench.REQUESTS}


@pytest.mark.slow
@pytest.mark.parametrize("cell", sorted(EXPECTED), ids=lambda c: "-".join(c).replace(" ", "_"))
def test_bad_request_outcome(table, cell):
    outcome, detail = EXPECTED[cell]
    got = table[cell]
    assert got["outcome"] == outcome and detail in got["detail"], (cell, got)
    assert got["outcome"] != "crash"


def test_garbage_is_detected_by_the_probe(artifacts):
    """The probe's `garbage` verdict is real: a decode past the cache returns
    logits that differ from any in-range write (checked against the good call)."""
    runners = bench._runner("saved_model", artifacts[("saved_model", "none")])
    good = runners["prefill"](token_ids=bench.PROMPT_IDS)
    step = {"token_ids": bench.PROMPT_IDS[:, :1], "cache": good["cache"]}
    past = runners["decode"](index=np.array(bench.MAX_LENGTH, np.int32), **step)
    last = runners["decode"](index=np.array(bench.MAX_LENGTH - 1, np.int32), **step)
    # The write at index 8 is dropped: the cache comes back unchanged.
    np.testing.assert_array_equal(past["cache"], good["cache"])
    assert not np.array_equal(last["cache"], good["cache"])


def test_saved_model_generate_and_encoder_ids_are_checked(tmp_path):
    model = Seq2SeqLM(23, 8, 16, num_layers=1, num_heads=2, intermediate_dim=32,
                      position="learned")
    enc = np.array([[5, 6, 7, 0]], np.int32)
    model((enc, np.array([[1]], np.int32)))
    path = gen_export.export_saved_model(model, str(tmp_path / "s2s"), max_length=6)
    loaded = tf.saved_model.load(path)
    generate = loaded.signatures["generate"]
    ok = generate(prompt_ids=tf.constant([[1]]), encoder_ids=tf.constant(enc))["tokens"]
    assert ok.shape == (1, 6)
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"generate: `encoder_ids` must hold token ids"):
        generate(prompt_ids=tf.constant([[1]]), encoder_ids=tf.constant(enc - 2))
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"`encoder_ids` must hold 1 to 8 tokens"):
        generate(prompt_ids=tf.constant([[1]]), encoder_ids=tf.ones((1, 9), tf.int32))
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"generate: `prompt_ids` must hold token ids"):
        generate(prompt_ids=tf.constant([[23]]), encoder_ids=tf.constant(enc))


def test_greedy_loop_refuses_bad_requests(artifacts):
    from ai_edge_litert.interpreter import Interpreter

    interpreter = Interpreter(model_path=artifacts[("tflite", "flag")])
    prefill = interpreter.get_signature_runner("prefill")
    decode = interpreter.get_signature_runner("decode")
    prompt = bench.PROMPT_IDS
    tokens = gen_export.greedy_loop(prefill, decode, prompt, bench.MAX_LENGTH)
    assert tokens.shape == (2, bench.MAX_LENGTH)
    with pytest.raises(ValueError, match=r"`prompt_ids` must hold token ids >= 0.*-3"):
        gen_export.greedy_loop(prefill, decode, np.where(prompt == 6, -3, prompt), 8)
    with pytest.raises(ValueError, match=r"`prompt_ids` must hold token ids in \[0, vocabulary_size=20\)"):
        gen_export.greedy_loop(prefill, decode, np.where(prompt == 6, 20, prompt), 8)
    with pytest.raises(ValueError, match=r"integer token ids"):
        gen_export.greedy_loop(prefill, decode, prompt.astype("float32"), 8)
    with pytest.raises(ValueError, match=r"2-D"):
        gen_export.greedy_loop(prefill, decode, prompt[0], 8)

    # A loop that steps past the cache is stopped by the `valid` flag.
    def decode_past(**kw):
        return decode(**dict(kw, index=np.array(bench.MAX_LENGTH, np.int32)))

    with pytest.raises(ValueError, match=r"`decode` signature flagged the request invalid \(valid=False\)"):
        gen_export.greedy_loop(prefill, decode_past, prompt, bench.MAX_LENGTH)


def test_checks_argument_is_validated():
    lm = DecoderOnlyLM(20, 8, 16, num_layers=1, num_heads=2, intermediate_dim=32)
    with pytest.raises(ValueError, match="checks"):
        gen_export.signature_functions(lm, max_length=8, checks="maybe")
    with pytest.raises(ValueError, match="checks.*TFLite has no assert"):
        gen_export.tflite_bytes(lm, max_length=8, batch_size=1, prompt_length=2, checks="assert")


def test_model_signature_checks_ids_against_each_embedding(dates_model, tmp_path):
    """Each embedded input is checked against its own vocabulary (73 and 13 for
    the dates model); `check_ids=False` shows the wrap the check prevents."""
    from keras_attn.export import export_saved_model

    model, vocabularies = dates_model
    enc_vocab, dec_vocab = vocabularies["encoder_inputs"], vocabularies["decoder_inputs"]
    good = {"encoder_inputs": np.array([[3, 4, 5, 0]], np.int32),
            "decoder_inputs": np.array([[1, 2, 3]], np.int32)}
    report = export_saved_model(model, tmp_path / "checked", sample_inputs=good)
    assert report.details["checked_ids"] == {"encoder_inputs": enc_vocab,
                                             "decoder_inputs": dec_vocab}
    fn = tf.saved_model.load(report.path).signatures["serving_default"]
    call = lambda **kw: fn(**{k: tf.constant(v) for k, v in {**good, **kw}.items()})  # noqa: E731
    tolerance.assert_close(call()["logits"].numpy(), np.asarray(model(good)), terms=tolerance.LAYER_TERMS)
    # An id the encoder table has but the decoder's does not.
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=rf"`decoder_inputs` must hold token ids in \[0, vocabulary_size={dec_vocab}\)"):
        call(decoder_inputs=np.array([[1, dec_vocab, 3]], np.int32))
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=rf"`encoder_inputs` must hold token ids in \[0, vocabulary_size={enc_vocab}\)"):
        call(encoder_inputs=np.array([[3, -4, 5, 0]], np.int32))
    unchecked = export_saved_model(model, tmp_path / "unchecked", sample_inputs=good,
                                   check_ids=False)
    raw = tf.saved_model.load(unchecked.path).signatures["serving_default"]
    wrapped = raw(encoder_inputs=tf.constant([[3, -4, 5, 0]]),
                  decoder_inputs=tf.constant(good["decoder_inputs"]))["logits"].numpy()
    want = np.asarray(model({**good, "encoder_inputs": np.array([[3, enc_vocab - 4, 5, 0]])}))
    tolerance.assert_close(wrapped, want, terms=tolerance.LAYER_TERMS)


@pytest.fixture(scope="module")
def dates_model():
    """The demo's dates translator (untrained): two embedded inputs with their
    own vocabularies (encoder 73 ids, decoder 13), both with padding id 0."""
    import argparse

    import keras

    from keras_attn.data.pipelines import dates_tokenizers
    from keras_attn.training import quickstart

    keras.utils.set_random_seed(0)
    args = argparse.Namespace(embedding_dim=16, num_heads=2, intermediate_dim=32, num_layers=1,
                              epochs=1, num_train=64, batch_size=32, learning_rate=1e-3)
    source, target = dates_tokenizers()
    model, _ = quickstart.build_dates_model(args, source, target, dynamic_length=True)
    return model, {"encoder_inputs": source.vocabulary_size,
                   "decoder_inputs": target.vocabulary_size}


def _bad_id_requests(vocabularies):
    """Rows: in range; a negative id; an id past the vocabulary (per input)."""
    enc_vocab, dec_vocab = vocabularies["encoder_inputs"], vocabularies["decoder_inputs"]
    encoder = np.array([[3, 4, 5, 0], [3, -3, 5, 0], [3, 4, 5, 0]], np.int32)
    decoder = np.array([[1, 2, 3], [1, 2, 3], [1, dec_vocab + 5, 3]], np.int32)
    assert enc_vocab > 5
    return {"encoder_inputs": encoder, "decoder_inputs": decoder}


@pytest.mark.parametrize("fmt", ["saved_model", "tflite", "onnx"])
def test_model_exports_clamp_and_flag_out_of_range_ids(fmt, dates_model, tmp_path):
    """TFLite and ONNX cannot raise: an out-of-range id is clamped before both
    the embedding lookup and the padding mask, so the answer is exactly the
    clamped id's (id -3 -> 0, the padding id, here), and `check_ids="flag"`
    reports the row as not valid. The default ("clamp") has no extra output."""
    import onnxruntime as ort
    from ai_edge_litert import interpreter as litert

    from keras_attn import export

    model, vocabularies = dates_model
    feed = _bad_id_requests(vocabularies)
    clamped = {k: np.clip(v, 0, vocabularies[k] - 1) for k, v in feed.items()}
    want_logits = np.asarray(model(clamped))
    want_valid = np.array([True, False, False])
    good = {k: v[:1] for k, v in feed.items()}

    def run(path, names):
        if fmt == "saved_model":
            fn = tf.saved_model.load(path).signatures["serving_default"]
            out = {k: v.numpy() for k, v in fn(**{k: tf.constant(v) for k, v in feed.items()}).items()}
            assert sorted(out) == sorted(names)
            return out
        if fmt == "onnx":
            session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
            assert sorted(o.name for o in session.get_outputs()) == sorted(names)
            return dict(zip(names, session.run(names, feed)))
        runner = litert.Interpreter(model_path=path).get_signature_runner("serving_default")
        out = runner(**feed)
        assert sorted(out) == sorted(names)
        return out

    exporter = {"onnx": export.export_onnx, "tflite": export.export_tflite,
                "saved_model": export.export_saved_model}[fmt]
    flagged = exporter(model, str(tmp_path / f"flag.{fmt}"), sample_inputs=good, check_ids="flag")
    assert flagged.details["check_ids"] == "flag"
    got = run(flagged.path, ["logits", "valid"])
    np.testing.assert_array_equal(got["valid"], want_valid)
    tolerance.assert_close(got["logits"], want_logits, terms=16, err_msg=f"{fmt} flag")
    # Not the raw ids' answer: the negative id would wrap around in a traced Keras
    # call (an eager one refuses it, tests/layers/test_embedding_id_checks.py).
    wrapped = np.asarray(tf.function(model)({k: v[1:2] for k, v in feed.items()}))[0]
    assert not np.allclose(wrapped, want_logits[1], atol=1e-3)

    default = exporter(model, str(tmp_path / f"default.{fmt}"), sample_inputs=good,
                       **({"check_ids": "clamp"} if fmt == "saved_model" else {}))
    assert default.details["check_ids"] == "clamp"
    got = run(default.path, ["logits"])
    tolerance.assert_close(got["logits"], want_logits, terms=16, err_msg=f"{fmt} clamp")


def test_check_ids_values_are_validated(dates_model, tmp_path):
    from keras_attn import export

    model, _ = dates_model
    with pytest.raises(ValueError, match=r"check_ids.*\[None, 'clamp', 'flag'\].*'assert'"):
        export.export_tflite(model, str(tmp_path / "m.tflite"), check_ids="assert")
    with pytest.raises(ValueError, match=r"check_ids.*'maybe'"):
        export.export_onnx(model, str(tmp_path / "m.onnx"), check_ids="maybe")
    with pytest.raises(ValueError, match=r"check_ids.*'assert'"):
        export.export_all(model, tmp_path, check_ids="assert")
