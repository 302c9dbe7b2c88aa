"""Bounded decode reads: the exports' decode reads the filled part of the cache only.

`keras_attn.ops.cache.bounded_reads` cuts a cached call's keys to the
filled slots rounded up to a bucket (and, with a sliding window, drops the
slots before the band); the runtimes' `decode` traces run inside it. Each
path is checked against the Keras model's full forward pass (no cache), at
fills on both sides of the bucket edges, with the slots the bound leaves out
poisoned with NaN: a read of any of them would make the logits NaN (the
full-read trace on the same caches shows it does).
"""

import os

import numpy as np
import pytest
import tensorflow as tf

from keras_attn.generation.models import DecoderOnlyLM
from keras_attn.ops import cache as cache_ops
from keras_attn.runtimes import trace as decoder_trace
from tests import tolerance

MAX_LEN = 24
BUCKET = 4
WINDOWS = [5, None]  # a sliding-window layer (a band over a full cache) and a global one
# Queries at the last slot of a bucket, the first of the next, inside one, the last slot.
FILLS = (3, 4, 6, 7, 8, 13, MAX_LEN - 1)


@pytest.fixture(scope="module")
def lm():
    model = DecoderOnlyLM(40, 64, 32, num_layers=2, num_heads=4, num_key_value_heads=2,
                          intermediate_dim=48, position="rotary", sliding_window=WINDOWS)
    model(tf.zeros((1, 1), tf.int32))
    return model


@pytest.fixture(scope="module")
def tokens(lm):
    ids = np.random.default_rng(0).integers(1, lm.vocabulary_size, size=(1, MAX_LEN))
    return ids.astype("int32")


@pytest.fixture(scope="module")
def reference(lm, tokens):
    """The Keras model's logits over the whole sequence, without any cache."""
    return np.asarray(lm(tokens), np.float64)[0]


@pytest.fixture(scope="module")
def caches(lm, tokens):
    """`{fill: [key_0, value_0, ...]}`: tokens `[0, fill)` prefilled (every slot
    of a full-length cache), the slots no bounded read reaches set to NaN."""
    out = {}
    for fill in FILLS:
        cache = lm.init_cache(1, MAX_LEN, ring_buffers=False)
        _, cache = lm.call_with_cache(tokens[:, :fill], cache, 0)
        flat = [np.array(t) for layer in cache for t in layer["self_attention"]]
        end = min(MAX_LEN, (fill // BUCKET + 1) * BUCKET)
        for i, window in enumerate(WINDOWS):
            start = 0 if window is None else max(0, fill - window + 1) // BUCKET * BUCKET
            for t in flat[2 * i: 2 * i + 2]:
                t[:, end:] = np.nan
                t[:, :start] = np.nan
        out[fill] = flat
    return out


def check_logits(got, reference, fill, what):
    want = reference[fill]
    tolerance.assert_close(np.reshape(got, want.shape), want, scale=np.abs(want).max(),
                           terms=64, err_msg=f"{what}, query at position {fill}")


def test_bounds_reach_the_filled_slots_only():
    """The cut `filled_part` makes, against its definition in NumPy."""
    key = np.arange(2 * 10 * 1 * 1, dtype="float32").reshape(2, 10, 1, 1)
    positions = np.arange(10, dtype="int32")
    for first, last, window in ((0, 0, None), (3, 3, None), (4, 4, None), (2, 5, None),
                                (9, 9, None), (7, 7, 3), (9, 9, 2), (1, 1, 3),
                                # positions outside the cache still read at least one slot
                                (-1, -1, None), (-1, -1, 3), (20, 20, 3), (20, 20, None)):
        got = cache_ops.filled_part(tf.constant(key), tf.constant(key), tf.constant(positions),
                                    None, tf.constant(first), tf.constant(last), 4, window)
        end = min(10, max(1, -(-(last + 1) // 4)) * 4)
        start = 0 if window is None else min(max(0, first - window + 1), end - 1) // 4 * 4
        np.testing.assert_array_equal(got[0].numpy(), key[:, start:end])
        np.testing.assert_array_equal(got[2].numpy(), positions[start:end])
        assert got[3] is None
    with pytest.raises(ValueError, match="bucket"):
        with cache_ops.bounded_reads(0):
            pass


@pytest.mark.parametrize("update_slices", [False, True])
def test_bounded_decode_equals_the_full_forward(lm, reference, tokens, caches, update_slices):
    """The trace every writer uses: `DecoderTrace.decode` in a graph whose
    position is a tensor; the full read of the same poisoned caches is NaN."""
    traces = {name: decoder_trace.DecoderTrace(lm, max_length=MAX_LEN, ring_buffers=False,
                                               read_bucket=bucket, update_slices=update_slices)
              for name, bucket in (("bounded", BUCKET), ("full", None))}
    steps = {}
    for name, trace in traces.items():
        def step(ids, keys_values, index, trace=trace):
            logits, cache = trace.decode(ids, trace.cache(keys_values), index)
            return logits, trace.keys_values(cache)

        steps[name] = tf.function(step, autograph=False)
    for fill in FILLS:
        ids, index = tokens[:, fill:fill + 1], tf.constant(fill)
        logits, cache = steps["bounded"](ids, caches[fill], index)
        check_logits(logits.numpy(), reference, fill, f"bounded (update_slices={update_slices})")
        for new, old in zip(cache, caches[fill]):  # one slot written, the rest as they were
            new = new.numpy()
            np.testing.assert_array_equal(np.delete(new, fill, axis=1),
                                          np.delete(old, fill, axis=1))
            assert np.isfinite(new[:, fill]).all()
        assert np.isnan(steps["full"](ids, caches[fill], index)[0].numpy()).all()
    # A position past the cache (an unchecked bad request) drops the write, as `write_cache`.
    for index in (MAX_LEN, -1):
        _, cache = steps["bounded"](tokens[:, :1], caches[FILLS[-1]], tf.constant(index))
        for new, old in zip(cache, caches[FILLS[-1]]):
            np.testing.assert_array_equal(new.numpy(), old)


def stacked(flat):
    """`(num_layers, 2, B, L, H, D)`: the prefill/decode signatures' cache."""
    return np.stack([np.stack(flat[i:i + 2]) for i in range(0, len(flat), 2)])


@pytest.fixture
def small_bucket(monkeypatch):
    monkeypatch.setattr(decoder_trace, "READ_BUCKET", BUCKET)


def test_tflite_decode_reads_the_filled_part(lm, reference, tokens, caches, small_bucket):
    from ai_edge_litert import interpreter as litert

    from keras_attn.export.tflite import tflite_op_names
    from keras_attn.runtimes.signatures import tflite_bytes

    content = tflite_bytes(lm, max_length=MAX_LEN, batch_size=1, prompt_length=4, checks="none")
    assert "DYNAMIC_UPDATE_SLICE" in tflite_op_names(content)
    decode = litert.Interpreter(model_content=content).get_signature_runner("decode")
    for fill in FILLS:
        out = decode(token_ids=tokens[:, fill:fill + 1], cache=stacked(caches[fill]),
                     index=np.array(fill, np.int32))
        check_logits(out["logits"], reference, fill, "TFLite decode")


def test_onnx_and_saved_model_decode_read_the_filled_part(lm, reference, tokens, caches,
                                                         small_bucket):
    import onnxruntime as ort

    from keras_attn.runtimes.signatures import onnx_models, signature_functions

    proto = onnx_models(lm, max_length=MAX_LEN, checks="none")["decode"]
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    saved_model_decode = signature_functions(lm, max_length=MAX_LEN, checks="assert")["decode"]
    for fill in FILLS:
        ids, cache, index = tokens[:, fill:fill + 1], stacked(caches[fill]), np.array(fill, np.int32)
        logits = session.run(None, {"token_ids": ids, "cache": cache, "index": index})
        check_logits(logits[names.index("logits")], reference, fill, "ONNX decode")
        out = saved_model_decode(token_ids=ids, cache=cache, index=index)
        check_logits(out["logits"].numpy(), reference, fill, "SavedModel decode")


def test_litertlm_bundle_reads_the_filled_part(lm, reference, tokens, caches, small_bucket):
    from ai_edge_litert import interpreter as litert

    from keras_attn.runtimes.litertlm import litertlm_tflite, runtime_logits

    content = litertlm_tflite(lm, max_length=MAX_LEN, prefill_lengths=(3, 8))
    # LiteRT-LM's schedule: prefill chunks (bounded reads, select writes), then decode steps.
    got, first = runtime_logits(content, tokens[0])
    tolerance.assert_close(got, reference[first:], scale=np.abs(reference).max(), terms=64,
                           err_msg="LiteRT-LM schedule")
    decode = litert.Interpreter(model_content=content).get_signature_runner("decode")
    for fill in FILLS:
        kv = {f"kv_cache_{kind}_{i // 2}": t for i, (kind, t) in
              enumerate(zip("kv" * len(WINDOWS), caches[fill]))}
        out = decode(tokens=tokens[:, fill:fill + 1], input_pos=np.array([fill], np.int32), **kv)
        check_logits(out["logits"], reference, fill, "LiteRT-LM decode")


# -- decode_step: the caller keeps the cache and passes its first L slots --------

STEP_PATHS = ("tflite_direct", "tflite_traced", "onnx_direct", "onnx_traced", "saved_model")


@pytest.fixture(scope="module")
def rms_lm():
    """`lm` with RMSNorm and a SiLU feed-forward: what the direct TFLite writer covers."""
    model = DecoderOnlyLM(40, 64, 32, num_layers=2, num_heads=4, num_key_value_heads=2,
                          intermediate_dim=48, position="rotary", sliding_window=WINDOWS,
                          normalization="rms_norm", activation="silu")
    model(tf.zeros((1, 1), tf.int32))
    return model


def step_signature(path, model):
    """The `decode_step` of one export path, as a callable over NumPy dicts."""
    from keras_attn.runtimes import signatures

    if path.startswith("tflite"):
        from ai_edge_litert import interpreter as litert

        content = signatures.tflite_bytes(model, max_length=MAX_LEN, batch_size=1, prompt_length=4,
                                          writer=path.split("_")[1])
        return litert.Interpreter(model_content=content).get_signature_runner("decode_step")
    if path.startswith("onnx"):
        import onnxruntime as ort

        proto = signatures.onnx_models(model, max_length=MAX_LEN, writer=path.split("_")[1])["decode_step"]
        session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
        names = [o.name for o in session.get_outputs()]
        return lambda **kwargs: dict(zip(names, session.run(None, kwargs)))
    fn = signatures.signature_functions(model, max_length=MAX_LEN, checks="assert")["decode_step"]
    return lambda **kwargs: {k: v.numpy() for k, v in fn(**kwargs).items()}


@pytest.mark.parametrize("path", STEP_PATHS)
def test_decode_step_reads_only_the_slots_passed(path, lm, rms_lm, tokens, small_bucket):
    """Given only the first `L` slots (the filled ones and the new one, a
    bucket's worth, or all), `decode_step` gives the full forward pass's
    logits at `index` and, as `new_cache`, the keys and values Keras's
    cached call writes at that slot. The read bucket is 4: inside the slots
    passed, the step reads the filled part only, as `decode` does."""
    model = rms_lm if path == "tflite_direct" else lm
    reference = np.asarray(model(tokens), np.float64)[0]
    step = step_signature(path, model)
    for fill in FILLS:
        cache = model.init_cache(1, MAX_LEN, ring_buffers=False)
        _, cache = model.call_with_cache(tokens[:, :fill], cache, 0)
        _, written = model.call_with_cache(tokens[:, fill:fill + 1], cache, fill)
        held = stacked([np.array(t) for layer in cache for t in layer["self_attention"]])
        want = stacked([np.array(t) for layer in written for t in layer["self_attention"]])[:, :, :, fill]
        for slots in sorted({fill + 1, min(MAX_LEN, (fill // BUCKET + 2) * BUCKET), MAX_LEN}):
            out = step(token_ids=tokens[:, fill:fill + 1], cache=np.ascontiguousarray(held[:, :, :, :slots]),
                       index=np.array(fill, np.int32))
            what = f"{path} decode_step, {slots} slots"
            check_logits(out["logits"], reference, fill, what)
            assert out["new_cache"].shape == want[:, :, :, None].shape, what
            tolerance.assert_close(out["new_cache"][:, :, :, 0], want, scale=np.abs(want).max(),
                                   terms=64, err_msg=what)


def test_saved_model_decode_step_is_verified_and_refuses_an_index_past_its_slots(lm, tmp_path):
    from keras_attn.runtimes import greedy_loop
    from keras_attn.runtimes.signatures import export_saved_model

    report = export_saved_model(lm, str(tmp_path / "sm"), max_length=MAX_LEN)
    assert "decode_step" in report.details["signatures"]
    assert "decode_step" in {c["signature"] for c in report.checks}
    loaded = tf.saved_model.load(os.fspath(report)).signatures

    def run(name):
        return lambda **kwargs: {k: v.numpy() for k, v in loaded[name](
            **{k: tf.constant(v) for k, v in kwargs.items()}).items()}

    prompts = np.array([[5, 6, 7], [8, 9, 0]], np.int32)
    want = greedy_loop(run("prefill"), run("decode"), prompts, MAX_LEN)
    np.testing.assert_array_equal(greedy_loop(run("prefill"), run("decode_step"), prompts, MAX_LEN,
                                              step=True), want)
    cache = run("prefill")(token_ids=prompts)["cache"]
    with pytest.raises(tf.errors.InvalidArgumentError, match="must be in \\[0, L\\)"):
        run("decode_step")(token_ids=prompts[:, :1], cache=cache[:, :, :, :4], index=np.array(4, np.int32))
