"""The prefill/decode signatures' ONNX models written from the Keras weights
(keras_attn.export.onnx_signatures, `export_onnx(writer="direct")`).

onnxruntime runs the written models and every logit is checked against the
Keras model's full forward pass (no cache), and greedy generation through
`greedy_loop` against greedy decoding with full forward passes written here
(and against transformers' `generate` for a converted model). Backend-
agnostic: the writer reads the Keras weights, never a TensorFlow graph (runs
on JAX and torch in CI too).
"""

import os
import warnings

import keras
import numpy as np
import pytest

from keras_attn.export import onnx_signatures
from keras_attn.export.capabilities import NotFusableError
from keras_attn.generation import DecoderOnlyLM
from keras_attn.runtimes import greedy_loop
from keras_attn.runtimes import signatures
from tests import llm_runtime_models as models
from tests import tolerance

ort = pytest.importorskip("onnxruntime")
onnx = pytest.importorskip("onnx")

MAX_LEN = 16
# Right-padded, two rows of other lengths (pad id 0).
PROMPTS = np.array([[5, 9, 33, 7, 21], [12, 40, 3, 0, 0]], np.int32)


def _runner(session):
    names = [o.name for o in session.get_outputs()]

    def run(**kwargs):
        return {n.removesuffix("_out"): v for n, v in zip(names, session.run(None, kwargs))}

    return run


def _sessions(protos):
    return {k: _runner(ort.InferenceSession(p.SerializeToString(), providers=["CPUExecutionProvider"]))
            for k, p in protos.items()}


def keras_greedy(lm, prompts, max_length, pad=0):
    """Each row's prompt (up to its padding) extended by argmax of the Keras
    model's full forward pass (no cache), one token at a time. The forward
    pass is causal, so it runs over the whole `(B, max_length)` buffer each
    step (one shape: one compilation on JAX) and reads position `t - 1`."""
    lengths = (np.asarray(prompts) != pad).sum(1)
    tokens = np.full((len(prompts), max_length), pad, np.int32)
    tokens[:, :prompts.shape[1]] = prompts
    for t in range(int(lengths.min()), max_length):
        logits = keras.ops.convert_to_numpy(lm(tokens))
        tokens[:, t] = np.where(t < lengths, tokens[:, t], np.argmax(logits[:, t - 1], axis=-1))
    return tokens


def teacher_forced(run, ids, prompt):
    """Logits of `ids` `(B, T)`: `prefill` on the first `prompt` tokens, then
    one `decode` per token."""
    out = run["prefill"](token_ids=ids[:, :prompt])
    got, cache = [out["logits"]], out["cache"]
    for i in range(prompt, ids.shape[1]):
        out = run["decode"](token_ids=ids[:, i:i + 1], cache=cache, index=np.array(i, np.int32))
        got.append(out["logits"])
        cache = out["cache"]
    return np.concatenate(got, axis=1)


def teacher_forced_steps(run, ids, prompt):
    """`teacher_forced` through `decode_step`: the caller keeps the cache and
    passes exactly the slots filled and the new one."""
    out = run["prefill"](token_ids=ids[:, :prompt])
    got, cache = [out["logits"]], np.array(out["cache"])
    for i in range(prompt, ids.shape[1]):
        out = run["decode_step"](token_ids=ids[:, i:i + 1], cache=np.ascontiguousarray(cache[:, :, :, :i + 1]),
                                 index=np.array(i, np.int32))
        got.append(out["logits"])
        cache[:, :, :, i:i + 1] = out["new_cache"]
    return np.concatenate(got, axis=1)


def assert_logits_close(run, lm, length, prompt=4, seed=0, err_msg=""):
    """`decode` (and `decode_step` where the models have it) against Keras."""
    ids = np.random.default_rng(seed).integers(1, lm.vocabulary_size, size=(2, length)).astype("int32")
    want = keras.ops.convert_to_numpy(lm(ids)).astype(np.float64)
    paths = {"decode": teacher_forced}
    if "decode_step" in run:
        paths["decode_step"] = teacher_forced_steps
    for name, path in paths.items():
        got = path(run, ids, prompt)
        tolerance.assert_close(got, want, scale=np.abs(want).max(), terms=tolerance.LAYER_TERMS,
                               err_msg=f"{err_msg} ({name})")


def make_lm(**options):
    """A 2-layer `DecoderOnlyLM` on the test vocabulary with its weights
    spread (`llm_runtime_models.scaled_lm`'s recipe) so that greedy
    generations vary."""
    keras.utils.set_random_seed(0)
    lm = DecoderOnlyLM(models.VOCAB, 64, 32, num_layers=2, num_heads=4, intermediate_dim=48,
                       pad_token_id=0, **options)
    lm(np.array([[2, 3]], np.int32))
    rng = np.random.default_rng(0)
    for w in lm.weights:
        value = keras.ops.convert_to_numpy(w)
        w.assign(value * 3 + rng.standard_normal(w.shape).astype("float32") * 0.05)
    return lm


@pytest.fixture(scope="module")
def llama_like():
    """Rotary, RMSNorm, grouped-query heads, SiLU gate: the converters' families."""
    return make_lm(position="rotary", normalization="rms_norm", use_gated_feedforward=True,
                            activation="silu", num_key_value_heads=2)


@pytest.fixture(scope="module")
def exported(llama_like, tmp_path_factory):
    folder = tmp_path_factory.mktemp("direct") / "onnx"
    report = signatures.export_onnx(llama_like, str(folder), max_length=MAX_LEN)
    return report, {k: _runner(ort.InferenceSession(report[k], providers=["CPUExecutionProvider"]))
                    for k in ("prefill", "decode", "decode_step")}


def test_greedy_loop_gives_keras_tokens_on_a_right_padded_batch(llama_like, exported):
    report, run = exported
    assert report.details["writer"] == "direct"
    got = greedy_loop(run["prefill"], run["decode"], PROMPTS, MAX_LEN)
    want = keras_greedy(llama_like, PROMPTS, MAX_LEN)
    np.testing.assert_array_equal(got, want)
    assert len(np.unique(got[:, PROMPTS.shape[1]:])) > 3, "degenerate generation tests nothing"
    assert_logits_close(run, llama_like, MAX_LEN, err_msg="llama-like")


def test_decode_step_generates_keras_tokens_from_the_filled_slots(llama_like, exported, monkeypatch):
    """`decode_step` (the loop keeps the cache, passes its first slots rounded up
    to a bucket of 4: lengths 8, 12 and 16 here) gives the Keras model's tokens;
    its checks name the slots passed."""
    import keras_attn.runtimes.loop as loop

    report, run = exported
    assert "decode_step" in report.files and "decode_step" in {c["signature"] for c in report.checks}
    monkeypatch.setattr(loop, "STEP_BUCKET", 4)
    seen = []

    def step(**kwargs):
        seen.append(kwargs["cache"].shape[3])
        return run["decode_step"](**kwargs)

    got = greedy_loop(run["prefill"], step, PROMPTS, MAX_LEN, step=True)
    np.testing.assert_array_equal(got, keras_greedy(llama_like, PROMPTS, MAX_LEN))
    assert sorted(set(seen)) == [4, 8, 12, 16]
    cache = run["prefill"](token_ids=PROMPTS)["cache"]
    for index, slots, ok in ((3, 4, True), (4, 4, False), (-1, 4, False), (MAX_LEN - 1, MAX_LEN, True)):
        out = run["decode_step"](token_ids=PROMPTS[:, :1], cache=np.ascontiguousarray(cache[:, :, :, :slots]),
                                 index=np.array(index, np.int32))
        assert bool(out["valid"]) is ok, (index, slots)
        assert out["new_cache"].shape == (2, 2, 2, 1, 2, llama_like.head_dim)


def test_the_models_share_one_external_weights_file(llama_like, exported):
    report, _ = exported
    assert sorted(os.listdir(os.path.dirname(report["prefill"]))) == sorted([
        "decode.onnx", "decode_step.onnx", onnx_signatures.WEIGHTS_FILE, "prefill.onnx"])
    assert report.files["weights"].endswith(onnx_signatures.WEIGHTS_FILE)
    assert report.size_bytes == sum(os.path.getsize(p) for p in report.files.values())

    def external(path):
        proto = onnx.load(path, load_external_data=False)
        return {t.name: {e.key: e.value for e in t.external_data}
                for t in proto.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL}

    prefill, decode = external(report["prefill"]), external(report["decode"])
    # Every weight is stored once: the models read the same bytes of one file.
    assert prefill == decode == external(report["decode_step"])
    assert {e["location"] for e in prefill.values()} == {onnx_signatures.WEIGHTS_FILE}
    stored = sum(int(e["length"]) for e in prefill.values())
    # Each weight of 1 KB or more, once (the packed Q/K/V is the concatenation
    # of three); the smaller ones (norm scales, the rotary tables at this
    # size) sit inside the protos.
    sizes = [int(np.prod(w.shape)) * 4 for w in llama_like.weights]
    assert stored == sum(n for n in sizes if n >= 1024)
    spans = sorted((int(e["offset"]), int(e["length"])) for e in prefill.values())
    assert all(a + n <= b for (a, n), (b, _) in zip(spans, spans[1:]))  # no overlap
    assert os.path.getsize(report.files["weights"]) >= spans[-1][0] + spans[-1][1]
    # The (small) protos hold no weights: what the file holds is not in them.
    assert os.path.getsize(report["decode"]) < stored / 4


def test_verification_runs_on_the_models_weights_and_catches_a_byte_written_wrong(llama_like, tmp_path,
                                                                                   monkeypatch):
    """The verification's sessions run on the Keras variables' own memory
    (views handed over by the writer, not a second copy mapped from the
    weights file), after the file's bytes are compared with them: one byte
    changed in the file fails the export with a `ParityError` naming the
    weight, and nothing is left in the folder."""
    from keras_attn.export import onnx_graph
    from keras_attn.export.report import ParityError

    handed = {}
    make_session = onnx_graph.inference_session

    def spy(path, shared=None, prepack=True):
        handed.update(shared or {})
        return make_session(path, shared, prepack)

    monkeypatch.setattr(onnx_graph, "inference_session", spy)
    signatures.export_onnx(llama_like, str(tmp_path / "good"), max_length=MAX_LEN)
    gate = llama_like.blocks[0].feedforward_gate_dense.kernel
    views = [v for v in handed.values() if v.shape == tuple(gate.shape)]
    assert views and all(not v.flags.writeable for v in views)
    assert any(np.shares_memory(v, models.variable_memory(gate)) for v in views)

    check = onnx_graph.check_external_data

    def corrupt_then_check(path, arrays, checked=None):
        name = next(iter(arrays))
        tensor = next(t for t in onnx.load(path, load_external_data=False).graph.initializer if t.name == name)
        where = {e.key: e.value for e in tensor.external_data}
        with open(os.path.join(os.path.dirname(path), where["location"]), "r+b") as f:
            f.seek(int(where["offset"]) + 5)
            byte = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([byte[0] ^ 4]))
        return check(path, arrays, checked)

    monkeypatch.setattr(onnx_graph, "check_external_data", corrupt_then_check)
    with pytest.raises(ParityError, match="differ from the model's weight"):
        signatures.export_onnx(llama_like, str(tmp_path / "bad"), max_length=MAX_LEN)
    assert not (tmp_path / "bad").exists()


def test_the_same_model_exports_to_the_same_bytes(llama_like):
    """Nothing run-dependent (such as an object's id) names a tensor: a
    second, equal model gives byte-identical models."""
    twin = make_lm(position="rotary", normalization="rms_norm", use_gated_feedforward=True,
                   activation="silu", num_key_value_heads=2)
    first = onnx_signatures.signature_models(llama_like, max_length=MAX_LEN)
    second = onnx_signatures.signature_models(twin, max_length=MAX_LEN)
    for name in first:
        assert first[name].SerializeToString() == second[name].SerializeToString(), name


def test_every_op_is_standard_onnx(exported):
    report, _ = exported
    for name in ("prefill", "decode", "decode_step"):
        proto = onnx.load(report[name], load_external_data=False)
        assert [o.domain for o in proto.opset_import] == [""]
        assert proto.opset_import[0].version == 17
        assert not [n.op_type for n in proto.graph.node
                    if n.domain or not onnx.defs.has(n.op_type)], name
        onnx.checker.check_model(report[name])  # by path: with its external data
    decode_ops = {n.op_type for n in onnx.load(report["decode"], load_external_data=False).graph.node}
    assert {"ScatterND", "Slice"} <= decode_ops


def test_inputs_and_outputs_are_the_signatures(llama_like):
    """The names, dtypes and dynamic axes of the tf2onnx models before them."""
    protos = onnx_signatures.signature_models(llama_like, max_length=MAX_LEN)

    def io(values):
        return [(v.name, v.type.tensor_type.elem_type,
                 [d.dim_value if d.HasField("dim_value") else None for d in v.type.tensor_type.shape.dim])
                for v in values]

    int32, float32, boolean = onnx.TensorProto.INT32, onnx.TensorProto.FLOAT, onnx.TensorProto.BOOL
    cache = [2, 2, None, MAX_LEN, 2, llama_like.head_dim]
    vocab = models.VOCAB
    assert io(protos["prefill"].graph.input) == [("token_ids", int32, [None, None])]
    assert io(protos["prefill"].graph.output) == [
        ("cache", float32, cache), ("logits", float32, [None, None, vocab]), ("valid", boolean, [])]
    assert io(protos["decode"].graph.input) == [
        ("token_ids", int32, [None, 1]), ("cache", float32, cache), ("index", int32, [])]
    assert io(protos["decode"].graph.output) == [
        ("cache_out", float32, cache), ("logits", float32, [None, 1, vocab]), ("valid", boolean, [])]
    step_cache = [2, 2, None, None, 2, llama_like.head_dim]
    assert io(protos["decode_step"].graph.input) == [
        ("token_ids", int32, [None, 1]), ("cache", float32, step_cache), ("index", int32, [])]
    assert io(protos["decode_step"].graph.output) == [
        ("new_cache", float32, [2, 2, None, 1, 2, llama_like.head_dim]),
        ("logits", float32, [None, 1, vocab]), ("valid", boolean, [])]
    none = onnx_signatures.signature_models(llama_like, max_length=MAX_LEN, checks="none")
    assert [o.name for o in none["decode"].graph.output] == ["cache_out", "logits"]
    assert [o.name for o in none["decode_step"].graph.output] == ["new_cache", "logits"]


def test_flagged_requests_are_clamped_and_marked_invalid(llama_like, exported):
    _, run = exported
    good = run["prefill"](token_ids=PROMPTS)
    assert good["valid"]
    bad = PROMPTS.copy()
    bad[0, 1], bad[1, 0] = models.VOCAB + 7, -4
    out = run["prefill"](token_ids=bad)
    assert not out["valid"]
    clamped = np.clip(bad, 0, models.VOCAB - 1)
    want = keras.ops.convert_to_numpy(llama_like(clamped))
    tolerance.assert_close(out["logits"], want, scale=np.abs(want).max(), terms=tolerance.LAYER_TERMS,
                           err_msg="clamped ids")
    assert not run["prefill"](token_ids=np.ones((2, MAX_LEN + 1), np.int32))["valid"]
    step = dict(token_ids=PROMPTS[:, 2:3], cache=good["cache"])
    for index, ok in ((MAX_LEN - 1, True), (MAX_LEN, False), (-1, False)):
        out = run["decode"](index=np.array(index, np.int32), **step)
        assert bool(out["valid"]) is ok, index
        # Clamped: the call is the one at the nearest slot.
        near = run["decode"](index=np.array(min(max(index, 0), MAX_LEN - 1), np.int32), **step)
        np.testing.assert_array_equal(out["logits"], near["logits"])


def test_unchecked_models_leave_a_bad_index_unwritten(llama_like):
    run = _sessions(onnx_signatures.signature_models(llama_like, max_length=MAX_LEN, checks="none",
                                                     read_bucket=4))
    cache = run["prefill"](token_ids=PROMPTS)["cache"]
    for index in (MAX_LEN, -1):  # as keras_attn.ops.cache.write_slot: nothing is written
        out = run["decode"](token_ids=PROMPTS[:, :1], cache=cache, index=np.array(index, np.int32))
        np.testing.assert_array_equal(out["cache"], cache)
        assert "valid" not in out
    out = run["decode"](token_ids=PROMPTS[:, :1], cache=cache, index=np.array(7, np.int32))
    changed = np.any(out["cache"] != cache, axis=(0, 1, 2, 4, 5))
    np.testing.assert_array_equal(np.flatnonzero(changed), [7])  # one slot, in every layer


def test_a_sliding_window_ring_buffer_runs_past_its_window_and_its_cache(tmp_path):
    """Window 4 < max_length 8: the cache is a ring of 4 slots, which the loop
    drives to 14 tokens (positions past the export's `max_length`)."""
    lm = make_lm(position="rotary", normalization="rms_norm", use_gated_feedforward=True,
                          activation="silu", num_key_value_heads=1, sliding_window=4)
    protos = onnx_signatures.signature_models(lm, max_length=8)
    cache_dims = [d.dim_value for d in protos["decode"].graph.input[1].type.tensor_type.shape.dim]
    assert cache_dims[3] == 4
    assert "decode_step" not in protos  # the ring holds its window's slots: nothing to pass less of
    run = _sessions(protos)
    got = greedy_loop(run["prefill"], run["decode"], PROMPTS, 14, sliding_window=4)
    np.testing.assert_array_equal(got, keras_greedy(lm, PROMPTS, 14))
    with pytest.raises(ValueError, match="step=True.*ring-buffer cache of 4 slots"):
        greedy_loop(run["prefill"], run["decode"], PROMPTS, 14, sliding_window=4, step=True)
    assert_logits_close(run, lm, 14, prompt=6, err_msg="ring buffer")


# The options of the families the converters make, and the other positions
# and norms (GPT-2-like learned positions with LayerNorm).
FAMILIES = {
    # Qwen2: q/k/v biases, tied head, one key/value head.
    "qwen2": dict(position="rotary", normalization="rms_norm", use_gated_feedforward=True, activation="silu",
                  num_key_value_heads=1, attention_use_bias=True, tie_embeddings=True,
                  attention_output_use_bias=False, feedforward_use_bias=False),
    # Qwen3: QK-norm; a window on the first layer only (a band over a full cache).
    "qwen3": dict(position="rotary", normalization="rms_norm", use_gated_feedforward=True, activation="silu",
                  num_key_value_heads=2, use_qk_norm=True, sliding_window=[3, None]),
    # Gemma 2: sandwich norms, soft caps, tanh-GELU gate, scaled embeddings, local rotary base.
    "gemma2": dict(position="rotary", normalization="rms_norm", use_gated_feedforward=True,
                   activation="gelu_tanh", num_key_value_heads=2, head_dim=16, use_sandwich_norm=True,
                   attention_logit_soft_cap=2.0, final_logit_soft_cap=4.0, embedding_scale=3.0,
                   sliding_window=[None, 3], local_rope_max_wavelength=50.0),
    # Phi-3: partial rotary, LongRoPE within its original length; Llama 3.1 frequencies elsewhere.
    "phi3": dict(position="rotary", normalization="rms_norm", use_gated_feedforward=True, activation="silu",
                 partial_rotary_factor=0.5, rope_scaling={
                     "rope_type": "longrope", "short_factor": [1.0, 1.5], "long_factor": [2.0, 3.0],
                     "original_max_position_embeddings": 32, "attention_factor": 1.2}),
    "llama3_rope": dict(position="rotary", normalization="rms_norm", use_gated_feedforward=True,
                        activation="silu", rotary_layers=[False, True], rope_scaling={
                            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                            "high_freq_factor": 4.0, "original_max_position_embeddings": 8}),
    # GPT-2-like: learned positions, LayerNorm, erf GELU, tied head.
    "gpt2": dict(position="learned", activation="gelu", tie_embeddings=True),
    # The default DecoderOnlyLM: sinusoidal positions, LayerNorm, ReLU.
    "sinusoidal": dict(),
}


# Every family through prefill and decode: tests/export/test_decoder_writers.py;
# here a band over a full cache, and a table of positions, through decode_step too.
@pytest.mark.parametrize("family", ["gpt2", "qwen3"])
def test_families_match_keras(family):
    lm = make_lm(**FAMILIES[family])
    run = _sessions(onnx_signatures.signature_models(lm, max_length=12, read_bucket=4))
    assert_logits_close(run, lm, 12, err_msg=family)


def test_decode_reads_every_slot_without_a_bucket():
    lm = make_lm(**FAMILIES["qwen3"])
    run = _sessions(onnx_signatures.signature_models(lm, max_length=12, read_bucket=None))
    assert_logits_close(run, lm, 12, err_msg="read_bucket=None")


def test_a_converted_model_generates_transformers_tokens():
    transformers = pytest.importorskip("transformers")
    del transformers
    from keras_attn.convert import from_huggingface

    hf = models.hf_family("qwen2")
    lm = from_huggingface(hf)
    prompts = np.random.default_rng(4).integers(3, models.VOCAB, size=(2, 6)).astype("int32")
    run = _sessions(signatures.onnx_models(lm, max_length=MAX_LEN))
    got = greedy_loop(run["prefill"], run["decode"], prompts, MAX_LEN)
    np.testing.assert_array_equal(got, models.hf_greedy(hf, prompts, MAX_LEN))


def test_uncovered_models_fall_back_to_tf2onnx_with_the_reason(llama_like):
    per_layer = DecoderOnlyLM(models.VOCAB, 16, 32, num_layers=2, num_heads=4, intermediate_dim=48,
                              position="rotary", normalization="rms_norm", head_dim=[8, 16],
                              num_key_value_heads=[2, 1])
    with pytest.warns(UserWarning, match=r"falls back to tf2onnx.*head_dim=\[8, 16\]"):
        assert signatures.onnx_writer(per_layer, max_length=8) == "tf2onnx"
    with pytest.raises(NotFusableError, match=r"head_dim=\[8, 16\]"):
        signatures.onnx_writer(per_layer, max_length=8, writer="direct")
    relative = DecoderOnlyLM(models.VOCAB, 16, 32, num_layers=1, num_heads=4, intermediate_dim=48,
                             position="relative")
    with pytest.warns(UserWarning, match="position='relative'"):
        assert signatures.onnx_writer(relative, max_length=8) == "tf2onnx"
    ring_learned = DecoderOnlyLM(models.VOCAB, 16, 32, num_layers=1, num_heads=4, intermediate_dim=48,
                                 position="learned", sliding_window=4)
    with pytest.raises(NotFusableError, match="ring-buffer"):
        signatures.onnx_writer(ring_learned, max_length=8, writer="direct")
    covered = llama_like
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert signatures.onnx_writer(covered, max_length=8) == "direct"
        assert signatures.onnx_writer(covered, max_length=8, writer="traced") == "tf2onnx"
    with pytest.raises(ValueError, match="writer.*'fast'"):
        signatures.onnx_writer(covered, max_length=8, writer="fast")
    with pytest.raises(ValueError, match="checks.*'assert'"):
        signatures.onnx_models(covered, max_length=8, checks="assert")
