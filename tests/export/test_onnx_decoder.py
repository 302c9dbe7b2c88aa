"""The fused decoder graph (keras_attn.export.onnx_decoder) against Keras.

onnxruntime runs the written graph (GroupQueryAttention, SkipSimplified-
LayerNormalization, packed Q/K/V, MatMulNBits) for a prefill and then one
token at a time, feeding the present caches back as the past ones, as ONNX
Runtime GenAI does; every step's logits must be Keras's full forward pass
within float32 rounding. Backend-agnostic: the writer reads the Keras weights
and never TensorFlow's graph (runs on jax and torch in CI too).
"""

import numpy as np
import pytest

import keras

from keras_attn.export.onnx_decoder import decoder_model_proto
from keras_attn.export.capabilities import NotFusableError
from keras_attn.generation import DecoderOnlyLM
from tests import tolerance
from tests.reference import blockwise_dequantized
from tests.export.decoder_variants import build_lm
from tests.llm_runtime_models import forward_greedy, variable_memory

ort = pytest.importorskip("onnxruntime")

VOCAB, CACHE = 97, 32

# The options of the decoder families keras_attn.convert produces.
FAMILIES = {
    # Llama: grouped-query heads, SiLU-gated feed-forward, untied head.
    "llama": dict(num_heads=6, num_key_value_heads=2),
    # Qwen2: biased q/k/v, tied head.
    "qwen2": dict(num_heads=6, num_key_value_heads=2, attention_use_bias=True, tie_embeddings=True),
    # Gemma: multi-query, head_dim unlike hidden/heads, tanh-GELU gate, scaled embeddings.
    "gemma": dict(num_heads=4, num_key_value_heads=1, head_dim=32, activation="gelu_tanh",
                  embedding_scale=48 ** 0.5, tie_embeddings=True),
    # Mistral: a sliding window shorter than the prompt.
    "mistral": dict(num_heads=6, num_key_value_heads=2, sliding_window=5),
    # Llama 3.1 frequencies.
    "llama3_rope": dict(num_heads=6, num_key_value_heads=3, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8}),
    # Qwen3: QK-norm; a window on the first layer only.
    "qwen3": dict(num_heads=6, num_key_value_heads=2, use_qk_norm=True, sliding_window=[5, None]),
    # Gemma 2: sandwich norms, attention and final soft caps (active at these
    # logit sizes), local layers with their own rotary base.
    "gemma2": dict(num_heads=4, num_key_value_heads=2, head_dim=32, activation="gelu_tanh",
                   embedding_scale=48 ** 0.5, tie_embeddings=True, use_sandwich_norm=True,
                   attention_logit_soft_cap=4.0, final_logit_soft_cap=2.0,
                   sliding_window=[5, None], local_rope_max_wavelength=50.0),
    # Gemma 3: QK-norm and sandwich norms, global layer first.
    "gemma3": dict(num_heads=4, num_key_value_heads=1, head_dim=32, activation="gelu_tanh",
                   use_qk_norm=True, use_sandwich_norm=True, sliding_window=[None, 4],
                   local_rope_max_wavelength=50.0),
    # SmolLM3: a layer without rotary positions.
    "smollm3": dict(num_heads=6, num_key_value_heads=2, rotary_layers=[False, True]),
    # Phi-3: rotary on half of each head, LongRoPE (short factors within the cache).
    "phi3": dict(num_heads=6, num_key_value_heads=3, head_dim=32, partial_rotary_factor=0.5,
                 rope_scaling={"rope_type": "longrope", "short_factor": [1.0, 1.2, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0],
                               "long_factor": [2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0],
                               "original_max_position_embeddings": 64, "attention_factor": 1.2}),
    # Not gated, ReLU, biased everywhere (the head too).
    "plain_ffn": dict(num_heads=4, use_gated_feedforward=False, activation="relu",
                      feedforward_use_bias=True, attention_use_bias=True,
                      attention_output_use_bias=True, lm_head_use_bias=True),
}


def make_lm(**options):
    return build_lm(**options)


def run_steps(session, ids, steps, kv_heads, head_dim, num_layers):
    """Logits of a prefill of `ids[:, :-steps]` and then of each of the last
    `steps` tokens alone, with the caches carried over."""
    batch, total = ids.shape
    past = {f"past_key_values.{i}.{kind}": np.zeros((batch, kv_heads, CACHE, head_dim), np.float32)
            for i in range(num_layers) for kind in ("key", "value")}
    names = [o.name for o in session.get_outputs()]
    logits = []
    start = 0
    for end in [total - steps] + list(range(total - steps + 1, total + 1)):
        feeds = {"input_ids": ids[:, start:end].astype(np.int64),
                 "attention_mask": np.ones((batch, end), np.int64), **past}
        out = dict(zip(names, session.run(None, feeds)))
        logits.append(out["logits"])
        past = {f"past_key_values.{k[len('present.'):]}": v for k, v in out.items() if k.startswith("present.")}
        start = end
    return np.concatenate(logits, axis=1)


# Every family with prompt_logits="all": tests/export/test_decoder_writers.py.
@pytest.mark.parametrize("family", ["gemma2", "llama", "mistral", "phi3"])
def test_prefill_and_decode_logits_are_keras(family):
    lm = make_lm(**FAMILIES[family])
    ids = np.random.default_rng(1).integers(1, VOCAB, (2, 14))
    want = keras.ops.convert_to_numpy(lm(ids))
    for prompt_logits in ("last",):
        proto = decoder_model_proto(lm, max_length=CACHE, prompt_logits=prompt_logits)
        session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
        got = run_steps(session, ids, 3, lm.num_key_value_heads, lm.head_dim, lm.num_layers)
        # "last": the prompt's last position, then each decode step's.
        expected = want if prompt_logits == "all" else want[:, -4:]
        tolerance.assert_close(got, expected, terms=tolerance.LAYER_TERMS * lm.num_layers,
                               err_msg=f"{family}, prompt_logits={prompt_logits}")
    # The window is really applied: without it the logits differ.
    if lm.sliding_window is not None and family == "mistral":
        unwindowed = make_lm(**{k: v for k, v in FAMILIES[family].items() if k != "sliding_window"})
        assert np.abs(keras.ops.convert_to_numpy(unwindowed(ids)) - want).max() > 0.1


@pytest.mark.parametrize("prompt_logits", ["all", "last"])
def test_right_padded_prompts_give_each_rows_last_token(prompt_logits):
    """A batch as GenAI sends it: the shorter prompt right-padded, its pads
    masked. "last" must take each row's own last token (not the batch's last
    position, which is a pad in the shorter row); a decode step after it
    continues each row from there."""
    lm = make_lm(**FAMILIES["llama"])
    rng = np.random.default_rng(2)
    lengths = (11, 6)
    ids = np.zeros((2, max(lengths)), np.int64)
    mask = np.zeros((2, max(lengths)), np.int64)
    rows = [rng.integers(1, VOCAB, n + 1) for n in lengths]  # prompt + one decoded token
    for r, (row, n) in enumerate(zip(rows, lengths)):
        ids[r, :n], mask[r, :n] = row[:n], 1
    proto = decoder_model_proto(lm, max_length=CACHE, prompt_logits=prompt_logits)
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    past = {f"past_key_values.{i}.{kind}": np.zeros((2, lm.num_key_value_heads, CACHE, lm.head_dim), np.float32)
            for i in range(lm.num_layers) for kind in ("key", "value")}
    out = dict(zip(names, session.run(None, {"input_ids": ids, "attention_mask": mask, **past})))
    past = {f"past_key_values.{k[len('present.'):]}": v for k, v in out.items() if k.startswith("present.")}
    step_ids = np.array([[row[-1]] for row in rows], np.int64)
    step_mask = np.concatenate([mask, np.ones((2, 1), np.int64)], axis=1)
    step = dict(zip(names, session.run(None, {"input_ids": step_ids, "attention_mask": step_mask, **past})))
    for r, (row, n) in enumerate(zip(rows, lengths)):
        want = keras.ops.convert_to_numpy(lm(row[None].astype("int32")))[0]
        prompt_last = out["logits"][r, n - 1 if prompt_logits == "all" else 0]
        tolerance.assert_close(prompt_last, want[n - 1], terms=tolerance.LAYER_TERMS * lm.num_layers,
                               err_msg=f"row {r}, prompt")
        tolerance.assert_close(step["logits"][r, 0], want[n], terms=tolerance.LAYER_TERMS * lm.num_layers,
                               err_msg=f"row {r}, decode step")
    assert out["logits"].shape[1] == (max(lengths) if prompt_logits == "all" else 1)


def test_graph_is_the_fused_kernels():
    lm = make_lm(**FAMILIES["llama"])
    graph = decoder_model_proto(lm, max_length=CACHE).graph
    counts = {}
    for node in graph.node:
        counts[node.op_type] = counts.get(node.op_type, 0) + 1
    assert counts["GroupQueryAttention"] == lm.num_layers
    assert counts["SkipSimplifiedLayerNormalization"] == 2 * lm.num_layers
    # Only the normalized sum and the sum: a named mean / inverse std is
    # written on every call (about 1% of a decode step at Qwen2.5-0.5B).
    for node in graph.node:
        if node.op_type == "SkipSimplifiedLayerNormalization":
            assert list(node.output[1:3]) == ["", ""], node.name
    # q/k/v packed, output, gate, up, down per layer; the head.
    assert counts["MatMul"] == 5 * lm.num_layers + 1
    # A handful of nodes per layer, not hundreds (tf2onnx's graph); once:
    # the mask's lengths, each row's last token, the head.
    assert len(graph.node) <= 12 * lm.num_layers + 20
    gqa = next(n for n in graph.node if n.op_type == "GroupQueryAttention")
    attrs = {a.name: keras.ops.convert_to_numpy(a.i if a.type == 2 else a.f) for a in gqa.attribute}
    assert attrs["do_rotary"] == 1 and attrs["num_heads"] == 6 and attrs["kv_num_heads"] == 2
    assert np.isclose(attrs["scale"], 1 / np.sqrt(lm.head_dim))


@pytest.mark.parametrize("bits", [4, 8])
def test_nbits_weights_are_the_blockwise_quantized_kernels(bits):
    """With `accuracy_level=0` onnxruntime computes in float32 on the
    dequantized weights: the logits are those of the Keras model whose
    projection kernels are replaced by their quantized values (computed in
    this test), on every CPU."""
    lm = make_lm(**FAMILIES["qwen2"])
    proto = decoder_model_proto(lm, max_length=CACHE, bits=bits, accuracy_level=0, prompt_logits="all")
    assert sum(n.op_type == "MatMulNBits" for n in proto.graph.node) == 5 * lm.num_layers + 1
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    ids = np.random.default_rng(2).integers(1, VOCAB, (1, 12))
    got = run_steps(session, ids, 2, lm.num_key_value_heads, lm.head_dim, lm.num_layers)
    reference = make_lm(**FAMILIES["qwen2"])
    for w in reference.weights:
        if w.path.endswith("kernel"):
            value = keras.ops.convert_to_numpy(w)
            w.assign(blockwise_dequantized(value.reshape(value.shape[0], -1) if "attention_output" not in w.path
                                  else value.reshape(-1, value.shape[-1]), bits).reshape(value.shape))
    # The tied table is stored once, as the quantized head: the lookup reads
    # the same quantized values (GatherBlockQuantized), as the builder does.
    table = keras.ops.convert_to_numpy(lm.embedding.embeddings)
    head = blockwise_dequantized(table.T, bits)
    reference.embedding.embeddings.assign(head.T)
    hidden = _final_hidden(reference, ids)
    want = hidden @ head
    tolerance.assert_close(got, want, terms=tolerance.LAYER_TERMS * lm.num_layers)
    float_logits = keras.ops.convert_to_numpy(lm(ids))
    assert np.abs(got - float_logits).max() > tolerance.bound(tolerance.magnitude(want), terms=128)


@pytest.mark.parametrize("bits", [None, 8, 4])
def test_tied_table_is_stored_once(bits):
    """A tied table is one initializer (the head's), as the builder writes
    it: the lookup reads the head's weight, so the file holds no second
    vocabulary-sized tensor."""
    lm = make_lm(**FAMILIES["gemma"])
    proto = decoder_model_proto(lm, max_length=CACHE, bits=bits)
    by_vocab = [t.name for t in proto.graph.initializer if VOCAB in t.dims]
    assert len(by_vocab) == (1 if bits is None else 2), by_vocab  # codes (+ scales)
    lookups = {n.op_type for n in proto.graph.node if n.name.startswith("/model/embed_tokens/")}
    assert ("GatherBlockQuantized" in lookups) == (bits is not None), lookups
    # Nothing reads the table through a Transpose: onnxruntime would fold it
    # into a second vocabulary-sized tensor when it loads the model.
    transposed = [n.name for n in proto.graph.node if n.op_type == "Transpose" and set(n.input) & set(by_vocab)]
    assert not transposed, transposed
    # The head (or the soft cap) writes `logits` itself: no copy per call.
    assert not [n.name for n in proto.graph.node if n.op_type == "Identity"]


def _final_hidden(lm, ids):
    """The normalized last hidden states of `lm` (the head's input)."""
    x = lm.embedding(ids)
    if lm.embedding_scale is not None:
        x = x * lm.embedding_scale
    for block in lm.blocks:
        x = block(x)
    return keras.ops.convert_to_numpy(lm.final_norm(x))


def test_refuses_what_it_does_not_cover_by_name():
    learned = DecoderOnlyLM(VOCAB, 16, 16, num_layers=1, num_heads=2, intermediate_dim=16,
                            position="learned")
    learned(np.zeros((1, 1), "int32"))
    with pytest.raises(NotFusableError, match="position='learned'"):
        decoder_model_proto(learned, max_length=8)
    layer_norm = make_lm(normalization="layer_norm", num_heads=4)
    with pytest.raises(NotFusableError, match="normalization='layer_norm'"):
        decoder_model_proto(layer_norm, max_length=8)
    dynamic = make_lm(num_heads=4, rope_scaling={"rope_type": "dynamic", "factor": 2.0,
                                                 "original_max_position_embeddings": 8})
    with pytest.raises(NotFusableError, match="dynamic"):
        decoder_model_proto(dynamic, max_length=8)
    with pytest.raises(NotFusableError, match="head_dim=24"):
        decoder_model_proto(make_lm(num_heads=4, head_dim=24), max_length=8)
    longrope = make_lm(**FAMILIES["phi3"])
    with pytest.raises(NotFusableError, match="longrope"):
        decoder_model_proto(longrope, max_length=65)  # past original_max_position_embeddings
    with pytest.raises(NotFusableError, match="rotates 8 of 16"):
        decoder_model_proto(make_lm(num_heads=4, partial_rotary_factor=0.5), max_length=8)
    with pytest.raises(ValueError, match="`bits`"):
        decoder_model_proto(make_lm(num_heads=4), max_length=8, bits=3)


def test_genai_folder_generates_keras_greedy_tokens_on_this_backend(tmp_path):
    """`export_onnx_genai(writer="direct")` needs no TensorFlow graph: on any
    Keras backend, onnxruntime_genai's greedy tokens are those of Keras's
    full forward pass taken token by token."""
    og = pytest.importorskip("onnxruntime_genai")
    from keras_attn.runtimes import export_onnx_genai

    lm = make_lm(**FAMILIES["qwen2"])
    export_onnx_genai(lm, tmp_path, max_length=CACHE, writer="direct", eos_token_id=0)
    prompt = [5, 17, 33, 2, 60, 41]
    model = og.Model(str(tmp_path))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(prompt) + 10, do_sample=False)
    generator = og.Generator(model, params)
    generator.append_tokens(np.array([prompt], np.int32))
    while not generator.is_done():
        generator.generate_next_token()
    got = list(np.asarray(generator.get_sequence(0)))
    want = forward_greedy(lm, prompt, len(got))
    assert got == want
    assert len(set(got[len(prompt):])) >= 3, "degenerate generation tests nothing"


def test_fused_encoder_export_runs_on_this_backend(tmp_path):
    """`export_onnx(fused=True)` writes an encoder from the Keras weights and
    verifies it against Keras on any backend (tf2onnx, its fallback, needs
    TensorFlow)."""
    import keras_attn as ka
    from keras_attn.export import export_onnx

    ids = keras.Input((None,), dtype="int32", name="tokens")
    h = ka.TokenAndPositionEmbedding(vocabulary_size=VOCAB, sequence_length=16, embedding_dim=32,
                                     position="learned")(ids)
    h = ka.TransformerEncoderBlock(num_heads=4, intermediate_dim=64, activation="gelu")(h)
    model = keras.Model(ids, keras.layers.Dense(3, name="logits")(h))
    sample = {"tokens": np.random.default_rng(0).integers(1, VOCAB, (2, 8)).astype("int32")}
    report = export_onnx(model, str(tmp_path / "encoder.onnx"), fused=True, sample_inputs=sample)
    assert report.details["fused"]["Attention"] == 1 and report.details["fused"]["BiasGelu"] == 1


@pytest.mark.parametrize("bits", [4, 8])
def test_nbits_weight_layout_past_one_chunk_of_columns(bits, monkeypatch):
    """`nbits_weight` over more output columns than it quantizes at once:
    the codes unpacked here (low nibble first, zero point 2^(bits-1))
    times the scales give this test's own blockwise quantization."""
    from keras_attn.export import onnx_quantize

    # 700 columns a chunk: 12 whole chunks and a part one, on any number of cores.
    monkeypatch.setattr(onnx_quantize, "_NUMBERS_PER_CHUNK", 40 * 700)
    weight = np.random.default_rng(3).standard_normal((40, 9000)).astype(np.float32)
    weight[:, 5] = 0  # a block of zeros: scale 0, codes at the zero point
    stored, scales = onnx_quantize.nbits_weight(weight, bits, 32)
    if bits == 4:
        stored = np.stack([stored & 15, stored >> 4], axis=-1).reshape(stored.shape[0], stored.shape[1], -1)
    codes = stored.astype(np.float32) - 2 ** (bits - 1)  # (N, blocks, 32)
    got = (codes * scales.reshape(codes.shape[0], -1, 1)).reshape(codes.shape[0], -1)[:, :40].T
    np.testing.assert_array_equal(got, blockwise_dequantized(weight, bits))


def _spy_on_verification(monkeypatch, before=None):
    """Records the `shared` weights `export_onnx_genai` hands its verification
    (calling `before(path, shared)` first)."""
    from keras_attn.runtimes import onnx_genai

    seen = {}
    verify = onnx_genai.verify_genai_model

    def spy(model, path, **kwargs):
        seen.update(kwargs["shared"])
        if before is not None:
            before(path, kwargs["shared"])
        return verify(model, path, **kwargs)

    monkeypatch.setattr(onnx_genai, "verify_genai_model", spy)
    monkeypatch.setattr(onnx_genai, "EXTERNAL_DATA_BYTES", 0)  # weights in model.onnx.data
    return seen


def test_genai_verification_runs_on_the_models_own_weights(tmp_path, monkeypatch):
    """A float32 export's verification runs onnxruntime on the Keras
    variables' own memory, not on a second copy mapped from
    `model.onnx.data`: each such weight the writer hands over is a view of
    its variable's buffer, and the file holds exactly its values."""
    import onnx
    from onnx import numpy_helper

    from keras_attn.runtimes import export_onnx_genai

    lm = make_lm(**FAMILIES["qwen2"])
    shared = _spy_on_verification(monkeypatch)
    report = export_onnx_genai(lm, tmp_path, max_length=CACHE, writer="direct")
    assert report.max_abs_error <= report.atol
    variables = {"model.embed_tokens.weight": lm.embedding.embeddings}
    for i, block in enumerate(lm.blocks):
        variables[f"/model/layers.{i}/mlp/gate_proj.weight"] = block.feedforward_gate_dense.kernel
        variables[f"/model/layers.{i}/mlp/down_proj.weight"] = block.feedforward_output_dense.kernel
    assert set(variables) <= set(shared), sorted(set(variables) - set(shared))
    written = {t.name: numpy_helper.to_array(t, base_dir=str(tmp_path))
               for t in onnx.load(str(tmp_path / "model.onnx"), load_external_data=False).graph.initializer}
    for name, variable in variables.items():
        assert np.shares_memory(shared[name], variable_memory(variable)), name
        assert not shared[name].flags.writeable, name
        np.testing.assert_array_equal(written[name], keras.ops.convert_to_numpy(variable))
    # The packed Q/K/V is made for the file: read from it, not handed over.
    assert "/model/layers.0/attn/qkv_proj.weight" not in shared


def test_genai_weight_written_wrong_is_caught(tmp_path, monkeypatch):
    """One byte of a handed-over weight changed in `model.onnx.data` before
    the verification: the export fails with a `ParityError` naming it and
    leaves no model behind."""
    import onnx

    from keras_attn.export.report import ParityError
    from keras_attn.runtimes import export_onnx_genai

    name = "/model/layers.1/mlp/up_proj.weight"

    def flip_a_byte(path, shared):
        tensor = next(t for t in onnx.load(path, load_external_data=False).graph.initializer if t.name == name)
        where = {e.key: e.value for e in tensor.external_data}
        with open(tmp_path / where["location"], "r+b") as f:
            f.seek(int(where["offset"]) + 17)
            byte = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([byte[0] ^ 1]))

    _spy_on_verification(monkeypatch, before=flip_a_byte)
    with pytest.raises(ParityError, match="up_proj"):
        export_onnx_genai(make_lm(**FAMILIES["llama"]), tmp_path, max_length=CACHE, writer="direct")
    assert not (tmp_path / "model.onnx").exists() and not (tmp_path / "model.onnx.data").exists()


def test_external_data_check_refuses_another_shape_or_type(tmp_path):
    """`check_external_data` compares the stored type and shape too."""
    from keras_attn.export.onnx_graph import check_external_data
    from keras_attn.export.report import ParityError

    lm = make_lm(**FAMILIES["llama"])
    shared = {}
    proto = decoder_model_proto(lm, max_length=CACHE, external_data=str(tmp_path / "model.onnx.data"),
                                shared=shared)
    (tmp_path / "model.onnx").write_bytes(proto.SerializeToString())
    check_external_data(str(tmp_path / "model.onnx"), shared)
    name, array = next((k, v) for k, v in shared.items() if v.ndim == 2)
    for wrong in (array.reshape(-1), array.T, array.astype(np.float64)):
        with pytest.raises(ParityError, match=name):
            check_external_data(str(tmp_path / "model.onnx"), {name: wrong})
